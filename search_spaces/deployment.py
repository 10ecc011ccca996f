"""Prefill/decode disaggregation: the deployment knobs on a chip budget, and each role's config.

On `--chips N`, one engine instance per chip:
- co-located: N replicas, each running prefill and decode (one instance, N times), behind a
  router that sends requests to them in turn;
- disaggregated: `prefill_instances` chips run prefill only and hand each request's KV cache to
  `decode_instances` chips (by default the rest of the budget) that run decode only; the router
  sends each request in turn to a prefill and to a decode instance (round-robin on both, as
  the proxy of vLLM's disaggregated-serving tests, toy_proxy_server.py, does).
Each role's servers run with:
- prefill: a step budget of max_prefill_tokens, at most prefill_batch_size requests at once,
  prefill_memory_share of the chip's memory;
- decode: batch_size sequences, decode_memory_share of the chip's memory.
Every figure is per chip, so deployments of different sizes compare.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from objectives.userfile import InputError
from search_spaces.knobs import KNOBS
from search_spaces.space import ROLE_KNOBS, KnobRange, SearchSpace, nearest_value

DEPLOYMENT_KNOBS = ("deployment", *ROLE_KNOBS)
PREFILL_BATCH = KnobRange(low=1, high=256, log=True)  # as the preset's batch_size


@dataclass(frozen=True)
class Roles:
    prefill: int
    decode: int

    @property
    def chips(self) -> int:
        return self.prefill + self.decode


def is_disaggregated(config: dict[str, Any]) -> bool:
    return config.get("deployment") == "disaggregated"


def roles(config: dict[str, Any]) -> Roles:
    """A disaggregated config's instance counts (SearchSpace.suggest fills decode_instances)."""
    return Roles(int(config["prefill_instances"]), int(config["decode_instances"]))


def role_config(config: dict[str, Any], role: str) -> dict[str, Any]:
    """The single-instance knobs one role's servers run with."""
    base = {k: v for k, v in config.items() if k not in DEPLOYMENT_KNOBS}
    # A role's KV connector is the hand-over between roles: a host tier would replace it
    # (vLLM's --kv-offloading-size sets its own connector), so roles run without one.
    base.pop("kv_host_gb", None)
    base.pop("swap_preemptions", None)
    if role == "prefill":
        batch = int(config["prefill_batch_size"])
        # A prefill-only server has nothing to decode: it takes prompts as they come.
        return base | {
            "batch_size": batch,
            "max_prefill_batch_size": batch,
            "select_batch": "prefill-first",
        }
    return base


