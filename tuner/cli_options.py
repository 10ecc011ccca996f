"""The options the commands share: the tuning options (`autotune`, `worker`, `nightly`) and
--storage (the commands that read a study)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from runners.registry import RUNNERS
from tuner import flags
from tuner.budget import STUDY_TRIALS
from tuner.samplers import SAMPLERS
from tuner.screen import SCREENS
from tuner.storage import DEFAULT_STORAGE, HEARTBEAT_S

F = TypeVar("F", bound=Callable[..., Any])  # a command's function, as click's decorators take it

TUNE_OPTIONS = {
    "scenario": click.option(
        "--scenario", help="preset name (see `autotune scenarios`) or path of a scenario YAML"
    ),
    "runner": click.option(
        "--runner",
        "runner_name",
        default="sim",
        show_default=True,
        help=f"one of: {', '.join(RUNNERS)}",
    ),
    "engine": click.option(
        "--engine",
        default="mindie",
        show_default=True,
        help="sim only: whose scheduler and knobs to simulate: mindie, vllm or llamacpp",
    ),
    "model": click.option(
        "--model", help="sim: built-in model (default qwen2-7b); engines: a HF model directory"
    ),
    "hardware": click.option(
        "--hardware",
        help="sim: hardware profile or YAML (default ascend-910b2); "
        "engines: a label (default: host name)",
    ),
    "chips": click.option(
        "--chips",
        type=click.IntRange(1, 4096),
        default=1,
        show_default=True,
        help="sim and vllm: the chip budget, one instance per chip; from 2 the study also "
        "searches prefill/decode disaggregation, and throughputs are per chip",
    ),
    "engine_cmd": click.option(
        "--engine-cmd",
        help="the engine's executable (vllm, llama-server, ...) or the Python of vLLM's venv",
    ),
    "runner_config": click.option(
        "--runner-config",
        type=click.Path(path_type=Path),
        help="YAML of runner settings (engine command, weights, env, ports, timeouts)",
    ),
    "space": click.option(
        "--space",
        "space_path",
        type=click.Path(path_type=Path),
        help="YAML narrowing the knob ranges",
    ),
    "trials": click.option(
        "--trials",
        type=flags.COUNT,
        default=None,
        help="every trial the run measures: the study's, the arms' and polish's, the pick's "
        "repeats (default: 150 on the simulator, 70 on real engines; the console says the split)",
    ),
    "polish": click.option(
        "--polish",
        "polish_trials",
        type=flags.POLISH,
        default=None,
        help="of --trials, those searching each arm and the pick's one-knob neighbours after the "
        "study (default: two thirds of --trials on the simulator, about a fifth on real engines "
        "once the repeats' share is set aside; 0: none)",
    ),
    "repeats": click.option(
        "--repeats",
        "repeats",
        type=flags.POLISH,
        default=None,
        help="measure the pick and its close rivals N times in all with fresh arrivals and pick "
        "on each one's worst (default: 3 on real engines; 0 on the simulator, which is "
        "deterministic; 0 or 1: none)",
    ),
    "hold": click.option(
        "--hold",
        "hold_factor",
        type=flags.POLISH,
        default=None,
        help="before the export, hold the pick at its capacity for N times the scenario's "
        "requests (on 12 arrival draws on the simulator), lowering a claim that misses and "
        "then holding the configs it passed over (default: 64 on the simulator, 4 on real "
        "engines; 0: no hold)",
    ),
    "chip_cost_per_hour": click.option(
        "--chip-cost-per-hour",
        type=flags.PRICE,
        default=None,
        help="a chip's price per hour (any currency): the front, export and report show the "
        "cost per million output tokens at capacity and, with peak_rate, the fleet's per hour",
    ),
    "timeout": click.option(
        "--timeout", "timeout_s", type=flags.SECONDS, help="stop starting trials after S seconds"
    ),
    "seed": click.option("--seed", type=flags.SEED, default=0, show_default=True),
    "sampler": click.option(
        "--sampler",
        default="auto",
        show_default=True,
        help=f"one of: {', '.join(SAMPLERS)} (auto: gp for real engines where PyTorch and "
        "SciPy are installed, tpe otherwise and on the simulator)",
    ),
    "storage": click.option(
        "--storage",
        default=DEFAULT_STORAGE,
        show_default=True,
        help="SQLAlchemy URL of the study storage",
    ),
    "study": click.option(
        "--study", "study_name", help="study name (default: scenario.runner.engine.model.hardware)"
    ),
    "export": click.option(
        "--export",
        "export_path",
        type=flags.OUTPUT_FILE,
        default=Path("best-config.yaml"),
        show_default=True,
    ),
    "baseline": click.option(
        "--baseline",
        "baseline_path",
        type=click.Path(path_type=Path),
        help="an exported YAML to re-run as the first trial",
    ),
    "html": click.option(
        "--html",
        "html_path",
        type=flags.OUTPUT_FILE,
        help="HTML report and its Pareto PNG (default: beside --export, NAME.report.html)",
    ),
    "no_html": click.option("--no-html", is_flag=True, help="write no HTML report"),
    "screen": click.option(
        "--screen",
        type=click.Choice(SCREENS),
        help="real runners: let the simulator screen candidates; "
        "only the most promising run for real",
    ),
    "screen_hardware": click.option(
        "--screen-hardware",
        help="with --screen: the hardware profile to simulate with "
        "(recalibrated as real trials arrive)",
    ),
    "screen_trials": click.option(
        "--screen-trials",
        type=flags.COUNT,
        default=40,
        show_default=True,
        help="with --screen: simulated candidates per real trial",
    ),
    "quality": click.option(
        "--quality",
        "quality_path",
        type=click.Path(path_type=Path),
        help="YAML quality table: accuracy drop (and KL, top-1) per precision and KV setting, "
        "each with its source (default: the shipped table of the model, if any)",
    ),
    "quality_prompts": click.option(
        "--quality-prompts",
        "quality_prompts_path",
        type=click.Path(path_type=Path),
        help="real runners: the text the quality measurement feeds (default: the shipped set)",
    ),
    "heartbeat": click.option(
        "--heartbeat",
        "heartbeat_s",
        type=flags.HEARTBEAT_SECONDS,
        default=HEARTBEAT_S,
        show_default=True,
        help="seconds between a running trial's heartbeats; 3 missed ones fail it as stale",
    ),
}


def tune_options(f: F, leave_out: tuple[str, ...] = ()) -> F:
    for name, option in reversed(TUNE_OPTIONS.items()):
        if name not in leave_out:
            f = option(f)
    return f


def nightly_options(f: F) -> F:
    """The tuning options less --trials and --baseline: a night has a --budget and an incumbent."""
    return tune_options(f, leave_out=("trials", "baseline", "polish", "hold", "repeats"))


def worker_options(f: F) -> F:
    """The tuning options less --polish, --repeats and --hold (tuner.cli.worker says why), and
    --trials the study's total over its workers."""
    f = tune_options(f, leave_out=("trials", "polish", "hold", "repeats"))
    return click.option(
        "--trials",
        type=flags.COUNT,
        default=STUDY_TRIALS,
        show_default=True,
        help="the study's trials, all its workers together",
    )(f)


def storage_option(f: F) -> F:
    return click.option("--storage", default=DEFAULT_STORAGE, show_default=True)(f)
