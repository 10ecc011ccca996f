"""The report's plots: the interactive ones of the HTML file (plotly), and the Pareto plot as a
PNG beside it (Optuna's matplotlib plot)."""

from __future__ import annotations

import html
import math
import warnings
from pathlib import Path

import optuna
import plotly.graph_objects as go
from optuna.trial import FrozenTrial, TrialState

from objectives.scenario import Scenario
from objectives.scoring import QUALITY_PREFIX, is_feasible, throughput_label
from search_spaces.deployment import deployment_label
from tuner.quality import describe_figures

KNOB_COLUMNS = (
    "batch_size",
    "select_batch",
    "max_prefill_tokens",
    "quantization",
    "kv_compression",
)


def _sla_misses(t: FrozenTrial) -> str:
    named = t.user_attrs.get("sla_constraints", t.constraints)
    latency = [
        f"{k} +{v:.0%}" for k, v in named.items() if v > 0 and not str(k).startswith(QUALITY_PREFIX)
    ]
    # Quality constraints are in the figure's own units (points, nats, share), not relative.
    quality = [
        f"{str(k).removeprefix(QUALITY_PREFIX)} {v:+.3g} past its bound"
        for k, v in named.items()
        if v > 0 and str(k).startswith(QUALITY_PREFIX)
    ]
    return "; ".join(
        [
            *(["misses the SLA: " + ", ".join(latency)] if latency else []),
            *(["misses the quality SLO: " + ", ".join(quality)] if quality else []),
        ]
    )


def _drawable(x: float | None, y: float | None, log_x: bool = False, log_y: bool = False) -> bool:
    """A point the plot can hold: finite, and positive on a log axis (one infinite or zero value
    stretched a real study's log axis to 1e198)."""

    def fits(v: float | None, log: bool) -> bool:
        return v is not None and math.isfinite(v) and (v > 0 or not log)

    return fits(x, log_x) and fits(y, log_y)


def _sla_line(fig: go.Figure, ttft_ms: float, vertical: bool) -> None:
    """The TTFT SLA as a dashed line across a log axis, labelled. Plotly places a shape on a log
    axis by its value but an annotation by the value's log10: add_vline's own label put an SLA
    of 200 ms at 1e200 and stretched a real study's axis to 1e198."""
    if vertical:
        fig.add_vline(x=ttft_ms, line_dash="dash")
        fig.add_annotation(
            x=math.log10(ttft_ms), y=1, yref="paper", text="SLA", showarrow=False, yanchor="bottom"
        )
    else:
        fig.add_hline(y=ttft_ms, line_dash="dash")
        fig.add_annotation(
            x=1,
            xref="paper",
            y=math.log10(ttft_ms),
            text="SLA",
            showarrow=False,
            xanchor="right",
            yanchor="bottom",
        )


def _log_range(values: list[float]) -> list[float] | None:
    """The log axis' range in plotly's units (log10), a little wider than the drawn values."""
    values = [v for v in values if _drawable(v, 1.0, log_x=True)]
    if not values:
        return None
    return [math.log10(min(values)) - 0.1, math.log10(max(values)) + 0.1]


def per_chip(study: optuna.Study) -> str:
    """The throughput label's suffix: per chip for a study on a chip budget."""
    return " per chip" if "chips" in study.user_attrs.get("identity", {}) else ""


def _hover(t: FrozenTrial) -> str:
    knobs = t.user_attrs.get("knobs", t.params)
    lines = [f"trial {t.number}"] + [f"{k}: {knobs[k]}" for k in KNOB_COLUMNS if k in knobs]
    if deployment_label(knobs) is not None:
        lines.insert(1, f"deployment: {deployment_label(knobs)}")
    if not is_feasible(t.constraints):
        lines.append(_sla_misses(t))
    if t.user_attrs.get("capacity_note"):
        lines.append(t.user_attrs["capacity_note"])
    lines.append(f"quality: {describe_figures(t.user_attrs)}")
    return "<br>".join(html.escape(str(line)) for line in lines)


