"""The `autotune` command line."""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from datetime import datetime, timezone
from pathlib import Path

import click
import optuna
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from objectives.scenario import Scenario, load_scenario, preset_names
from objectives.scoring import throughput_label
from objectives.userfile import InputError
from runners.base import RUNNERS
from tuner import __version__, flags
from tuner import nightly as night
from tuner.console import err, out
from tuner.export import build_export, load_export, write_export
from tuner.ladder import print_quality
from tuner.outputs import write_atomic
from tuner.prepare import Prepared, check_outputs, prepare, report_outputs
from tuner.quality import describe_figures, quality_summary
from tuner.report import write_report
from tuner.samplers import SAMPLERS
from tuner.screen import SCREENS
from tuner.sim_commands import calibrate_cmd, profile_hardware_cmd
from tuner.storage import (
    DEFAULT_STORAGE,
    HEARTBEAT_S,
    latest_snapshot,
    load_study,
    open_storage,
    sqlite_file,
)
from tuner.study import StudyRun, TrialReport, best_trial, optimize, snapshot, trial_knobs

EXIT_NO_FEASIBLE = 3  # the study ran, but no config met the SLA: nothing was exported


def _interrupt_on_sigterm() -> None:
    """systemd and Kubernetes stop with SIGTERM: treat it as Ctrl-C so the engine is stopped too."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def _front_table(title: str, rows: list[dict], best: int | None, scenario: Scenario) -> Table:
    capacity = scenario.load.mode == "capacity"
    peak = scenario.load.peak_rate
    table = Table(title=title)
    columns = ["trial", f"TTFT p99 ms @{scenario.nominal_rate:g}", throughput_label(scenario)]
    if capacity:
        columns.append("capacity " + ("in flight" if scenario.closed_loop else "req/s"))
    if capacity and peak:
        columns.append(f"instances @{peak:g}/s")
    columns += ["batch", "first", "prefill tok", "quant", "kv", "quality", "p99 n"]
    for column in columns:
        table.add_column(column, justify="right", no_wrap=True)
    for row in rows:
        p, m = row["params"], row["metrics"]
        cells = [
            f"{row['trial']}{' *' if row['trial'] == best else ''}",
            f"{row['ttft_p99_ms']:.1f}",
            f"{row['output_tokens_per_s']:.0f}",
        ]
        if (
            capacity
        ):  # measured requests/s at capacity (what sizes the fleet), or requests in flight
            rate = m.get("capacity_rate") if scenario.closed_loop else m.get("capacity_rps") or None
            cells.append(
                "-" if rate is None else f"{rate:.3g}{'+' if m.get('capacity_at_ceiling') else ''}"
            )
        if capacity and peak:
            cells.append(str(m.get("instances_for_peak") or "-"))
        cells += [
            str(p.get("batch_size", "")),
            str(p.get("select_batch", "")).removesuffix("-first"),
            str(p.get("max_prefill_tokens", "")),
            str(p.get("quantization", "")),
            str(p.get("kv_compression", "")),
            describe_figures(m),
            str(m.get("ttft_samples", "")),
        ]
        table.add_row(*cells)
    return table


def _snapshot_rows(snap) -> list[dict]:
    return [
        {
            "trial": m.trial_number,
            "ttft_p99_ms": m.ttft_p99_ms,
            "output_tokens_per_s": m.output_tokens_per_s,
            "params": m.params,
            "quality": quality_summary(m.metrics),
            "metrics": m.metrics,
        }
        for m in snap.members
    ]


def _export_trial(study: optuna.Study, trial: optuna.trial.FrozenTrial, path: Path) -> None:
    scenario = Scenario.model_validate(study.user_attrs["scenario"])
    exported = build_export(
        study.study_name,
        trial.number,
        scenario.name,
        scenario.sla.model_dump(),
        study.user_attrs["identity"],
        trial_knobs(study, trial),
        dict(trial.user_attrs),
        scenario.load.peak_rate,
        workload=scenario.workload,
    )
    write_export(path, exported)


def _progress_text(reports: list[TrialReport]) -> str:
    feasible = [r for r in reports if r.status == "feasible"]
    if not feasible:
        return "best feasible: none yet"
    best = max(
        feasible, key=lambda r: (r.values[1], -r.values[0])
    )  # a live hint, not the pick rule
    return f"best feasible: #{best.number} {best.values[1]:.0f} tok/s, TTFT p99 {best.values[0]:.0f} ms"


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
        help="sim: hardware profile or YAML (default ascend-910b2); engines: a label (default: host name)",
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
    "trials": click.option("--trials", type=flags.COUNT, default=50, show_default=True),
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
        type=click.Path(path_type=Path),
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
        type=click.Path(path_type=Path),
        help="HTML report and its Pareto PNG (default: beside --export, NAME.report.html)",
    ),
    "no_html": click.option("--no-html", is_flag=True, help="write no HTML report"),
    "screen": click.option(
        "--screen",
        type=click.Choice(SCREENS),
        help="real runners: let the simulator screen candidates; only the most promising run for real",
    ),
    "screen_hardware": click.option(
        "--screen-hardware",
        help="with --screen: the hardware profile to simulate with (recalibrated as real trials arrive)",
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


def tune_options(f, leave_out: tuple[str, ...] = ()):
    for name, option in reversed(TUNE_OPTIONS.items()):
        if name not in leave_out:
            f = option(f)
    return f


def nightly_options(f):
    """The tuning options less --trials and --baseline: a night has a --budget and an incumbent."""
    return tune_options(f, leave_out=("trials", "baseline"))


def tune(
    p: Prepared, trials: int, timeout_s: float | None, study_total: int | None = None
) -> list[TrialReport]:
    for note in p.space.notes:
        err.print(f"[dim]note: {escape(note)}[/dim]")
    run = StudyRun(
        p.study, p.scenario, p.space, p.runner, p.storage, screen=p.screen, quality=p.quality
    )
    err.print(
        f"study [bold]{escape(p.study.study_name)}[/bold]: {len(p.study.trials)} earlier trials; "
        f"sampler {escape(p.sampler)}"
    )  # the sampler's hint names pip's extra: '.[gp]' is no markup
    columns = (
        TextColumn("trial"),
        MofNCompleteColumn(),
        BarColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    )
    with Progress(*columns, console=err, transient=False) as progress:
        task = progress.add_task("best feasible: none yet", total=trials)

        def on_trial(report: TrialReport) -> None:
            progress.update(task, advance=1, description=_progress_text(run.reports))

        optimize(run, trials, timeout_s, on_trial, study_total)
    return run.reports


def write_html(p: Prepared, outputs: dict[str, Path]) -> None:
    """The report of a run or a night; none while the study has no measured trial to show."""
    if "--html" in outputs and p.study.get_trials(
        deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)
    ):
        write_report(p.study, p.storage.engine, outputs["--html"])
        out.print(f"report: {outputs['--html']}", markup=False)


def finish(p: Prepared, reports: list[TrialReport], outputs: dict[str, Path]) -> None:
    """Snapshot the front, print it, write the report, export the best config (exit 3 when
    none is feasible)."""
    export_path = outputs["--export"]
    study, scenario = p.study, p.scenario
    snapshot(study, scenario, p.storage)
    snap = latest_snapshot(p.storage, study.study_name)
    counts = {
        status: sum(1 for r in reports if r.status == status)
        for status in ("feasible", "violates-sla", "infeasible", "fail")
    }
    out.print(
        _front_table(
            f"SLA-feasible Pareto front of {study.study_name} (TTFT p99 <= {scenario.sla.ttft_p99_ms:g} ms)",
            _snapshot_rows(snap),
            snap.best_trial,
            scenario,
        )
    )
    slo = " and the quality SLO" if scenario.quality else ""
    out.print(
        f"{len(reports)} trials this run: {counts['feasible']} met the SLA{slo}, {counts['violates-sla']} missed "
        f"it, {counts['infeasible']} could not run, {counts['fail']} failed; {len(study.trials)} in the study"
    )
    print_quality(study, p.quality)
    write_html(p, outputs)
    best = best_trial(study, scenario)
    if best is None:
        err.print("[bold red]no SLA-feasible config found: nothing exported[/bold red]")
        sys.exit(EXIT_NO_FEASIBLE)
    _export_trial(study, best, export_path)
    out.print(f"best: trial {best.number} ({scenario.pick}) -> {export_path}", markup=False)


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@tune_options
@click.version_option(__version__, prog_name="autotune")
@click.pass_context
def cli(ctx, trials, timeout_s, export_path, html_path, no_html, **options):
    """Tune an LLM serving config for a scenario's SLA: `autotune --scenario customer-service`.

    --trials is the number of trials this run adds to the study.
    """
    if ctx.invoked_subcommand is not None:
        return
    outputs = report_outputs(export_path, html_path, no_html)
    prepared = prepare(trials=trials, outputs=outputs, **options)
    finish(prepared, tune(prepared, trials, timeout_s), outputs)


@cli.command()
@tune_options
def worker(trials, timeout_s, export_path, html_path, no_html, **options):
    """One of many workers sharing a study (e.g. one per host on PostgreSQL).

    --trials is the total for the study: all workers together run exactly that many.
    """
    outputs = report_outputs(export_path, html_path, no_html)
    prepared = prepare(trials=trials, outputs=outputs, **options)
    finish(prepared, tune(prepared, trials, timeout_s, study_total=trials), outputs)


def _storage_option(f):
    return click.option("--storage", default=DEFAULT_STORAGE, show_default=True)(f)


@cli.command("nightly")
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
    help="smallest relative gain that promotes (default: the scenario's load.precision in capacity mode, "
    f"at least {night.MIN_GAIN:.0%}: the capacity search cannot tell apart configs closer than its "
    "precision, so a smaller gain would promote noise)",
)
@click.option(
    "--report",
    "report_path",
    type=click.Path(path_type=Path),
    help="markdown report (default: beside --export)",
)
@click.option(
    "--promoted-exit",
    type=click.IntRange(0, 255),
    default=night.EXIT_PROMOTED,
    show_default=True,
    help="exit status of a promotion (0 for a Kubernetes Job, which fails on any other)",
)
def nightly_cmd(
    budget,
    repeats,
    min_gain,
    report_path,
    promoted_exit,
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
            inc = (
                night.measure(p.runner, p.scenario, incumbent.knobs, repeats) if incumbent else None
            )
            # Warm start: tonight re-measures last night's front first, then tries `budget` new configs.
            last = latest_snapshot(p.storage, name)
            dists = p.space.distributions()
            warm = (
                [{k: v for k, v in m.params.items() if k in dists} for m in last.members]
                if last
                else []
            )
            for params in warm:
                p.study.enqueue_trial(params, user_attrs={"warm_start": True})
            reports = tune(p, budget + len(warm), timeout_s)
            snapshot(p.study, p.scenario, p.storage)
            best = best_trial(p.study, p.scenario)
            cand = (
                night.measure(p.runner, p.scenario, trial_knobs(p.study, best), repeats)
                if best
                else None
            )
            decision = night.decide(p.scenario, inc, cand, min_gain)
            # The night is on record before the deployed file changes, and only while its lock holds.
            night.beat_lock(engine, name)
            night.record_night(engine, name, started, decision, inc, cand)
            if decision.outcome == "promoted":
                if export_path.exists():
                    write_atomic(
                        export_path.with_name(export_path.name + ".prev"), export_path.read_text()
                    )
                _export_trial(p.study, best, export_path)
            write_atomic(
                report_path,
                night.report(name, started, decision, inc, cand, best.number if best else None),
            )
            write_html(p, outputs)
    finally:
        lock.release()
    if decision.drift:
        err.print("[bold red]DRIFT: the deployed config no longer meets the SLA[/bold red]")
    out.print(
        f"{decision.outcome}: {decision.reason} ({len(reports)} trials tonight; report {report_path})",
        markup=False,
    )
    sys.exit(
        {"promoted": promoted_exit, "unchanged": night.EXIT_UNCHANGED}.get(
            decision.outcome, night.EXIT_FAILED
        )
    )


def _tokens(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


@cli.command()
@_storage_option
@click.option("--study", "study_name", help="only this study")
def history(storage, study_name):
    """List past nightly runs."""
    rdb = open_storage(storage, read_only=True)
    table = Table()
    for column in (
        "date",
        "study",
        "decision",
        "deployed tok/s",
        "candidate tok/s",
        "reason",
    ):  # throughput objective
        table.add_column(column)
    for n in night.nights(rdb.engine, study_name):
        inc, cand = n.incumbent or {}, n.candidate or {}
        table.add_row(
            f"{n.started_at:%Y-%m-%d %H:%M}",
            n.study_name,
            n.decision,
            _tokens(inc.get("output_tokens_per_s_mean")),
            _tokens(cand.get("output_tokens_per_s_mean")),
            n.reason,
        )
    out.print(table)


@cli.command()
def scenarios():
    """List the scenario presets."""
    table = Table()
    for column in (
        "scenario",
        "TTFT p99 SLA",
        "TPOT p99 SLA",
        "input tokens",
        "output tokens",
        "arrival",
        "quality SLO",
    ):
        table.add_column(column, no_wrap=True)
    for name in preset_names():
        s = load_scenario(name)
        w, quality = s.workload, s.quality.model_dump(exclude_none=True) if s.quality else {}
        table.add_row(
            name,
            f"{s.sla.ttft_p99_ms:g} ms",
            f"{s.sla.tpot_p99_ms:g} ms" if s.sla.tpot_p99_ms else "-",
            "{}..{}".format(*w.input_tokens.bounds),
            "{}..{}".format(*w.output_tokens.bounds),
            w.arrival.kind,
            ", ".join(f"{k} {v:g}" for k, v in quality.items()) or "-",
        )
    out.print(table)


@cli.command()
@_storage_option
@click.option("--study", "study_name")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def pareto(storage, study_name, as_json):
    """Print the latest SLA-feasible Pareto front of a study."""
    study, rdb = load_study(storage, study_name)
    snap = latest_snapshot(rdb, study.study_name)
    if snap is None:
        raise InputError(
            f"--study: {study.study_name} has no Pareto snapshot yet (run a study first)"
        )
    rows = _snapshot_rows(snap)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "study": study.study_name,
                    "created_at": snap.created_at.isoformat(),
                    "trials_total": snap.trials_total,
                    "trials_feasible": snap.trials_feasible,
                    "best_trial": snap.best_trial,
                    "front": rows,
                },
                indent=2,
            )
        )
    else:
        scenario = Scenario.model_validate(study.user_attrs["scenario"])
        out.print(
            _front_table(
                f"SLA-feasible Pareto front of {study.study_name}", rows, snap.best_trial, scenario
            )
        )


@cli.command("report")
@_storage_option
@click.option("--study", "study_name")
@click.option(
    "-o",
    "--output",
    "output_path",
    type=click.Path(path_type=Path),
    default=Path("report.html"),
    show_default=True,
    help="the HTML file; its Pareto plot goes beside it as .png",
)
def report_cmd(storage, study_name, output_path):
    """Write a self-contained HTML report of a study (and a PNG of its Pareto plot)."""
    check_outputs(
        {"-o": output_path, "-o's .png": output_path.with_suffix(".png")},
        {"--storage": sqlite_file(storage)},
    )
    study, rdb = load_study(storage, study_name)
    png = write_report(study, rdb.engine, output_path)
    out.print(f"report: {output_path} (Pareto plot: {png})", markup=False)


@cli.command("export")
@_storage_option
@click.option("--study", "study_name")
@click.option(
    "--trial", "trial_number", type=click.IntRange(min=0), help="trial number (default: the best)"
)
@click.option(
    "--export",
    "export_path",
    type=click.Path(path_type=Path),
    default=Path("best-config.yaml"),
    show_default=True,
)
def export_cmd(storage, study_name, trial_number, export_path):
    """Write the YAML of a trial (default: the best SLA-feasible one)."""
    check_outputs({"--export": export_path}, {"--storage": sqlite_file(storage)})
    study, _ = load_study(storage, study_name)
    scenario = Scenario.model_validate(study.user_attrs["scenario"])
    if trial_number is None:
        trial = best_trial(study, scenario)
        if trial is None:
            raise InputError(
                f"{study.study_name}: no SLA-feasible trial to export; name one with --trial"
            )
    else:
        done = {t.number: t for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))}
        if trial_number not in done:
            raise InputError(
                f"--trial: {trial_number} is not a completed trial of {study.study_name}"
            )
        trial = done[trial_number]
    _export_trial(study, trial, export_path)
    out.print(f"trial {trial.number} -> {export_path}", markup=False)


cli.add_command(profile_hardware_cmd)
cli.add_command(calibrate_cmd)


def main() -> None:
    # Heartbeats are used with ask/tell on purpose (each trial runs in our own loop).
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings(
        "ignore", message="Heartbeat of storage is supposed to be used with Study.optimize"
    )
    _interrupt_on_sigterm()
    try:
        cli.main(standalone_mode=False)
    except InputError as error:
        err.print(
            f"autotune: error: {' '.join(str(error).splitlines())}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(2)
    except (click.exceptions.Abort, KeyboardInterrupt):
        err.print("autotune: interrupted; finished trials are kept", markup=False)
        sys.exit(130)
    except click.ClickException as error:
        err.print(
            f"autotune: error: {error.format_message()}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(2)
