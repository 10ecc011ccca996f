"""The study report: one self-contained HTML file (plotly.js, the figures and their data inline,
so it opens with no network) and a PNG of the Pareto plot beside it (Optuna's matplotlib plot).
The plots are drawn by tuner.report_plots.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import optuna
import plotly.graph_objects as go
import yaml
from optuna.trial import FrozenTrial, TrialState
from plotly.offline import get_plotlyjs

from objectives.scenario import Scenario
from objectives.scoring import throughput_label
from objectives.userfile import InputError
from tuner import nightly as night
from tuner.export import build_export
from tuner.ladder import ladder_rows
from tuner.misses import closest_miss
from tuner.outputs import write_atomic
from tuner.quality import describe_figures
from tuner.report_plots import (
    KNOB_COLUMNS,
    curves_figure,
    optuna_figures,
    pareto_figure,
    progress_figure,
    screen_figure,
    write_pareto_png,
)
from tuner.study import RANGE_EDGES, best_trial, feasible_front, trial_knobs


def _plot(figure: go.Figure) -> str:
    return f"<div class='plot'>{figure.to_html(full_html=False, include_plotlyjs=False)}</div>"


def _answer(study: optuna.Study, best: FrozenTrial | None, scenario: Scenario) -> str:
    """The recommended config in one table: its knobs, capacity and quality, and their sources."""
    if best is None:
        closest = closest_miss(study, [])
        return (
            "<p>No trial met the SLA"
            + (" and the quality SLO" if scenario.quality else "")
            + ": nothing was exported.</p>"
            + (f"<p>{html.escape(closest)}</p>" if closest else "")
        )
    attrs = best.user_attrs
    knobs = attrs.get("knobs", best.params)
    capacity = f"{best.values[1]:.0f} {throughput_label(scenario)}"
    if attrs.get("capacity_rps"):
        capacity += f", {attrs['capacity_rps']:.3g} req/s"
    if attrs.get("instances_for_peak"):
        capacity += (
            f"; {attrs['instances_for_peak']} instances for the peak of "
            f"{scenario.load.peak_rate:g} req/s"
        )
    slo = scenario.quality.model_dump(exclude_none=True) if scenario.quality else {}
    load = f"{scenario.nominal_rate:g} {'in flight' if scenario.closed_loop else 'req/s'}"
    rows = [
        [
            "knobs",
            f"trial {best.number}: "
            + ", ".join(f"{k} {knobs[k]}" for k in KNOB_COLUMNS if k in knobs),
        ],
        ["throughput", capacity],
        ["TTFT p99", f"{best.values[0]:.0f} ms at {load} (SLA {scenario.sla.ttft_p99_ms:g} ms)"],
        [
            "quality",
            describe_figures(attrs)
            + (f" (SLO: {', '.join(f'{k} {v:g}' for k, v in slo.items())})" if slo else ""),
        ],
        ["quality source", attrs.get("quality_note", "-")],
    ]
    return _table(rows, ["", "the recommended config"])


def _section(title: str, body: str) -> str:
    return f"<section><h2>{html.escape(title)}</h2>{body}</section>"


def _table(rows: list[list[Any]], head: list[str]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{cells}</tr>{body}</table>"


def _edges(study: optuna.Study, best: FrozenTrial | None) -> str:
    """Where the best config sat on an end of the ranges a run searched (tuner.cli_run), while
    it is still the best."""
    edges = study.user_attrs.get(RANGE_EDGES, {})
    if best is None or not isinstance(edges, dict) or edges.get("trial") != best.number:
        return ""
    items = "".join(f"<li>The best {html.escape(message)}</li>" for message in edges["messages"])
    return f"<ul class='edges'>{items}</ul>" if items else ""


def build_html(study: optuna.Study, engine) -> str:
    scenario = Scenario.model_validate(study.user_attrs["scenario"])
    best = best_trial(study, scenario)
    front = feasible_front(study)
    figures = [
        curves_figure(front, scenario),
        progress_figure(study, scenario),
        screen_figure(study, scenario),
        *optuna_figures(study, scenario),
    ]
    plots = "".join(_plot(f) for f in figures if f is not None)
    trials = study.get_trials(deepcopy=False)
    started = [t.datetime_start for t in trials if t.datetime_start]
    finished = [t.datetime_complete for t in trials if t.datetime_complete]
    span = (
        f"{min(started):%Y-%m-%d %H:%M} to {max(finished):%Y-%m-%d %H:%M}"
        if started and finished
        else "-"
    )
    counts = {
        state.name: sum(t.state == state for t in trials)
        for state in (TrialState.COMPLETE, TrialState.FAIL)
    }
    summary = _table(
        [[study.study_name, len(trials), counts["COMPLETE"], counts["FAIL"], len(front), span]],
        ["study", "trials", "measured", "failed or could not run", "front", "ran"],
    )
    scenario_yaml = yaml.safe_dump(scenario.model_dump(mode="json"), sort_keys=False)
    ladder_head, ladder = ladder_rows(study)
    # The answer first: what to deploy, what it sustains and costs in quality, the trade-off.
    parts = [
        _section(
            "Answer",
            _answer(study, best, scenario)
            + _edges(study, best)
            + "<h3>Quality ladder: what each step down in accuracy "
            "buys</h3>"
            + _table(ladder, ladder_head)
            + _plot(pareto_figure(study, scenario, front, best)),
        ),
        _section("Trials", plots),
        _section("Study", summary + f"<pre>{html.escape(scenario_yaml)}</pre>"),
    ]
    if best is not None:
        exported = build_export(
            study.study_name,
            best.number,
            scenario.name,
            scenario.sla.model_dump(),
            study.user_attrs["identity"],
            trial_knobs(study, best),
            dict(best.user_attrs),
            scenario.load.peak_rate,
            workload=scenario.workload,
        )
        shown = {k: v for k, v in exported.model_dump().items() if k != "metrics"}
        parts.append(
            _section(
                f"Exported config: trial {best.number}",
                f"<pre>{html.escape(yaml.safe_dump(shown, sort_keys=False))}</pre>",
            )
        )
    nights = night.nights(engine, study.study_name)
    if nights:
        rows = [
            [
                f"{n.started_at:%Y-%m-%d %H:%M}",
                n.decision,
                _mean(n.incumbent, "output_tokens_per_s_mean"),
                _mean(n.candidate, "output_tokens_per_s_mean"),
                _mean(n.incumbent, "ttft_p99_ms_mean"),
                n.reason,
            ]
            for n in nights
        ]
        parts.append(
            _section(
                "Nightly re-tuning",
                _table(
                    rows,
                    [
                        "night",
                        "decision",
                        "deployed tok/s",
                        "candidate tok/s",
                        "deployed TTFT p99 ms",
                        "reason",
                    ],
                ),
            )
        )
    style = (
        "body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px}"
        "pre{background:#f6f6f6;padding:1em;overflow:auto}"
    )
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>autotune report: {html.escape(study.study_name)}</title><style>{style}</style>"
        f"<script>{get_plotlyjs()}</script></head>"
        f"<body><h1>autotune report</h1>{''.join(parts)}</body></html>"
    )


def _mean(record: dict | None, key: str) -> str:
    value = (record or {}).get(key)
    return "-" if value is None else f"{value:.0f}"


def write_report(study: optuna.Study, engine, path: Path) -> Path:
    """Write the HTML report and its Pareto PNG (same name, .png); returns the PNG's path."""
    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        raise InputError(f"--study {study.study_name}: no completed trial to report on yet")
    scenario = Scenario.model_validate(study.user_attrs["scenario"])
    png = path.with_suffix(".png")
    write_atomic(path, build_html(study, engine))
    write_pareto_png(study, scenario, png)
    return png
