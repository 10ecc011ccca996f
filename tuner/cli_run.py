"""A tuning run on the command line (`autotune`, `autotune worker`, each night of `autotune
nightly`): the trials under a progress bar, then the front printed, the HTML report written and
the best config exported."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path

import optuna
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from objectives.userfile import InputError
from search_spaces.edges import range_edges
from tuner.answer import Answer, answer
from tuner.console import err, out
from tuner.cost import CHIP_COST_ATTR
from tuner.export import answer_export, trial_export, write_export
from tuner.front_table import front_table, snapshot_rows
from tuner.hold import REAL_HOLD, HoldPlan, describe_hold, hold_pick, pick_to_hold, sim_hold
from tuner.ladder import print_quality
from tuner.misses import closest_miss, why_nothing_met
from tuner.polish import REAL_POLISH_TRIALS, SIM_POLISH_TRIALS, refine_and_polish
from tuner.prepare import Prepared
from tuner.repeats import REAL_REPEATS, describe_repeats, engine_measure, repeat_pick
from tuner.report import deployment_comparison, write_report
from tuner.storage import latest_snapshot
from tuner.study import (
    RANGE_EDGES,
    StudyRun,
    TrialReport,
    repeats_of,
    snapshot,
    trial_knobs,
)
from tuner.trials import optimize

EXIT_NO_FEASIBLE = 3  # the study ran, but no config met the SLA: nothing was exported


def export_trial(study: optuna.Study, trial: optuna.trial.FrozenTrial, path: Path) -> None:
    """Write a trial's config as the YAML to deploy (`--export`), with the hold and repeats
    the study keeps for it."""
    write_export(path, trial_export(study, trial))


def _progress_text(reports: list[TrialReport]) -> str:
    # A feasible trial was measured: its report has values (TTFT p99, throughput).
    feasible = [
        (r.number, r.values) for r in reports if r.status == "feasible" and r.values is not None
    ]
    if not feasible:
        return "best feasible: none yet"
    # A live hint, not the pick rule.
    number, (ttft, throughput) = max(feasible, key=lambda f: (f[1][1], -f[1][0]))
    return f"best feasible: #{number} {throughput:.0f} tok/s, TTFT p99 {ttft:.0f} ms"


def tune(
    p: Prepared,
    trials: int,
    timeout_s: float | None,
    study_total: int | None = None,
    polish_trials: int | None = 0,
) -> list[TrialReport]:
    """The study's trials, then (`polish_trials`, None for the runner's default) the pick's
    one-knob neighbourhood (tuner.polish)."""
    for note in (*p.space.notes, *p.notes):
        err.print(f"[dim]note: {escape(note)}[/dim]")
    every_knob_fixed = all(dist.single() for dist in p.space.distributions().values())
    if every_knob_fixed and trials > 1:
        err.print("[dim]note: every knob is fixed: one trial measures the config[/dim]")
        trials = 1
    started = time.monotonic()
    run = StudyRun(
        p.study,
        p.scenario,
        p.space,
        p.runner,
        p.storage,
        screen=p.screen,
        quality=p.quality,
        new_sampler=p.new_sampler,
    )
    err.print(
        f"study [bold]{escape(p.study.study_name)}[/bold]: {len(p.study.trials)} earlier trials; "
        f"sampler {escape(p.sampler)}"
    )  # the sampler's hint names pip's extra: '.[gp]' is no markup
    columns = (
        TextColumn("{task.fields[phase]}"),
        MofNCompleteColumn(),
        BarColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    )
    with Progress(*columns, console=err, transient=False) as progress:
        task = progress.add_task("best feasible: none yet", total=trials, phase="trial")

        def on_trial(report: TrialReport) -> None:
            progress.update(task, advance=1, description=_progress_text(run.reports))

        with p.phase("study"):
            optimize(run, trials, timeout_s, on_trial, study_total)
        budget = polish_trials
        if budget is None:
            budget = SIM_POLISH_TRIALS if p.runner.name == "sim" else REAL_POLISH_TRIALS
        summary = None
        if budget and not every_knob_fixed:
            task = progress.add_task("", total=budget, phase="polish")
            deadline = None if timeout_s is None else started + timeout_s
            summary = refine_and_polish(run, budget, on_trial, deadline, p.phase)
            progress.update(task, total=progress.tasks[task].completed)
    if summary is not None:
        err.print(summary, markup=False, soft_wrap=True)
    return run.reports


@contextmanager
def _writing(flag: str, path: Path, study: optuna.Study, later: str):
    """An output written after the study: a full disk is one line, and says that the measured
    trials are kept and how to write the file once there is room."""
    try:
        yield
    except OSError as error:
        raise InputError(
            f"{flag}: cannot write {path}: {error.strerror}; the study's trials are kept: write "
            f"it later with `autotune {later} --study {study.study_name}`"
        ) from None


def write_html(p: Prepared, outputs: dict[str, Path], stated: Answer | None = None) -> None:
    """The report of a run (`stated`: its answer) or a night; none while the study has no
    measured trial to show."""
    if "--html" in outputs and p.study.get_trials(
        deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)
    ):
        with _writing("--html", outputs["--html"], p.study, "report"):
            write_report(p.study, p.storage.engine, outputs["--html"], stated)
        out.print(f"report: {outputs['--html']}", markup=False)


def finish(
    p: Prepared,
    reports: list[TrialReport],
    outputs: dict[str, Path],
    hold: int | None = 0,
    repeats: int | None = 0,
) -> None:
    """Measure the pick and its rivals again (`repeats` in all; None: the runner's default),
    hold the best config at its capacity (`hold` times the scenario's requests; None: the
    runner's default), which may move the pick to a config it was tied with, then snapshot
    the front, print it, write the report, export it (exit 3 when none is feasible)."""
    export_path = outputs["--export"]
    study, scenario = p.study, p.scenario
    simulated = p.runner.name == "sim"
    if repeats is None:
        repeats = 0 if simulated else REAL_REPEATS
    # This run's repeats and hold, in memory: another run on the study may record its own
    # meanwhile, and what this run prints, reports and exports is what it measured.
    repeated = None
    if repeats > 1:
        repeated = repeat_pick(study, scenario, repeats, engine_measure(p.runner, scenario))
        if repeated is not None:
            out.print(describe_repeats(repeated), markup=False, soft_wrap=True)
    plan = sim_hold(scenario) if simulated else REAL_HOLD
    if hold is not None:
        plan = HoldPlan(hold, plan.draws, plan.extension_cap)
    pick = pick_to_hold(study, scenario, repeated)
    if repeated is None and pick is not None:  # an earlier run's repeats of it: the answer's too
        repeated = repeats_of(study, pick.number)
    held = None
    if pick is not None and plan.factor:
        with p.phase("hold"):
            held = hold_pick(p.runner, study, scenario, pick, plan, repeated)
    best = _run_best(study, pick, held)
    stated = None if best is None else answer(study, best, held, repeated)
    snapshot(study, scenario, p.storage, best)
    snap = latest_snapshot(p.storage, study.study_name)
    assert snap is not None, "snapshot() has just saved one"
    counts = {
        status: sum(1 for r in reports if r.status == status)
        for status in ("feasible", "violates-sla", "infeasible", "fail", "pruned")
    }
    out.print(
        front_table(
            f"SLA-feasible Pareto front of {study.study_name} ({scenario.sla.describe()})",
            snapshot_rows(snap),
            None if best is None else best.number,
            scenario,
            study.user_attrs.get(CHIP_COST_ATTR),
            stated,
        )
    )
    slo = " and the quality SLO" if scenario.quality else ""
    out.print(
        f"{len(reports)} trials this run: {counts['feasible']} met the SLA{slo}, "
        f"{counts['violates-sla']} missed it, {counts['infeasible']} could not run, "
        f"{counts['fail']} failed"
        + (
            f", {counts['pruned']} pruned (slower than the pick they had to beat)"
            if counts["pruned"]
            else ""
        )
        + f"; {len(study.trials)} in the study"
    )
    print_quality(study, p.quality)
    edges = [] if best is None else range_edges(p.space, trial_knobs(study, best))
    if held is not None:
        out.print(describe_hold(held, scenario), markup=False, soft_wrap=True)
    if best is not None:  # the report shows them beside this trial only
        study.set_user_attr(
            RANGE_EDGES, {"trial": best.number, "messages": [e.message() for e in edges]}
        )
    with p.phase("report"):
        write_html(p, outputs, stated)
    if best is None:
        this_run = [r.number for r in reports]
        closest = closest_miss(study, this_run)
        for line in [closest] if closest is not None else why_nothing_met(study, this_run):
            out.print(line, markup=False, soft_wrap=True)
        err.print("[bold red]no SLA-feasible config found: nothing exported[/bold red]")
        err.print(p.where_the_time_went(), markup=False, soft_wrap=True)
        sys.exit(EXIT_NO_FEASIBLE)
    assert stated is not None, "an answer for every best trial"
    with _writing("--export", export_path, study, "export"):
        write_export(export_path, answer_export(study, stated))
    chips = bool(study.user_attrs["identity"].get("chips"))
    out.print(f"answer: {stated.describe(chips)}", markup=False, soft_wrap=True)
    out.print(f"best: trial {best.number} ({scenario.pick}) -> {export_path}", markup=False)
    compared = deployment_comparison(study, scenario)  # a chip budget, both deployments feasible
    if compared is not None:
        out.print(compared, markup=False, soft_wrap=True)
    for edge in edges:
        out.print(f"note: the best {edge.message()}", markup=False, soft_wrap=True)
    err.print(p.where_the_time_went(), markup=False, soft_wrap=True)


def _run_best(
    study: optuna.Study, pick: optuna.trial.FrozenTrial | None, held: dict | None
) -> optuna.trial.FrozenTrial | None:
    """The run's answer: the config its hold chose (no hold ran: the pick)."""
    return pick if held is None else study.get_trials(deepcopy=False)[held["trial"]]
