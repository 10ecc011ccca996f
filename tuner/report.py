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
from objectives.scoring import pick_best, throughput_label
from objectives.userfile import InputError
from search_spaces.deployment import deployment_label
from search_spaces.knobs import DEPLOYMENTS
from tuner import nightly as night
from tuner.answer import Answer, answer
from tuner.arms import arm_pick, in_arm, trials_to_compare
from tuner.export import answer_export
from tuner.hold import describe_hold
from tuner.ladder import ladder_rows
from tuner.misses import closest_miss
from tuner.outputs import write_atomic
from tuner.quality import describe_figures
from tuner.repeats import describe_repeats
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


def _answer(study: optuna.Study, stated: Answer | None, scenario: Scenario) -> str:
    """The recommended config in one table: its knobs, capacity and quality, and their sources
    (the figures tuner.answer states, as the console and the export do)."""
    if stated is None:
        closest = closest_miss(study, [])
        return (
            "<p>No trial met the SLA"
            + (" and the quality SLO" if scenario.quality else "")
            + ": nothing was exported.</p>"
            + (f"<p>{html.escape(closest)}</p>" if closest else "")
        )
    best = stated.trial
    attrs = best.user_attrs
    knobs = attrs.get("knobs", best.params)
    slo = scenario.quality.describe() if scenario.quality else ""
    load = f"{scenario.nominal_rate:g} {'in flight' if scenario.closed_loop else 'req/s'}"
    label = deployment_label(knobs)
    chips = study.user_attrs.get("identity", {}).get("chips")
    rows = [
        [
            "knobs",
            f"trial {best.number}: "
            + ", ".join(f"{k} {knobs[k]}" for k in KNOB_COLUMNS if k in knobs),
        ],
        *([["deployment", f"{label} on {chips} chips (figures per chip)"]] if label else []),
        ["answer", stated.describe(chips=bool(chips))],
        ["TTFT p99", f"{best.values[0]:.0f} ms at {load} (SLA {scenario.sla.ttft_p99_ms:g} ms)"],
        [
            "quality",
            describe_figures(attrs) + (f" (SLO: {slo})" if slo else ""),
        ],
        ["quality source", attrs.get("quality_note", "-")],
    ]
    if stated.repeats_record is not None:
        rows.append(["repeats", describe_repeats(stated.repeats_record)])
    if stated.hold_record is not None:
        rows.append(["hold", describe_hold(stated.hold_record, scenario)])
    return _table(rows, ["", "the recommended config"])


def _section(title: str, body: str) -> str:
    return f"<section><h2>{html.escape(title)}</h2>{body}</section>"


