"""The runner interface: run(config, workload) -> Measurement (the registry: runners.registry)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

from objectives.scenario import SLA, Workload
from runners.load.measurement import Fault, Measurement
from search_spaces.space import SearchSpace


class Session(Protocol):
    """One config being served: a real engine started once, measured under several loads."""

    extra: dict[str, Any]  # facts of the engine's life (start and stop times, log, pid)

    def measure(
        self, workload: Workload, sla: SLA | None = None, stop_early: bool = False
    ) -> Measurement:
        """Serve one load, whole; with stop_early and an SLA, stop as soon as the SLA is certainly
        missed (fault "sla-violated"). The same meaning on every runner."""


class Runner(Protocol):
    name: str
    engine: str  # whose knobs it takes: one of search_spaces.knobs.ENGINES

    def identity(self) -> dict[str, str]:
        """runner, engine, model and hardware names: they name studies and exports."""

    def assumptions(self) -> dict[str, Any]:
        """The figures and settings its measurements stand on beyond those names (the
        simulator's profiles, an engine's settings): a study refuses trials measured on other
        ones (tuner.assumptions)."""

    def check_inputs(self) -> None:
        """Check what every trial will read (model config, tokenizer) before a study is written."""

    def max_context(self) -> tuple[int | None, str]:
        """The model's context in tokens (None when unknown) and the model's name."""

    def batch_ceiling(self, space: SearchSpace, workload: Workload) -> tuple[int, str] | None:
        """The most sequences worth running at once here, and why (what memory holds for the
        workload's typical request); None when it is unknown before an engine starts."""

    def adapt(self, space: SearchSpace) -> SearchSpace:
        """The space narrowed to what can run here (e.g. precisions that have weights), with
        notes."""

    def violations(self, config: dict[str, Any], workload: Workload) -> list[str]:
        """Reasons the config cannot run at all here (e.g. memory), known before running."""

    def engine_args(self, config: dict[str, Any], workload: Workload) -> list[str] | None:
        """The engine's arguments for the config (search_spaces.engines), less host, port and
        local paths: what a trial records and its export holds. None: not an argument list."""

    def session(
        self, config: dict[str, Any], workload: Workload
    ) -> AbstractContextManager[Session]:
        """Start serving the config (the workload's lengths size the engine); stop on exit.
        A config that cannot start gives a session whose every measurement carries the fault."""

    def run(
        self,
        config: dict[str, Any],
        workload: Workload,
        sla: SLA | None = None,
        stop_early: bool = False,
    ) -> Measurement:
        """Serve the workload with the config once (see run_once). Failures come back as
        Measurement.fault."""


def run_once(
    runner: Runner,
    config: dict[str, Any],
    workload: Workload,
    sla: SLA | None = None,
    stop_early: bool = False,
) -> Measurement:
    with runner.session(config, workload) as session:
        measurement = session.measure(workload, sla, stop_early)
    measurement.extra = session.extra | measurement.extra
    return measurement


class FailedSession:
    """A config that never started: every measurement is the same fault."""

    def __init__(self, fault: Fault, extra: dict[str, Any] | None = None):
        self.fault, self.extra = fault, extra or {}

    def measure(
        self, workload: Workload, sla: SLA | None = None, stop_early: bool = False
    ) -> Measurement:
        return Measurement.failed(self.fault)