def pareto_figure(
    study: optuna.Study, scenario: Scenario, front: list[FrozenTrial], best: FrozenTrial | None
) -> go.Figure:
    every = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    done = [t for t in every if _drawable(t.values[0], t.values[1], log_x=True)]
    drawn = {t.number for t in done}
    front = [t for t in front if t.number in drawn]
    best = best if best is not None and best.number in drawn else None
    fig = go.Figure()
    for feasible, name, marker in (
        (False, "misses the SLA", dict(color="#bbbbbb", symbol="x")),
        (True, "meets the SLA", dict(color="#1f77b4")),
    ):
        group = [t for t in done if is_feasible(t.constraints) == feasible]
        fig.add_trace(
            go.Scatter(
                x=[t.values[0] for t in group],
                y=[t.values[1] for t in group],
                mode="markers",
                name=name,
                marker=marker,
                text=[_hover(t) for t in group],
                hoverinfo="text",
            )
        )
    fig.add_trace(
        go.Scatter(
            x=[t.values[0] for t in front],
            y=[t.values[1] for t in front],
            mode="lines+markers",
            name="Pareto front",
            line=dict(shape="hv", color="#2ca02c"),
        )
    )
    if best is not None:
        fig.add_trace(
            go.Scatter(
                x=[best.values[0]],
                y=[best.values[1]],
                mode="markers",
                name=f"exported (trial {best.number})",
                marker=dict(size=16, symbol="star", color="#d62728"),
                text=[_hover(best)],
                hoverinfo="text",
            )
        )
    _sla_line(fig, scenario.sla.ttft_p99_ms, vertical=True)
    left_out = (
        f" ({len(every) - len(done)} not drawn: TTFT p99 infinite or zero)"
        if len(done) < len(every)
        else ""
    )
    fig.update_layout(
        title=f"TTFT p99 against throughput, every measured trial{left_out}",
        xaxis_title=f"TTFT p99 (ms) at {scenario.nominal_rate:g} "
        f"{'in flight' if scenario.closed_loop else 'req/s'}",
        yaxis_title=throughput_label(scenario) + per_chip(study),
        xaxis_type="log",
        xaxis_range=_log_range([t.values[0] for t in done] + [scenario.sla.ttft_p99_ms]),
    )
    return fig


def curves_figure(front: list[FrozenTrial], scenario: Scenario) -> go.Figure | None:
    with_steps = [t for t in front if t.user_attrs.get("capacity_steps")]
    if not with_steps:
        return None
    fig = go.Figure()
    drawn = [scenario.sla.ttft_p99_ms]
    for t in with_steps:
        # Steps stopped early carry partial figures: the curve uses the loads measured whole.
        steps = sorted(
            (
                s
                for s in t.user_attrs["capacity_steps"]
                if "fault" not in s
                and _drawable(s.get("output_tokens_per_s"), s.get("ttft_p99_ms"), log_y=True)
            ),
            key=lambda s: s["rate"],
        )
        drawn += [s["ttft_p99_ms"] for s in steps]
        fig.add_trace(
            go.Scatter(
                x=[s["output_tokens_per_s"] for s in steps],
                y=[s["ttft_p99_ms"] for s in steps],
                mode="lines+markers",
                name=f"trial {t.number}",
                text=[
                    f"rate {s['rate']:g}, {'meets' if s['meets_sla'] else 'misses'} the SLA"
                    for s in steps
                ],
                hoverinfo="text+x+y",
            )
        )
    _sla_line(fig, scenario.sla.ttft_p99_ms, vertical=False)
    fig.update_layout(
        title="Latency against throughput as the load rises (the front's configs)",
        xaxis_title="output tok/s measured",
        yaxis_title="TTFT p99 (ms)",
        yaxis_type="log",
        yaxis_range=_log_range(drawn),
    )
    return fig


def _screen_outcome(t: FrozenTrial) -> str:
    if t.state != TrialState.COMPLETE:
        return "failed"
    return "meets" if is_feasible(t.constraints) else "misses"


# Per outcome of a screened pick: legend and marker. A pick that failed measured nothing: it is
# drawn at 0 so that it stays in sight, its cause on hover.
SCREEN_OUTCOMES = {
    "meets": ("meets the SLA", dict(color="#1f77b4")),
    "misses": ("misses the SLA", dict(color="#ff7f0e", symbol="x")),
    "failed": (
        "failed or could not run (measured nothing: drawn at 0)",
        dict(color="#d62728", symbol="x-thin-open", size=10),
    ),
}


def _screen_text(t: FrozenTrial, outcome: str) -> str:
    screen = t.user_attrs["screen"]
    text = (
        f"trial {t.number} (round {screen['round']}): "
        f"TTFT p99 predicted {screen['predicted_ttft_p99_ms']:.0f} ms"
    )
    if outcome == "failed":
        return f"{text}; failed: {t.user_attrs.get('fault', t.state.name)}"
    text += f", measured {t.values[0]:.0f} ms"
    return f"{text}; {_sla_misses(t)}" if outcome == "misses" else text


