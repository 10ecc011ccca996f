"""The runner interface: run(config, workload) -> Measurement, and the registry of runners."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol

from objectives.scenario import SLA, Workload
from runners.measurement import Measurement
from search_spaces.space import SearchSpace
from tuner.userfile import InputError


class Runner(Protocol):
    name: str
    engine: str  # whose knobs it takes: one of search_spaces.knobs.ENGINES

    def identity(self) -> dict[str, str]:
        """runner, engine, model and hardware names: they name studies and exports."""

    def adapt(self, space: SearchSpace) -> SearchSpace:
        """The space narrowed to what can run here (e.g. precisions that have weights), with notes."""

    def violations(self, config: dict[str, Any], workload: Workload) -> list[str]:
        """Reasons the config cannot run at all here (e.g. memory), known before running."""

    def run(self, config: dict[str, Any], workload: Workload, sla: SLA | None = None) -> Measurement:
        """Serve the workload with the config. Failures come back as Measurement.fault.

        With an SLA a runner may stop early once the SLA is certainly broken (fault "sla-violated")."""


def _make_sim(engine: str, model: str | None, hardware: str | None, engine_cmd: str | None,
              runner_config: Path | None) -> Runner:
    from runners.sim.runner import SimRunner

    for flag, value in (("--engine-cmd", engine_cmd), ("--runner-config", runner_config)):
        if value is not None:
            raise InputError(f"{flag}: the sim runner starts no engine; use --runner vllm, llamacpp, mindie or openai")
    return SimRunner(engine=engine, model=model or "qwen2-7b", hardware=hardware or "ascend-910b2")


def _served(module: str, cls: str) -> Callable[..., Runner]:
    def make(engine: str, model: str | None, hardware: str | None, engine_cmd: str | None,
             runner_config: Path | None) -> Runner:
        from importlib import import_module

        from runners.served import load_settings

        runner_cls = getattr(import_module(module), cls)
        settings = load_settings(runner_cls.settings_model, runner_config,
                                 model=Path(model) if model else None,
                                 engine_cmd=[engine_cmd] if engine_cmd else None)
        return runner_cls(settings, hardware)

    return make


RUNNERS: dict[str, Callable[..., Runner]] = {
    "sim": _make_sim,
    "vllm": _served("runners.vllm", "VLLMRunner"),
    "llamacpp": _served("runners.llamacpp", "LlamaCppRunner"),
    "mindie": _served("runners.mindie", "MindIERunner"),
    "openai": _served("runners.openai", "OpenAIRunner"),
}
