"""The runner interface: run(config, workload) -> Measurement, and the registry of runners."""

from __future__ import annotations

from typing import Any, Callable, Protocol

from objectives.scenario import Workload
from runners.measurement import Measurement


class Runner(Protocol):
    name: str
    engine: str  # whose knobs it takes: "mindie" or "vllm"

    def identity(self) -> dict[str, str]:
        """runner, engine, model and hardware names: they name studies and exports."""

    def violations(self, config: dict[str, Any], workload: Workload) -> list[str]:
        """Reasons the config cannot run at all here (e.g. memory), known before running."""

    def run(self, config: dict[str, Any], workload: Workload) -> Measurement:
        """Serve the workload with the config. Failures come back as Measurement.fault."""


def _make_sim(**options: Any) -> Runner:
    from runners.sim.runner import SimRunner

    return SimRunner(**options)


RUNNERS: dict[str, Callable[..., Runner]] = {"sim": _make_sim}
