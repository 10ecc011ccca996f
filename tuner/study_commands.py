"""The commands that read a study a run left (`pareto`, `report`, `export`, `history`), and
`scenarios`, which lists the presets."""

from __future__ import annotations

import json
from pathlib import Path

import click
import optuna
from rich.table import Table

from objectives.scenario import Scenario, load_scenario, preset_names
from objectives.userfile import InputError
from tuner import flags
from tuner import nightly as night
from tuner.answer import answer
from tuner.cli_options import storage_option
from tuner.cli_run import export_trial
from tuner.console import out
from tuner.cost import CHIP_COST_ATTR
from tuner.export import answer_export
from tuner.front_table import front_table, snapshot_rows
from tuner.prepare import check_outputs
from tuner.report import write_report
from tuner.storage import latest_snapshot, load_study, open_storage, sqlite_file
from tuner.study import best_trial


def _tokens(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


@click.command()
@storage_option
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


@click.command()
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
    ):
        table.add_column(column, no_wrap=True)
    table.add_column("quality SLO")  # the long one: it wraps, the names stay whole
    for name in preset_names():
        s = load_scenario(name)
        w, quality = s.workload, s.quality.describe() if s.quality else ""
        table.add_row(
            name,
            f"{s.sla.ttft_p99_ms:g} ms",
            f"{s.sla.tpot_p99_ms:g} ms" if s.sla.tpot_p99_ms else "-",
            "{}..{}".format(*w.input_tokens.bounds),
            "{}..{}".format(*w.output_tokens.bounds),
            w.arrival.kind,
            quality or "-",
        )
    out.print(table)


@click.command()
@storage_option
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
    rows = snapshot_rows(snap)
    best = next((t for t in study.trials if t.number == snap.best_trial), None)
    stated = None if best is None else answer(study, best)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "study": study.study_name,
                    "created_at": snap.created_at.isoformat(),
                    "trials_total": snap.trials_total,
                    "trials_feasible": snap.trials_feasible,
                    "best_trial": snap.best_trial,
                    # the exported trial's figures, as its export states them (tuner.answer)
                    "answer": None if stated is None else answer_export(study, stated).capacity,
                    "front": rows,
                },
                indent=2,
            )
        )
    else:
        scenario = Scenario.model_validate(study.user_attrs["scenario"])
        out.print(
            front_table(
                f"SLA-feasible Pareto front of {study.study_name} ({scenario.sla.describe()})",
                rows,
                snap.best_trial,
                scenario,
                study.user_attrs.get(CHIP_COST_ATTR),
                stated,
            )
        )


@click.command("report")
@storage_option
@click.option("--study", "study_name")
@click.option(
    "-o",
    "--output",
    "output_path",
    type=flags.OUTPUT_FILE,
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


@click.command("export")
@storage_option
@click.option("--study", "study_name")
@click.option(
    "--trial", "trial_number", type=click.IntRange(min=0), help="trial number (default: the best)"
)
@click.option(
    "--export",
    "export_path",
    type=flags.OUTPUT_FILE,
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
    export_trial(study, trial, export_path)
    out.print(f"trial {trial.number} -> {export_path}", markup=False)
