"""Every input and output of a run checked before anything is written, then the study opened."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from optuna.distributions import IntDistribution
from pydantic import ValidationError

from objectives.scenario import Scenario, load_scenario, preset_names
from objectives.userfile import InputError, describe_validation_error
from runners.base import Runner
from runners.registry import CHIP_BUDGET_RUNNERS, RUNNERS
from search_spaces.deployment import with_deployment
from search_spaces.space import KnobRange, SearchSpace, parse_config
from tuner.cost import CHIP_COST_ATTR
from tuner.export import load_export
from tuner.outputs import check_distinct, check_writable
from tuner.quality import EXCLUDED, QualityBook
from tuner.quality_plan import plan_quality, table_answered
from tuner.samplers import describe, make_sampler, tpe
from tuner.screen import Screen, plan_screen
from tuner.storage import open_storage, sqlite_file, study_name_missing
from tuner.study import create_study, default_study_name


def _make_runner(name: str, **options):
    if name not in RUNNERS:
        raise InputError(f"--runner: unknown runner {name!r}; allowed: {', '.join(RUNNERS)}")
    return RUNNERS[name](**options)


@dataclass
class Prepared:
    scenario: Scenario
    runner: Runner
    space: SearchSpace
    study: optuna.Study
    storage: optuna.storages.RDBStorage
    screen: Screen | None = None
    sampler: str = ""  # which sampler runs, for the console (describe)
    quality: QualityBook | None = None  # each trial's quality figure
    notes: tuple[str, ...] = ()  # for the console, beside the space's
    new_sampler: Callable[[int], optuna.samplers.BaseSampler] = tpe  # StudyRun's
    # Wall seconds of each phase of the run (study, arms, polish, hold, outputs), in order:
    # the console's last line.
    phases: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.monotonic() - started

    def where_the_time_went(self) -> str:
        shown = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items())
        return f"time: {shown} ({sum(self.phases.values()):.1f} s in all)"


def user_file(value: str | Path | None) -> Path | None:
    """A flag's value when it names a file (not a preset): outputs must never overwrite it."""
    return Path(value) if value is not None and os.path.lexists(value) else None


def _inputs(
    scenario,
    hardware,
    runner_config,
    space_path,
    storage,
    baseline_path=None,
    screen_hardware=None,
    quality_path=None,
    quality_prompts_path=None,
) -> dict[str, Path | None]:
    return {
        "--scenario": user_file(scenario),
        "--hardware": user_file(hardware),
        "--runner-config": user_file(runner_config),
        "--space": user_file(space_path),
        "--baseline": user_file(baseline_path),
        "--screen-hardware": user_file(screen_hardware),
        "--quality": user_file(quality_path),
        "--quality-prompts": user_file(quality_prompts_path),
        "--storage": sqlite_file(storage),
    }


def check_outputs(outputs: dict[str, Path], inputs: dict[str, Path | None]) -> None:
    for flag, path in outputs.items():
        check_writable(path, flag)
    check_distinct(outputs, inputs)


def check_context(scenario: Scenario, source: str, runner: Runner) -> Scenario:
    """A request longer than the model's context would fail in every trial: refuse it up front.
    A trace's window applies its `over_context` policy to the model's context instead (refused
    there with the count and the longest, or clipped or dropped and counted)."""
    limit, model = runner.max_context()
    trace = scenario.workload.trace
    if trace is not None and limit is not None:
        data = scenario.model_dump(exclude_none=True)
        data["workload"]["trace"] |= {"context_tokens": limit}
        for derived in ("arrival", "num_requests", "input_tokens", "output_tokens"):
            data["workload"].pop(derived)
        try:
            return Scenario.model_validate(data)
        except ValidationError as error:
            message = describe_validation_error(source, error)
            raise InputError(f"{message} ({model})") from None
    need = scenario.workload.longest_request
    if limit is not None and need > limit:
        i, o = scenario.workload.input_tokens.bounds[1], scenario.workload.output_tokens.bounds[1]
        raise InputError(
            f"{source}: workload: the longest request ({i} input + {o} output = {need} tokens) "
            f"exceeds the context of {model} ({limit} tokens, max_position_embeddings)"
        )
    return scenario