def _table(rows: list[list[Any]], head: list[str]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{cells}</tr>{body}</table>"


def best_by_deployment(
    study: optuna.Study, scenario: Scenario
) -> dict[str, FrozenTrial | None] | None:
    """The best SLA-feasible trial of each deployment (the scenario's pick rule applied within
    that deployment's feasible trials; None where none is feasible), or None unless the study
    searched both deployments (a chip budget of 2 or more)."""
    searched = {trial_knobs(study, t).get("deployment") for t in study.get_trials(deepcopy=False)}
    if not set(DEPLOYMENTS) <= searched:
        return None
    return {name: arm_pick(study, scenario, {"deployment": name}) for name in DEPLOYMENTS}


def _who(study: optuna.Study, t: FrozenTrial) -> str:
    knobs = trial_knobs(study, t)
    split = deployment_label(knobs)
    name = str(knobs.get("deployment"))
    return f"{name}{f' {split}' if split != name else ''} (trial {t.number})"


def _change(value: float, other: float) -> str:
    if not other:
        return "-"
    change = (value / other - 1) * 100
    return f"{change:+.1f}%" if abs(change) < 10 else f"{change:+.0f}%"


def deployment_comparison(study: optuna.Study, scenario: Scenario) -> str | None:
    """One line: which deployment's best config wins on the scenario's pick rule, per chip, and
    by how much; None unless both deployments have an SLA-feasible trial."""
    best = best_by_deployment(study, scenario)
    if best is None:
        return None
    # pruned trials searched a deployment too (tuner.pruning)
    measured = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    searched = {
        name: sum(1 for t in measured if in_arm(study, t, {"deployment": name}))
        for name in DEPLOYMENTS
    }
    needed = trials_to_compare(study, ("deployment",))
    thin = {name: n for name, n in searched.items() if n < needed}
    if thin:
        chips = study.user_attrs.get("identity", {}).get("chips", "?")
        return (
            f"On {chips} chips, co-located and disaggregated: not compared ("
            + ", ".join(f"{name} {n} trial{'s' if n != 1 else ''}" for name, n in thin.items())
            + f"; each needs {needed})"
        )
    contenders = [(name, t) for name, t in best.items() if t is not None]
    if len(contenders) < 2:
        return None
    won = pick_best(
        [(name, t.values[0], t.values[1]) for name, t in contenders],
        scenario.pick,
        scenario.tie_tolerance,
    )
    (_, w), (_, lost) = sorted(contenders, key=lambda c: c[0] != won)
    throughput = (
        "throughput",
        f"{w.values[1]:.0f} vs {lost.values[1]:.0f} {throughput_label(scenario)} per chip "
        f"({_change(w.values[1], lost.values[1])})",
    )
    ttft = (
        "TTFT p99",
        f"TTFT p99 {w.values[0]:.0f} vs {lost.values[0]:.0f} ms "
        f"({_change(w.values[0], lost.values[0])})",
    )
    if scenario.pick == "min-ttft":
        first, then, ahead = ttft, throughput, w.values[0] <= lost.values[0]
    else:
        first, then, ahead = throughput, ttft, w.values[1] >= lost.values[1]
    chips = study.user_attrs["identity"].get("chips", "?")
    verdict = (
        f"{first[1]}; {then[1]}"
        if ahead
        else f"{first[1]}, tied within the tie tolerance of {scenario.tie_tolerance:.0%}, so "
        f"{then[0]} decides: {then[1]}"
    )
    return (
        f"On {chips} chips, {_who(study, w)} beats {_who(study, lost)} per chip "
        f"({scenario.pick}): {verdict}"
    )


def _figure(value: Any, digits: str = ".0f") -> str:
    return "-" if value is None else f"{value:{digits}}"


def _deployments(study: optuna.Study, scenario: Scenario, stated: Answer | None) -> str:
    """The section comparing the best co-located and disaggregated configs, when the study
    searched both; the exported one's capacity is the answer's (`stated`), marked held."""
    best = best_by_deployment(study, scenario)
    if best is None:
        return ""
    chips = study.user_attrs["identity"].get("chips", "?")
    capacity = scenario.load.mode == "capacity"
    rate = f"@{scenario.nominal_rate:g}"
    head = [
        "deployment",
        "trial",
        "split",
        f"TTFT p50 ms {rate}",
        f"TTFT p99 ms {rate}",
        "TPOT p50 ms",
        "TPOT p99 ms",
        ("capacity req/s" if capacity else "req/s") + " per chip",
        f"{throughput_label(scenario)} per chip",
    ]
    rows: list[list[Any]] = []
    for name, t in best.items():
        if t is None:
            rows.append([name, "-", "no trial met the SLA", *["-"] * 6])
            continue
        attrs, throughput, held = t.user_attrs, t.values[1], ""
        if stated is not None and stated.trial.number == t.number:
            attrs, throughput, held = stated.metrics, stated.throughput, " (the answer)"
        split = deployment_label(trial_knobs(study, t))
        rows.append(
            [
                name,
                t.number,
                f"{chips} replicas" if split == "co-located" else split,
                _figure(attrs.get("ttft_p50_ms")),
                _figure(t.values[0]),
                _figure(attrs.get("tpot_p50_ms"), ".1f"),
                _figure(attrs.get("tpot_p99_ms"), ".1f"),
                _figure(attrs.get("capacity_rps" if capacity else "requests_per_s"), ".3g"),
                _figure(throughput) + held,
            ]
        )
    line = deployment_comparison(study, scenario)
    return _section(
        f"Co-located vs disaggregated on {chips} chips",
        _table(rows, head)
        + f"<p>{html.escape(line or 'Only one deployment met the SLA: nothing to compare.')}</p>"
        + "<p>The verdict compares both as the search measured them (the same window rule for "
        "each); the answer's row states what its hold held.</p>",
    )


def _edges(study: optuna.Study, best: FrozenTrial | None) -> str:
    """Where the best config sat on an end of the ranges a run searched (tuner.cli_run), while
    it is still the best."""
    edges = study.user_attrs.get(RANGE_EDGES, {})
    if best is None or not isinstance(edges, dict) or edges.get("trial") != best.number:
        return ""
    items = "".join(f"<li>The best {html.escape(message)}</li>" for message in edges["messages"])
    return f"<ul class='edges'>{items}</ul>" if items else ""


def build_html(study: optuna.Study, engine, stated: Answer | None = None) -> str:
    """The report; `stated`: the run's answer (None: the study's best, as the study keeps its
    hold and repeats)."""
    scenario = Scenario.model_validate(study.user_attrs["scenario"])
    if stated is None:
        best = best_trial(study, scenario)
        stated = None if best is None else answer(study, best)
    best = None if stated is None else stated.trial
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
        for state in (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)
    }
    summary = _table(
        [
            [
                *(study.study_name, len(trials), counts["COMPLETE"], counts["PRUNED"]),
                *(counts["FAIL"], len(front), span),
            ]
        ],
        ["study", "trials", "measured", "pruned", "failed or could not run", "front", "ran"],
    )
    scenario_yaml = yaml.safe_dump(scenario.model_dump(mode="json"), sort_keys=False)
    ladder_head, ladder = ladder_rows(study)
    # The answer first: what to deploy, what it sustains and costs in quality, the trade-off.
    parts = [
        _section(
            "Answer",
            _answer(study, stated, scenario)
            + _edges(study, best)
            + "<h3>Quality ladder: what each step down in accuracy "
            "buys</h3>"
            + _table(ladder, ladder_head)
            + _plot(pareto_figure(study, scenario, front, best)),
        ),
        _deployments(study, scenario, stated),
        _section("Trials", plots),
        _section("Study", summary + f"<pre>{html.escape(scenario_yaml)}</pre>"),
    ]
    if stated is not None:
        exported = answer_export(study, stated)
        shown = {k: v for k, v in exported.document().items() if k != "metrics"}
        parts.append(
            _section(
                f"Exported config: trial {stated.trial.number}",
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


def write_report(study: optuna.Study, engine, path: Path, stated: Answer | None = None) -> Path:
    """Write the HTML report and its Pareto PNG (same name, .png); returns the PNG's path."""
    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        raise InputError(f"--study {study.study_name}: no completed trial to report on yet")
    scenario = Scenario.model_validate(study.user_attrs["scenario"])
    png = path.with_suffix(".png")
    write_atomic(path, build_html(study, engine, stated))
    write_pareto_png(study, scenario, png)
    return png