def screen_figure(study: optuna.Study, scenario: Scenario) -> go.Figure | None:
    """How well the simulator's picks (`--screen sim`) held up when measured for real: every
    pick, those that missed the SLA and those that failed marked apart (a chart of the
    successes alone would flatter the simulator)."""
    screened = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
        if "screen" in t.user_attrs
    ]
    if not screened:
        return None
    fig = go.Figure()
    top = 0.0
    for outcome, (name, marker) in SCREEN_OUTCOMES.items():
        group = [t for t in screened if _screen_outcome(t) == outcome]
        if not group:
            continue
        predicted = [t.user_attrs["screen"]["predicted_throughput"] for t in group]
        measured = [t.values[1] if outcome != "failed" else 0.0 for t in group]
        top = max([top, *predicted, *measured])
        fig.add_trace(
            go.Scatter(
                x=predicted,
                y=measured,
                mode="markers",
                name=name,
                marker=marker,
                text=[html.escape(_screen_text(t, outcome)) for t in group],
                hoverinfo="text+x+y",
            )
        )
    fig.add_trace(
        go.Scatter(
            x=[0, top], y=[0, top], mode="lines", line_dash="dot", name="prediction = measurement"
        )
    )
    counts = {
        outcome: sum(_screen_outcome(t) == outcome for t in screened) for outcome in SCREEN_OUTCOMES
    }
    fig.update_layout(
        title=f"The simulator's predictions against the real trials it picked (--screen sim): "
        f"{len(screened)} picks, {counts['meets']} met the SLA, {counts['misses']} missed it, "
        f"{counts['failed']} failed",
        xaxis_title=f"predicted {throughput_label(scenario)}",
        yaxis_title=f"measured {throughput_label(scenario)}",
    )
    return fig


def progress_figure(study: optuna.Study, scenario: Scenario) -> go.Figure:
    numbers, best, so_far = [], [], None
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if is_feasible(t.constraints):
            so_far = t.values[1] if so_far is None else max(so_far, t.values[1])
        numbers.append(t.number)
        best.append(so_far)
    fig = go.Figure(go.Scatter(x=numbers, y=best, mode="lines", line=dict(shape="hv")))
    fig.update_layout(
        title="Best SLA-feasible throughput over trials",
        xaxis_title="trial",
        yaxis_title=throughput_label(scenario) + per_chip(study),
    )
    return fig


def optuna_figures(study: optuna.Study, scenario: Scenario) -> list[go.Figure]:
    """Knob importance and parallel coordinates on the throughput objective (Optuna's own plots)."""

    def throughput(t: FrozenTrial) -> float:
        return t.values[1]

    label = throughput_label(scenario)
    plots = (
        # Optuna's default evaluator (PED-ANOVA) ranks knobs by how they reach low target values:
        # high throughput is a low negative throughput.
        lambda: optuna.visualization.plot_param_importances(
            study,
            target=lambda t: -throughput(t),
            target_name=f"{label} (what reaches the highest)",
        ),
        lambda: optuna.visualization.plot_parallel_coordinate(
            study, target=throughput, target_name=label
        ),
    )
    figures = []
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # "no feasible trial" is the report's to say
    try:
        for plot in plots:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    figures.append(plot())
            except (ValueError, RuntimeError):  # too few trials, or no knob that varied
                continue
    finally:
        optuna.logging.set_verbosity(verbosity)
    return figures


def write_pareto_png(study: optuna.Study, scenario: Scenario, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: a file
    from optuna.visualization.matplotlib import plot_pareto_front

    ax = plot_pareto_front(study, target_names=["TTFT p99 ms", throughput_label(scenario)])
    ax.axvline(scenario.sla.ttft_p99_ms, linestyle="--", color="gray")
    ax.set_xscale("log")  # trials that miss the SLA can be orders of magnitude slower
    shown = _log_range(
        [t.values[0] for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
        + [scenario.sla.ttft_p99_ms]
    )
    assert shown is not None, "the SLA's TTFT is finite and positive: drawable"
    # An infinite or zero TTFT must not stretch the axis.
    ax.set_xlim(10 ** shown[0], 10 ** shown[1])
    figure = ax.get_figure(root=True)
    assert figure is not None, "plot_pareto_front draws its axes on a figure"
    figure.set_size_inches(8, 5)
    tmp = path.with_name(f".{path.name}.tmp.png")
    figure.savefig(tmp, dpi=100, bbox_inches="tight")
    tmp.replace(path)