def prepare(
    scenario,
    runner_name,
    engine,
    model,
    hardware,
    engine_cmd,
    runner_config,
    space_path,
    trials,
    seed,
    sampler,
    storage,
    study_name,
    baseline_path,
    heartbeat_s,
    outputs: dict[str, Path],
    screen: str | None = None,
    screen_hardware: str | None = None,
    screen_trials: int = 40,
    must_exist: bool = False,
    quality_path: Path | None = None,
    quality_prompts_path: Path | None = None,
    before_writes: Callable[[optuna.storages.RDBStorage, str], None] | None = None,
    chips: int = 1,
    chip_cost_per_hour: float | None = None,
    derived: tuple[Scenario, str] | None = None,
) -> Prepared:
    """Validate every input and output before anything is written, then open (or resume) the study.
    `before_writes(storage, study name)` runs once the storage is open, before the study is written
    (nightly takes its lock there). `derived`: the scenario to run instead of --scenario's, and
    what names it in messages (a night's traffic, tuner.nightly_traffic)."""
    if scenario is None:
        raise InputError(f"--scenario is required; presets: {', '.join(preset_names())}")
    chosen, source = derived or (load_scenario(scenario), f"--scenario {scenario}")
    runner = _make_runner(
        runner_name,
        engine=engine,
        model=model,
        hardware=hardware,
        engine_cmd=engine_cmd,
        runner_config=runner_config,
        chips=chips,
    )
    runner.check_inputs()
    chosen = check_context(chosen, source, runner)
    space = SearchSpace.load(runner.engine, space_path).fit_workload(chosen.workload, source)
    for part, what in (("burst", "a burst"), ("sessions", "sessions")):
        if chips > 1 and getattr(chosen.workload, part) is not None:
            raise InputError(
                f"--chips: {what} (workload.{part} of --scenario {scenario}) is measured on "
                "one chip's load only; run it without --chips"
            )
    shares = chosen.workload.trace_shares_prompts
    if chips > 1 and runner.name == "sim" and (chosen.closed_loop or shares):
        why = (
            "the simulator runs a disaggregated deployment under open-loop arrivals only"
            if chosen.closed_loop
            else "the simulator's prefill instances do not share a trace's prompt blocks"
        )
        space = space.restrict("deployment", ["co-located"], why)
        if "deployment" not in space.ranges:
            space = space.with_range(
                "deployment", KnobRange(value="co-located"), f"deployment co-located: {why}"
            )
    space = runner.adapt(space)
    if runner.name not in CHIP_BUDGET_RUNNERS:  # these measure one co-located instance
        space = with_deployment(space, 1, 1.0, "", False)
    quality = plan_quality(chosen, source, runner, space, quality_path, quality_prompts_path)
    space, chosen = quality.space, quality.scenario
    ceiling = runner.batch_ceiling(space, chosen.workload)
    if ceiling is not None:
        space = space.with_ceiling("batch_size", *ceiling)
    simulated = runner.name == "sim"
    optuna_sampler = make_sampler(sampler, seed, space, trials, simulated)
    baseline = None
    if baseline_path is not None:
        baseline = parse_config(runner.engine, load_export(baseline_path).knobs, str(baseline_path))
        fixed = space.fixed()
        moved = {k: v for k, v in baseline.items() if k in fixed and fixed[k] != v}
        if moved:
            knob, value = next(iter(moved.items()))
            raise InputError(
                f"--baseline: {baseline_path} runs {knob} {value}, which this run fixes at "
                f"{fixed[knob]} (--space or the runner): it would run another config; free the "
                "knob in --space or give another baseline"
            )
    check_outputs(
        outputs,
        _inputs(
            scenario,
            hardware,
            runner_config,
            space_path,
            storage,
            baseline_path,
            screen_hardware,
            quality_path,
            quality_prompts_path,
        ),
    )
    if screen is not None and chips > 1:
        raise InputError(
            f"--screen: {screen} screens one instance; with --chips {chips} run the study "
            "without --screen (the simulator's deployments are --runner sim's own study)"
        )
    screening = plan_screen(screen, screen_hardware, screen_trials, seed, runner, chosen, space)
    identity = runner.identity()
    name = study_name or default_study_name(chosen, identity)
    if must_exist and study_name_missing(storage, name):
        raise InputError(
            f"--study: no study {name!r} in {storage}; run `autotune` or `autotune worker` first"
        )
    rdb = open_storage(storage, heartbeat_s)
    if before_writes is not None:
        before_writes(rdb, name)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    assumed = runner.assumptions() | quality.assumptions()
    study = create_study(
        rdb, name, optuna_sampler, chosen, identity, assumed, space.distributions()
    )
    kept = keep_earlier_batch_range(study, space)
    if kept is not space:
        space = kept
        study.sampler = make_sampler(sampler, seed, space, trials, simulated)
    study.set_user_attr("fixed_knobs", space.fixed())
    if chip_cost_per_hour is not None:  # the latest price: the front and exports show it
        study.set_user_attr(CHIP_COST_ATTR, chip_cost_per_hour)
    study.set_user_attr(EXCLUDED, quality.excluded)
    book = quality.book(study, runner, rdb)
    if baseline is not None:
        dists = space.distributions()
        study.enqueue_trial(
            {k: v for k, v in baseline.items() if k in dists},
            user_attrs={"baseline": str(baseline_path)},
        )
    if screening is not None:
        screening.attach(rdb, name)
        screening.quality = book.table_only()
        screening.simulated = table_answered(chosen, quality.table, space)
    return Prepared(
        chosen,
        runner,
        space,
        study,
        rdb,
        screening,
        describe(sampler, simulated),
        book,
        tuple(quality.notes),
        lambda offset: make_sampler(sampler, (seed + offset) % 2**32, space, trials, simulated),
    )