def as_deployment(space: SearchSpace, params: dict[str, Any], deployment: str) -> dict[str, Any]:
    """`params` run under the other `deployment` with nothing else changed, for a controlled
    comparison: a prefill instance batches the prompts a replica's prefill step does (its
    prefill_batch_size is the replica's prefill batch as it runs, max_prefill_batch_size
    clamped to the batch, or the batch itself on an engine without that knob, as vLLM; and
    back), and a co-located config, whose split means nothing, is split in half, where a
    climb of the split starts. Knobs the space holds fixed stay as they are.

    Left to the sampler, those knobs took whatever it drew: customer-service on 8 chips
    measured its best co-located config disaggregated at a prefill batch of 1 (1,950 tok/s per
    chip), where the same config with the replica's prefill batch of 31 reaches 5,307 on 4P4D,
    the best disaggregated config any run found (bench/README)."""
    searched = space.distributions()
    out = params | {"deployment": deployment}
    if is_disaggregated(params) == (deployment == "disaggregated"):
        return out
    ran = space.config_of(params)  # with the fixed knobs, and the prefill batch as it ran
    if deployment != "disaggregated":
        wanted = ran.get("prefill_batch_size")
        if "max_prefill_batch_size" in searched and wanted is not None:
            out["max_prefill_batch_size"] = nearest_value(
                searched["max_prefill_batch_size"], wanted
            )
        return out
    replica_batch = ran.get("max_prefill_batch_size", ran.get("batch_size"))
    if "prefill_batch_size" in searched and replica_batch is not None:
        out["prefill_batch_size"] = nearest_value(searched["prefill_batch_size"], replica_batch)
    if "prefill_instances" in searched:
        out["prefill_instances"] = nearest_value(searched["prefill_instances"], space.chips // 2)
    if "decode_instances" in searched:
        prefill = out.get("prefill_instances", space.fixed().get("prefill_instances"))
        rest = space.chips - int(prefill if prefill is not None else space.chips // 2)
        out["decode_instances"] = nearest_value(searched["decode_instances"], rest)
    return out


def co_located_only(config: dict[str, Any]) -> list[str]:
    """Why a disaggregated config sets a knob its roles run without (role_config)."""
    reasons = []
    if config.get("kv_host_gb"):
        reasons.append(
            "kv_host_gb applies to co-located replicas: a role's KV connector is the hand-over"
        )
    if config.get("swap_preemptions"):
        reasons.append("swap_preemptions applies to co-located replicas (the simulator's)")
    return reasons


def deployment_label(config: dict[str, Any]) -> str | None:
    """The deployment in a word: "co-located", or "xPyD" (x prefill, y decode instances); None
    for a config of one chip."""
    if "deployment" not in config:
        return None
    if not is_disaggregated(config):
        return "co-located"
    counts = roles(config)
    return f"{counts.prefill}P{counts.decode}D"


def memory_share(config: dict[str, Any], role: str) -> float:
    return float(config[f"{role}_memory_share"])


def _lowest(spec: KnobRange | None) -> float | None:
    if spec is None:
        return None
    listed = spec.listed()
    return spec.low if listed is None else float(min(listed))


def with_deployment(
    space: SearchSpace, chips: int, memory_share_default: float, hardware: str, has_link: bool
) -> SearchSpace:
    """The deployment knobs for a budget of `chips`: with one chip only co-located (today's one
    instance); with more, co-located or disaggregated with the role knobs the user's --space
    did not set searched (instance counts, prefill batch) or at the hardware's default (memory
    shares). `has_link`: the `hardware` profile states the link a KV cache moves over."""
    where = space.source
    spec = space.ranges.get("deployment")
    deployments = None if spec is None else spec.listed()
    if space.engine not in KNOBS["deployment"].render:  # no KV transfer between its servers
        deployments = ["co-located"]
    if chips < 2 and deployments == ["disaggregated"]:
        raise InputError(
            f"{where}: knobs.deployment: disaggregated needs --chips 2 or more "
            f"(a prefill and a decode instance); --chips is {chips}"
        )
    if chips < 2 or deployments == ["co-located"]:
        why = "--chips 1 runs one co-located instance" if chips < 2 else "deployment co-located"
        if chips > 1 and "deployment" not in space.ranges:
            space = space.with_range(
                "deployment",
                KnobRange(value="co-located"),
                f"deployment co-located: {space.engine} has no prefill/decode disaggregation",
            )
        for name in DEPLOYMENT_KNOBS if chips < 2 else ROLE_KNOBS:
            space = space.drop(name, why)
        return space.with_chips(chips)
    ranges = dict(space.ranges)
    defaults = {
        "deployment": KnobRange(choices=["co-located", "disaggregated"]),
        "prefill_instances": KnobRange(low=1, high=chips - 1),
        "prefill_batch_size": PREFILL_BATCH,
        "prefill_memory_share": KnobRange(value=memory_share_default),
        "decode_memory_share": KnobRange(value=memory_share_default),
    }
    for name, spec in defaults.items():
        ranges.setdefault(name, spec)
    space = space.with_chips(chips, ranges)
    _check_role_counts(ranges, chips, where)
    # The most prefill chips: what the fewest decode instances searched leave of the budget.
    decode_low = _lowest(ranges.get("decode_instances")) or 1
    most = int(chips - decode_low)
    why = f"--chips {chips} keeps {decode_low:g} for decode instances"
    prefill = ranges["prefill_instances"]
    if prefill.high is not None and prefill.high > most:
        space = space.with_range(
            "prefill_instances",
            prefill.model_copy(update={"high": most}),
            f"prefill_instances ceiling lowered from {prefill.high:g} to {most}: {why}",
        )
    space.hard_ends["prefill_instances.high"] = (most, why)
    if not has_link:
        raise InputError(
            f"--hardware: {hardware} states no kv_link figures "
            "(bandwidth and latency of the link a KV cache moves over), which a disaggregated "
            "deployment needs: add kv_link to the profile, or fix deployment: co-located in a "
            "--space file"
        )
    return space


def _check_role_counts(ranges: dict[str, KnobRange], chips: int, where: str) -> None:
    prefill = _lowest(ranges.get("prefill_instances"))
    decode = _lowest(ranges.get("decode_instances"))
    if prefill is not None and prefill > chips - 1:
        raise InputError(
            f"{where}: knobs.prefill_instances: {prefill:g} leaves no chip for a decode instance "
            f"within --chips {chips}; allowed: 1..{chips - 1}"
        )
    if decode is not None and decode > chips - 1:
        raise InputError(
            f"{where}: knobs.decode_instances: {decode:g} leaves no chip for a prefill instance "
            f"within --chips {chips}; allowed: 1..{chips - 1}"
        )
    if prefill is not None and decode is not None and prefill + decode > chips:
        raise InputError(
            f"{where}: knobs.prefill_instances + decode_instances: at least "
            f"{prefill:g} + {decode:g} = {prefill + decode:g} chips, above --chips {chips}"
        )
