"""The `sim` runner: the simulator behind the Runner interface."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from objectives.scenario import SLA, Workload
from objectives.userfile import InputError
from runners.base import FailedSession, Session, run_once
from runners.load.measurement import Fault, Measurement
from runners.sim.costs import CostModel
from runners.sim.disaggregated import FIRST_TOKEN_FROM, DisaggregatedSession, Fleet
from runners.sim.engine import Simulation
from runners.sim.prefix_cache import HostTier, PrefixCache
from runners.sim.profiles import (
    Figure,
    HardwareProfile,
    ModelProfile,
    load_hardware,
    load_model,
)
from runners.sim.router import replica_requests
from runners.sim.scheduler import Policy, Scheduler
from runners.sim.swap import SwapSpace
from search_spaces.deployment import (
    co_located_only,
    is_disaggregated,
    memory_share,
    role_config,
    roles,
    with_deployment,
)
from search_spaces.engines import llamacpp_args, violations, vllm_args
from search_spaces.knobs import KNOBS, MINDIE_SWAP_GB
from search_spaces.space import KnobRange, SearchSpace

SIM_ENGINES = ("mindie", "vllm", "llamacpp")  # the schedulers the simulator reproduces
DEFAULTS: dict[str, Any] = {  # MindIE's defaults for knobs a search space leaves out
    "batch_size": 200,
    "select_batch": "prefill-first",
    "max_prefill_tokens": 8192,
    "quantization": "bf16",
    "kv_compression": 1.0,
    "max_prefill_batch_size": 50,
    "prefill_time_ms_per_req": 150,
    "decode_time_ms_per_req": 50,
}


# Each engine's own default where a space leaves prefix caching out: vLLM V1 and llama-server
# turn it on, MindIE's plugin is off unless configured (search_spaces/memory-options.md).
PREFIX_CACHING_DEFAULT = {"mindie": False, "vllm": True, "llamacpp": True}

GIB = 2**30  # kv_host_gb is in GiB, as vLLM's --kv-offloading-size

BATCH_LIMIT = int((KNOBS["batch_size"].limits or (1, 5000))[1])


def _values(spec: KnobRange | None, default: Any) -> list[Any]:
    """A categorical (or fixed) knob's values in the space; the default when it is left out."""
    if spec is None:
        return [default]
    return spec.listed() or [spec.low, spec.high]


