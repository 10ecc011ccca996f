"""`autotune nightly`: re-tune a study and promote a new config only when it is truly better
(the decision and the lock: tuner.nightly)."""

from __future__ import annotations

import os
import sys
from datetime import datetime, timezone
from pathlib import Path

import click

from objectives.scenario import load_scenario
from objectives.trace import FORMATS
from objectives.userfile import InputError
from search_spaces.edges import inside
from tuner import flags
from tuner import nightly as night
from tuner import nightly_traffic as traffic
from tuner.cli_options import nightly_options
from tuner.cli_run import export_trial, tune, write_html
from tuner.console import err, out
from tuner.export import ExportedConfig, load_export
from tuner.outputs import check_distinct, write_atomic
from tuner.prepare import Prepared, check_context, prepare, report_outputs
from tuner.storage import latest_snapshot
from tuner.study import best_trial, snapshot, trial_knobs


@click.command("nightly")
@nightly_options
@click.option(
    "--budget", type=flags.COUNT, default=20, show_default=True, help="new trials tonight"
)
@click.option(
    "--repeats",
    type=flags.COUNT,
    default=3,
    show_default=True,
    help="measurements of incumbent and candidate",
)
@click.option(
    "--min-gain",
    type=flags.FiniteRange(min=0),
    help="smallest relative gain that promotes (default: the scenario's load.precision in "
    f"capacity mode, at least {night.MIN_GAIN:.0%}: the capacity search cannot tell apart configs "
    "closer than its precision, so a smaller gain would promote noise)",
)
@click.option(
    "--report",
    "report_path",
    type=flags.OUTPUT_FILE,
    help="markdown report (default: beside --export)",
)
@click.option(
    "--promoted-exit",
    type=click.IntRange(0, 255),
    default=night.EXIT_PROMOTED,
    show_default=True,
    help="exit status of a promotion (0 for a Kubernetes Job, which fails on any other)",
)
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(path_type=Path),
    help="tonight's traffic, a request log: compared with the study's (rate, burstiness, "
    "lengths, prefix share); where it drifted the night re-tunes and measures on it",
)
@click.option(
    "--trace-format",
    type=click.Choice(FORMATS),
    help="--trace's format where the study's scenario draws its traffic (a trace study's "
    "logs are read in its own format)",
)
def nightly_cmd(
    budget,
    repeats,
    min_gain,
    report_path,
    promoted_exit,
    trace_path,
    trace_format,
    timeout_s,
    export_path,
    html_path,
    no_html,
    **options,
):
    """Re-tune a study and promote a new config only when it is truly better (for cron).

    Exit status: 0 unchanged, 10 promoted, 20 failed (nothing meets the SLA), 2 bad input or
    another nightly run holds the lock.
    """
    incumbent = load_export(export_path) if os.path.lexists(export_path) else None
    report_path = report_path or export_path.with_name(export_path.stem + ".nightly.md")
    outputs = report_outputs(export_path, html_path, no_html) | {
        "--report": report_path,
        "--export's .prev": export_path.with_name(export_path.name + ".prev"),
    }
    tonight = None
    if trace_path is not None:
        check_distinct(outputs, {"--trace": trace_path})
        if options["scenario"] is not None:  # (prepare says so where it is missing)
            study_scenario = load_scenario(options["scenario"])
            tonight, notes = traffic.tonights_scenario(study_scenario, trace_path, trace_format)
            for note in notes:
                err.print(f"note: {note}", markup=False, soft_wrap=True)
    elif trace_format is not None:
        raise InputError("--trace-format: says the format of --trace, which is not given")
    lock = night.StudyLock()
    try:  # the lock is taken once the storage is open, before the night writes to the study
        p = prepare(
            trials=budget,
            baseline_path=None,
            must_exist=True,
            outputs=outputs,
            before_writes=lock.take,
            **options,
        )
        if lock.note:
            err.print(f"note: {lock.note}", markup=False)
        engine, name = p.storage.engine, p.study.study_name
        min_gain = night.default_min_gain(p.scenario) if min_gain is None else min_gain
        with night.lock_kept(engine, name):
            started = datetime.now(timezone.utc)
            night_on, changes = p, []
            if tonight is not None:
                source = f"--trace {trace_path}"
                tonight = check_context(tonight, source, p.runner)
                changes = traffic.compare(
                    traffic.study_traffic(p.scenario), traffic.study_traffic(tonight)
                )
                if traffic.drifted(changes):
                    night_on = prepare(
                        trials=budget,
                        baseline_path=None,
                        outputs=outputs,
                        derived=(tonight, source),
                        **(options | {"study_name": traffic.traffic_study_name(name, tonight)}),
                    )
            inc, cand, best, reports = _measure_night(
                night_on, name, incumbent, budget, repeats, timeout_s
            )
            decision = night.decide(night_on.scenario, inc, cand, min_gain)
            moved = traffic.drifted(changes)
            if moved:
                decision.reason = (
                    f"traffic drifted: {'; '.join(c.describe() for c in moved)}; re-tuned on it "
                    f"as study {night_on.study.study_name}; {decision.reason}"
                )
            # The night is on record before the deployed file changes, and only while its lock
            # holds.
            night.beat_lock(engine, name)
            night.record_night(engine, name, started, decision, inc, cand)
            if decision.outcome == "promoted":
                assert best is not None, "only a measured candidate is promoted"
                if export_path.exists():
                    write_atomic(
                        export_path.with_name(export_path.name + ".prev"), export_path.read_text()
                    )
                export_trial(night_on.study, best, export_path)
            section = traffic.traffic_section(changes, night_on.study.study_name) if changes else []
            write_atomic(
                report_path,
                night.report(
                    name, started, decision, inc, cand, best.number if best else None, section
                ),
            )
            write_html(night_on, outputs)
    finally:
        lock.release()
    if moved:
        drift = "; ".join(c.describe() for c in moved)
        err.print(f"TRAFFIC DRIFT: {drift}", markup=False, soft_wrap=True)
    elif changes:
        err.print("traffic: no drift (every figure within its threshold)", markup=False)
    if decision.drift:
        err.print("[bold red]DRIFT: the deployed config no longer meets the SLA[/bold red]")
    out.print(
        f"{decision.outcome}: {decision.reason} "
        f"({len(reports)} trials tonight; report {report_path})",
        markup=False,
    )
    sys.exit(
        {"promoted": promoted_exit, "unchanged": night.EXIT_UNCHANGED}.get(
            decision.outcome, night.EXIT_FAILED
        )
    )


