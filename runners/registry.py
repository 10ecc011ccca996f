"""The registry of runners: each name's factory, taking the command line's runner options."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from objectives.userfile import InputError
from runners.base import Runner


def _make_sim(
    engine: str,
    model: str | None,
    hardware: str | None,
    engine_cmd: str | None,
    runner_config: Path | None,
) -> Runner:
    from runners.sim.runner import SimRunner

    for flag, value in (("--engine-cmd", engine_cmd), ("--runner-config", runner_config)):
        if value is not None:
            raise InputError(
                f"{flag}: the sim runner starts no engine; "
                "use --runner vllm, llamacpp, mindie or openai"
            )
    return SimRunner(engine=engine, model=model or "qwen2-7b", hardware=hardware or "ascend-910b2")


def _served(module: str, cls: str) -> Callable[..., Runner]:
    def make(
        engine: str,
        model: str | None,
        hardware: str | None,
        engine_cmd: str | None,
        runner_config: Path | None,
    ) -> Runner:
        from importlib import import_module

        from runners.served import load_settings

        runner_cls = getattr(import_module(module), cls)
        settings = load_settings(
            runner_cls.settings_model,
            runner_config,
            model=Path(model) if model else None,
            engine_cmd=[engine_cmd] if engine_cmd else None,
        )
        runner: Runner = runner_cls(settings, hardware)
        return runner

    return make


RUNNERS: dict[str, Callable[..., Runner]] = {
    "sim": _make_sim,
    "vllm": _served("runners.vllm", "VLLMRunner"),
    "llamacpp": _served("runners.llamacpp", "LlamaCppRunner"),
    "mindie": _served("runners.mindie", "MindIERunner"),
    "openai": _served("runners.openai", "OpenAIRunner"),
}
