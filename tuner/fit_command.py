"""`autotune scenario fit`: a parametric scenario fitted to a trace (objectives.trace_fit),
written as YAML, and checked on the simulator: one config's capacity on the fitted scenario
beside its capacity on the trace itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import yaml
from pydantic import ValidationError

from objectives.scenario import MIN_RATE, Scenario
from objectives.trace import FORMATS, Trace
from objectives.trace_fit import Fit, fit_window
from objectives.trace_formats import TraceError, read_window
from objectives.userfile import InputError, describe_validation_error
from tuner.console import out
from tuner.outputs import check_writable, write_atomic

# The check's config (the simulator's defaults otherwise): a middle-of-the-road MindIE config.
CHECK_CONFIG: dict[str, Any] = {
    "batch_size": 128,
    "select_batch": "decode-first",
    "quantization": "w8a8",
    "max_prefill_tokens": 16384,
}
AGREE = 0.05  # the fitted scenario's capacity within this of the trace's: the fit carries it


def _columns(pairs: tuple[str, ...]) -> dict[str, str] | None:
    if not pairs:
        return None
    columns = {}
    for pair in pairs:
        field, sep, name = pair.partition("=")
        if not sep or not name:
            raise InputError(f"--column: {pair!r} is not FIELD=NAME (e.g. arrival=ts)")
        columns[field.strip()] = name.strip()
    return columns


def _trace(path: Path, fmt: str, pairs: tuple[str, ...], unit: str, policy: str) -> Trace:
    data: dict[str, Any] = {"file": str(path), "format": fmt, "time_unit": unit}
    data["over_context"] = policy
    columns = _columns(pairs)
    if columns is not None:
        data["columns"] = columns
    try:
        return Trace.model_validate(data)
    except ValidationError as error:
        raise InputError(describe_validation_error("--format/--column", error)) from None


def check_config(scenario: Scenario) -> dict[str, Any]:
    """CHECK_CONFIG, its prefill budget raised to the longest prompt (MindIE starts no prompt
    longer than max_prefill_tokens)."""
    budget = max(int(CHECK_CONFIG["max_prefill_tokens"]), scenario.workload.longest_prompt)
    return CHECK_CONFIG | {"max_prefill_tokens": budget}


def _capacity(scenario: Scenario, config: dict[str, Any]) -> tuple[float | None, str]:
    from runners.load.capacity import evaluate
    from runners.sim.runner import DEFAULTS, SimRunner

    result = evaluate(SimRunner(), DEFAULTS | config, scenario)
    why = result.metrics.get("capacity_note") or (result.fault.message if result.fault else "")
    return result.metrics.get("capacity_rate"), why


def _print_fit(fit: Fit) -> None:
    w = fit.workload
    for field in ("input_tokens", "output_tokens"):
        d = w[field]
        shape = (
            f"lognormal median {d['median']:.0f}, sigma {d['sigma']:.2f}, {d['min']}..{d['max']}"
            if d["kind"] == "lognormal"
            else f"fixed {d['value']}"
        )
        out.print(f"{field}: {shape}; KS distance {fit.goodness[field]:.3f}", markup=False)
    a, f = w["arrival"], fit.figures
    kind = a["kind"] + (f", burstiness {a['burstiness']:.2f}" if a["kind"] == "gamma" else "")
    out.print(f"arrival: {kind} at {a['rate']:.4g} req/s (gaps' CV {f['gaps_cv']:.2f})")
    if "shared_prefix" in w:
        p = w["shared_prefix"]
        out.print(
            f"shared_prefix: {p['tokens']} tokens on {p['share']:.1%} of prompts, "
            f"{p['prompts']} texts",
            markup=False,
        )


@click.group("scenario")
def scenario_group() -> None:
    """Scenarios from your own traffic."""


@scenario_group.command("fit")
@click.argument("trace_path", metavar="TRACE", type=click.Path(path_type=Path))
@click.option("--format", "fmt", required=True, type=click.Choice(FORMATS), help="the trace's")
@click.option(
    "--column", "columns", multiple=True, help="csv/jsonl: FIELD=NAME (arrival, input_tokens, "
    "output_tokens, session, blocks), once per field"
)  # fmt: skip
@click.option("--time-unit", type=click.Choice(["s", "ms", "us"]), default="s", show_default=True)
@click.option(
    "--over-context", type=click.Choice(["refuse", "clip", "drop"]), default="refuse",
    show_default=True, help="requests longer than Qwen2-7B's context",
)  # fmt: skip
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True)
@click.option("--name", default=None, help="the scenario's name (default: the trace's stem)")
@click.option("--ttft-p99-ms", type=click.FloatRange(min=0, min_open=True), required=True)
@click.option("--tpot-p99-ms", type=click.FloatRange(min=0, min_open=True), default=None)
@click.option("--check/--no-check", default=True, help="capacities side by side on the simulator")
def fit_cmd(
    trace_path, fmt, columns, time_unit, over_context, output, name, ttft_p99_ms, tpot_p99_ms, check
):
    """Fit a parametric scenario to TRACE (the whole file) and write it to --output."""
    from runners.sim.runner import SimRunner

    check_writable(output, "--output")
    trace = _trace(trace_path, fmt, columns, time_unit, over_context)
    limit, model = SimRunner().max_context()
    if limit is not None:
        trace = trace.model_copy(update={"context_tokens": limit})
    try:
        window = read_window(trace)
    except TraceError as error:
        raise InputError(f"{error} ({model})") from None
    shared = None
    if window.shares_prompts:
        from runners.load.trace_replay import window_chains

        chains = window_chains(trace)
        shared = (chains.key, chains.tokens[chains.key] * (chains.key >= 0))
    fit = fit_window(window, shared)
    sla: dict[str, Any] = {"ttft_p99_ms": ttft_p99_ms}
    if tpot_p99_ms is not None:
        sla["tpot_p99_ms"] = tpot_p99_ms
    label = name or trace_path.name.split(".")[0] or "fitted"
    data = {
        "name": f"{label}-fit",
        "description": f"fitted to {trace_path} ({fmt}, {len(window)} requests)",
        "workload": fit.workload,
        "sla": sla,
    }
    try:
        fitted = Scenario.model_validate(data)
    except ValidationError as error:
        raise InputError(describe_validation_error("--name/--ttft-p99-ms", error)) from None
    _print_fit(fit)
    for feature in fit.not_carried:
        out.print(f"not carried: {feature}", markup=False, soft_wrap=True)
    if check:
        replay = Scenario.model_validate(
            {"name": label, "workload": {"trace": trace.model_dump(exclude_none=True)}, "sla": sla}
        )
        # a trace one chip serves a small part of: the check searches down to 1/1024 of it
        floor = {"min_rate": max(MIN_RATE, fitted.nominal_rate / 1024)}
        replay = replay.model_copy(update={"load": replay.load.model_copy(update=floor)})
        fitted_check = fitted.model_copy(update={"load": fitted.load.model_copy(update=floor)})
        config = check_config(replay)
        (on_trace, why_trace), (on_fit, why_fit) = (
            _capacity(replay, config),
            _capacity(fitted_check, config),
        )
        line = f"check ({', '.join(f'{k} {v}' for k, v in config.items())}, simulator): "
        if on_trace is None or on_fit is None:
            shown = [
                why or f"{rate:.4g} req/s"
                for rate, why in ((on_trace, why_trace), (on_fit, why_fit))
            ]
            line += f"no capacity to compare: on the trace {shown[0]}; on the fit {shown[1]}"
            out.print(line, markup=False, soft_wrap=True)
        else:
            gap = on_fit / on_trace - 1
            line += f"capacity {on_trace:.4g} req/s on the trace, {on_fit:.4g} on the fit "
            line += f"({gap:+.1%})"
            if abs(gap) > AGREE:
                line += "; they differ by more than 5%, where the fit does not carry: " + (
                    "; ".join(fit.not_carried) or "nothing named (lengths' shape: see KS)"
                )
            out.print(line, markup=False, soft_wrap=True)
    write_atomic(output, yaml.safe_dump(fitted.model_dump(mode="json", exclude_none=True)))
    out.print(f"scenario: {output}", markup=False)