def _measure_night(
    p: Prepared,
    study_name: str,
    incumbent: ExportedConfig | None,
    budget: int,
    repeats: int,
    timeout_s: float | None,
):
    """The incumbent measured, the study warm-started and run `budget` new trials, and its best
    measured: on `p`'s scenario (the study's, or tonight's traffic in a study of its own,
    warm-started from the study's front until it has one)."""
    inc = night.measure(p.runner, p.scenario, incumbent.knobs, repeats) if incumbent else None
    # Warm start: tonight re-measures the last front first, then tries `budget` new configs.
    last = latest_snapshot(p.storage, p.study.study_name) or latest_snapshot(p.storage, study_name)
    dists = p.space.distributions()
    members = (
        [{k: v for k, v in m.params.items() if k in dists} for m in last.members] if last else []
    )
    # A traffic study's space is fitted to tonight's traffic (a batch ceiling from memory, the
    # prefill range from its longest prompt): a member outside it would run as it is (Optuna
    # warns and keeps an enqueued value out of range).
    warm = [m for m in members if all(inside(dists[k], v) for k, v in m.items())]
    for params in warm:
        p.study.enqueue_trial(params, user_attrs={"warm_start": True})
    reports = tune(p, budget + len(warm), timeout_s)
    snapshot(p.study, p.scenario, p.storage)
    best = best_trial(p.study, p.scenario)
    cand = (
        night.measure(p.runner, p.scenario, trial_knobs(p.study, best), repeats) if best else None
    )
    return inc, cand, best, reports