class SimRunner:
    name = "sim"

    def __init__(
        self,
        engine: str = "mindie",
        model: str | ModelProfile = "qwen2-7b",
        hardware: str | HardwareProfile = "ascend-910b2",
        chips: int = 1,
    ):
        if engine not in SIM_ENGINES:
            raise InputError(
                f"--engine: unknown engine {engine!r}; "
                f"the simulator knows: {', '.join(SIM_ENGINES)}"
            )
        self.engine = engine
        self.model = model if isinstance(model, ModelProfile) else load_model(model)
        self.hardware = (
            hardware if isinstance(hardware, HardwareProfile) else load_hardware(hardware)
        )
        self.chips = chips  # the budget a deployment spreads over (search_spaces.deployment)

    def identity(self) -> dict[str, str]:
        identity = {
            "runner": self.name,
            "engine": self.engine,
            "model": self.model.name,
            "hardware": self.hardware.name,
        }
        if self.chips > 1:  # one chip: as studies were before chip budgets
            identity["chips"] = str(self.chips)
        return identity

    def assumptions(self) -> dict[str, Any]:
        return {
            "hardware profile": self.hardware.model_dump(mode="json"),
            "model profile": dataclasses.asdict(self.model),
        }

    def check_inputs(self) -> None:
        pass  # the model and hardware profiles were read and checked when the runner was made

    def max_context(self) -> tuple[int | None, str]:
        return self.model.max_context, self.model.name

    def adapt(self, space: SearchSpace) -> SearchSpace:
        # The simulator runs every knob value; the chip budget decides the deployments.
        hardware = self.hardware
        space = self._fit_host_tier(space)
        return with_deployment(
            space,
            self.chips,
            hardware.memory_fraction.value,
            hardware.name,
            hardware.kv_link is not None,
        )

    def _fit_host_tier(self, space: SearchSpace) -> SearchSpace:
        """kv_host_gb and swap_preemptions only where the profile states a host tier (its
        memory and link), kv_host_gb within its memory."""
        hardware = self.hardware
        swaps = space.ranges.get("swap_preemptions")
        if hardware.host is None and swaps is not None:
            if "swap_preemptions" in space.user_set and max(swaps.listed() or [swaps.high]):
                raise InputError(
                    f"{space.source}: knobs.swap_preemptions: {hardware.name} states no host "
                    "tier to swap to (hardware profile: host); give one in a --hardware file "
                    "or leave the knob out"
                )
            space = space.drop("swap_preemptions", f"{hardware.name} states no host tier")
        spec = space.ranges.get("kv_host_gb")
        if spec is None:
            return space
        where = f"{space.source}: knobs.kv_host_gb"
        if hardware.host is None:
            if "kv_host_gb" in space.user_set:
                raise InputError(
                    f"{where}: {hardware.name} states no host tier (hardware profile: host); "
                    "give one in a --hardware file or leave the knob out"
                )
            return space.drop("kv_host_gb", f"{hardware.name} states no host tier")
        largest = max(spec.listed() or [spec.high])
        memory = hardware.host.memory_gb.value
        if largest * GIB > memory * 1e9:
            raise InputError(
                f"{where}: {largest:g} GiB is more than {hardware.name}'s host memory for one "
                f"chip ({memory:g} GB, hardware profile host.memory_gb)"
            )
        return space

    def batch_ceiling(self, space: SearchSpace, workload: Workload) -> tuple[int, str] | None:
        """Beyond the sequences the KV cache holds, batch slots stay empty: the ceiling is what
        the frugalest config in the space holds of the typical request (within the knob's
        limit)."""
        ranges = space.ranges
        configs = [
            DEFAULTS | space.fixed() | {"quantization": q, "kv_compression": kv}
            for q in _values(ranges.get("quantization"), DEFAULTS["quantization"])
            for kv in _values(ranges.get("kv_compression"), DEFAULTS["kv_compression"])
        ]
        # The smallest prefill budget searched leaves the most memory to the KV cache.
        step_tokens = int(
            min(_values(ranges.get("max_prefill_tokens"), DEFAULTS["max_prefill_tokens"]))
        )
        frugal = max(configs, key=lambda c: self._cost(c).kv_capacity_tokens(step_tokens))
        kv_tokens = self._cost(frugal).kv_capacity_tokens(step_tokens)
        sequences = int(kv_tokens // workload.typical_request)
        if sequences < 1:  # no config fits a typical request: violations() says so per trial
            return None
        return min(sequences, BATCH_LIMIT), (
            f"at its frugalest setting searched ({frugal['quantization']}, kv_compression "
            f"{frugal['kv_compression']:g}) the KV cache on {self.hardware.name} holds "
            f"{sequences} requests of {workload.typical_request:.0f} tokens"
        )

    def _cost(self, config: dict[str, Any], memory_share: float | None = None) -> CostModel:
        hardware = self.hardware
        if memory_share is not None:  # a disaggregated role's share of the chip's memory
            share = Figure(value=memory_share, source="assumed", note="the trial's memory share")
            hardware = hardware.model_copy(update={"memory_fraction": share})
        return CostModel(
            self.model, hardware, config["quantization"], float(config["kv_compression"])
        )

    def _scheduler(self, config: dict[str, Any]) -> Scheduler:
        decode_first = config["select_batch"] == "decode-first"
        policy: Policy
        if self.engine == "vllm":
            # vLLM V1: running requests first
            policy = "chunked" if decode_first else "whole-prefill"
            prefill_batch = config["batch_size"]
        elif self.engine == "llamacpp":
            # llama-server's slots: every generating slot's next token first, then prompt tokens of
            # the slots still reading theirs fill the rest of the batch (-b).
            policy, prefill_batch = "chunked", config["batch_size"]
        else:
            policy = "select-batch" if decode_first else "prefill-first"
            prefill_batch = config["max_prefill_batch_size"]
        return Scheduler(
            policy=policy,
            max_batch=config["batch_size"],
            max_prefill_tokens=config["max_prefill_tokens"],
            max_prefill_batch=prefill_batch,
            prefill_ms_per_req=config["prefill_time_ms_per_req"],
            decode_ms_per_req=config["decode_time_ms_per_req"],
        )

    def violations(self, config: dict[str, Any], workload: Workload) -> list[str]:
        config = DEFAULTS | config
        if not is_disaggregated(config):
            # What the real engine refuses, the simulator too.
            return violations(self.engine, config, workload) or self._memory_violations(
                config, workload.longest_request
            )
        if workload.arrival.kind == "closed":
            return [
                "the simulator runs a disaggregated deployment under open-loop arrivals only "
                "(a closed loop's client couples the prefill and decode instances)"
            ]
        reasons = co_located_only(config)
        for role, longest in (("prefill", workload.longest_prompt + 1), ("decode", None)):
            single = role_config(config, role)
            # Each role's servers are the engine's own: what it refuses of them, the simulator too.
            role_reasons = violations(self.engine, single, workload) or self._memory_violations(
                single, longest or workload.longest_request, memory_share(config, role)
            )
            reasons += [f"{role} instances: {reason}" for reason in role_reasons]
        return reasons

    def _memory_violations(
        self, config: dict[str, Any], longest: int, share: float | None = None
    ) -> list[str]:
        cost = self._cost(config, share)
        capacity = cost.kv_capacity_tokens(config["max_prefill_tokens"])
        if capacity <= 0:
            return [
                f"{config['quantization']} weights ({cost.weight_bytes / 1e9:.1f} GB) "
                f"and activations for {config['max_prefill_tokens']} tokens "
                f"leave no memory for a KV cache on {self.hardware.name}"
            ]
        block = self.hardware.kv_block_tokens
        blocks = capacity // block
        if blocks * block < longest:
            return [f"KV cache holds {blocks * block} tokens; the longest request needs {longest}"]
        return []

    def engine_args(self, config: dict[str, Any], workload: Workload) -> list[str] | None:
        """What the simulated engine would be started with, at its default settings."""
        renderers: dict[str, Callable[[dict[str, Any], Workload], list[str]]] = {
            "vllm": vllm_args,
            "llamacpp": llamacpp_args,
        }
        render = renderers.get(self.engine)
        if render is None or is_disaggregated(config):  # no one server runs the whole config
            return None
        return render(config, workload)

    @contextmanager
    def session(self, config: dict[str, Any], workload: Workload) -> Iterator[Session]:
        config = self._defaults() | config
        reasons = self.violations(config, workload)
        session: Session
        if reasons:
            session = FailedSession(Fault("infeasible", "; ".join(reasons)))
        elif is_disaggregated(config):
            session = DisaggregatedSession(self._fleet(config))
        else:
            session = _SimSession(self, config)
        yield session

    def _defaults(self) -> dict[str, Any]:
        """What this engine runs for the knobs a search space leaves out."""
        return DEFAULTS | {"prefix_caching": PREFIX_CACHING_DEFAULT[self.engine]}

    def _fleet(self, config: dict[str, Any]) -> Fleet:
        """A disaggregated config's roles as the simulator runs them."""
        counts = roles(config)
        link = self.hardware.kv_link
        assert link is not None, "search_spaces.deployment refuses a profile with no kv_link"
        parts = {}
        for role in ("prefill", "decode"):
            single = role_config(config, role)
            cost = self._cost(single, memory_share(config, role))
            blocks = cost.kv_capacity_tokens(single["max_prefill_tokens"])
            parts[role] = (cost, self._scheduler(single), blocks // self.hardware.kv_block_tokens)
        return Fleet(
            counts,
            *parts["prefill"],
            *parts["decode"],
            self.hardware.kv_block_tokens,
            link.intra_node if counts.chips <= link.chips_per_node else link.inter_node,
            FIRST_TOKEN_FROM[self.engine],
            bool((self._defaults() | config)["prefix_caching"]),
        )

    def run(
        self,
        config: dict[str, Any],
        workload: Workload,
        sla: SLA | None = None,
        stop_early: bool = False,
    ) -> Measurement:
        return run_once(self, config, workload, sla, stop_early)


class _SimSession:
    def __init__(self, runner: SimRunner, config: dict[str, Any]):
        self.cost = runner._cost(config)
        self.scheduler = runner._scheduler(config)
        self.block = runner.hardware.kv_block_tokens
        self.blocks = self.cost.kv_capacity_tokens(config["max_prefill_tokens"]) // self.block
        self.replicas = runner.chips  # co-located: one replica per chip
        self.prefix_caching = bool(config["prefix_caching"])
        self.host_tier = _host_tier(runner, self.cost, float(config.get("kv_host_gb") or 0))
        self.swap = _swap_space(runner, self.cost, int(config.get("swap_preemptions") or 0))
        self.extra: dict[str, Any] = {}

    def simulation(
        self, workload: Workload, sla: SLA | None = None, stop_early: bool = False
    ) -> Simulation:
        """One replica's engine, ready to serve its share of the workload."""
        bound = sla.ttft_p99_ms / 1000 if sla is not None and stop_early else None
        requests = replica_requests(workload, self.replicas)
        cache = None
        chained = requests.prefix_sizes is not None
        if self.prefix_caching and (
            requests.prefix_tokens or requests.sessions is not None or chained
        ):
            cache = PrefixCache(requests.prefix_tokens, self.block, self.host_tier)
            if requests.prefix_sizes is not None and requests.prefix_ancestor is not None:
                cache.chain(requests.prefix_sizes.tolist(), requests.prefix_ancestor.tolist())
        return Simulation(
            self.cost, self.scheduler, requests, self.blocks, self.block, bound, cache, self.swap
        )

    def measure(
        self, workload: Workload, sla: SLA | None = None, stop_early: bool = False
    ) -> Measurement:
        sim = self.simulation(workload, sla, stop_early)
        try:
            return sim.run()
        except RuntimeError as error:  # a simulator fault is the trial's, never the study's
            return Measurement.failed(Fault("error", f"simulator: {error}"))


def _host_tier(runner: SimRunner, cost: CostModel, gigabytes: float) -> HostTier | None:
    """The config's host tier in blocks of this KV cache, and the link's time per block."""
    host = runner.hardware.host
    if not gigabytes or host is None:
        return None
    block_bytes = runner.hardware.kv_block_tokens * cost.kv_bytes_per_token
    return HostTier(
        blocks=int(gigabytes * GIB // block_bytes),
        block_seconds=block_bytes / (host.link.bandwidth_gbs.value * 1e9),
        latency_s=host.link.latency_ms.value / 1000,
        block_bytes=block_bytes,
    )


def _swap_space(runner: SimRunner, cost: CostModel, per_step: int) -> SwapSpace | None:
    """MindIE's swap pool (cpuMemSize, search_spaces.knobs.MINDIE_SWAP_GB) over the host link,
    where the config swaps."""
    host = runner.hardware.host
    if not per_step or host is None or runner.engine != "mindie":
        return None
    block_bytes = runner.hardware.kv_block_tokens * cost.kv_bytes_per_token
    return SwapSpace(
        blocks=int(MINDIE_SWAP_GB * 1e9 // block_bytes),
        block_seconds=block_bytes / (host.link.bandwidth_gbs.value * 1e9),
        latency_s=host.link.latency_ms.value / 1000,
        block_bytes=block_bytes,
        per_step=per_step,
    )
