"""The registry of runners: each name's factory, taking the command line's runner options."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from objectives.userfile import InputError
from runners.base import Runner

# The runners that take a chip budget (--chips) and search its deployments
# (search_spaces.deployment): co-located replicas, or prefill and decode instances.
CHIP_BUDGET_RUNNERS = ("sim", "vllm")


def _make_sim(
    engine: str,
    model: str | None,
    hardware: str | None,
    engine_cmd: str | None,
    runner_config: Path | None,
    chips: int = 1,
) -> Runner:
    from runners.sim.runner import SimRunner

    for flag, value in (("--engine-cmd", engine_cmd), ("--runner-config", runner_config)):
        if value is not None:
            raise InputError(
                f"{flag}: the sim runner starts no engine; "
                "use --runner vllm, llamacpp, mindie or openai"
            )
    return SimRunner(
        engine=engine, model=model or "qwen2-7b", hardware=hardware or "ascend-910b2", chips=chips
    )


def _served(module: str, cls: str, deploys: bool = False) -> Callable[..., Runner]:
    """`deploys`: the runner runs a deployment on a chip budget (--chips, prefill/decode
    disaggregation included); the others measure one instance."""

    def make(
        engine: str,
        model: str | None,
        hardware: str | None,
        engine_cmd: str | None,
        runner_config: Path | None,
        chips: int = 1,
    ) -> Runner:
        from importlib import import_module

        if chips != 1 and not deploys:
            raise InputError(
                f"--chips: {chips}: a real-engine runner measures one instance (--chips 1); "
                "deployments on a chip budget, disaggregated ones included, run on "
                f"--runner {' or '.join(CHIP_BUDGET_RUNNERS)}"
            )
        from runners.engines.served import load_settings

        runner_cls = getattr(import_module(module), cls)
        settings = load_settings(
            runner_cls.settings_model,
            runner_config,
            model=Path(model) if model else None,
            engine_cmd=[engine_cmd] if engine_cmd else None,
        )
        runner: Runner = (
            runner_cls(settings, hardware, chips) if deploys else runner_cls(settings, hardware)
        )
        return runner

    return make


RUNNERS: dict[str, Callable[..., Runner]] = {
    "sim": _make_sim,
    "vllm": _served("runners.engines.vllm", "VLLMRunner", deploys=True),
    "llamacpp": _served("runners.engines.llamacpp", "LlamaCppRunner"),
    "mindie": _served("runners.engines.mindie", "MindIERunner"),
    "openai": _served("runners.engines.openai", "OpenAIRunner"),
}