def keep_earlier_batch_range(study: optuna.Study, space: SearchSpace) -> SearchSpace:
    """A resumed study keeps the batch range its trials were sampled in when only the ceiling
    moved (e.g. a study from before ceilings came from memory): Optuna's multivariate TPE and
    GP model jointly only the parameters whose distribution every trial shares."""
    spec = space.ranges.get("batch_size")
    earlier = next(
        (t.distributions["batch_size"] for t in study.get_trials(deepcopy=False)
         if "batch_size" in t.distributions),
        None,
    )  # fmt: skip
    if spec is None or spec.low is None or not isinstance(earlier, IntDistribution):
        return space
    if earlier.low != spec.low or earlier.high == spec.high or earlier.log != spec.log:
        return space  # another range altogether: the user's to choose
    note = (
        f"batch_size range kept at {earlier.low}..{earlier.high} as the study's earlier trials "
        f"searched it (the ceiling here is {spec.high:g}; a new --study searches that)"
    )
    return space.with_range("batch_size", spec.model_copy(update={"high": earlier.high}), note)


def report_outputs(export_path: Path, html_path: Path | None, no_html: bool) -> dict[str, Path]:
    """The files a run writes: the export and, unless --no-html, the report and its PNG."""
    if no_html and html_path is not None:
        raise InputError(f"--no-html: given with --html {html_path}; give one of them")
    if no_html:
        return {"--export": export_path}
    html_path = html_path or export_path.with_name(export_path.stem + ".report.html")
    return {
        "--export": export_path,
        "--html": html_path,
        "--html's .png": html_path.with_suffix(".png"),
    }
