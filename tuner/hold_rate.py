"""One config held at one rate (tuner.hold): its judged window on each arrival draw, run in
rounds over worker processes on the simulator, and the record of the rate's worst draw. A rate
holds where every draw meets the whole SLA (its window settled, its first half meeting too) and
the draws' spread does not put a fresh draw's p99 past a bound."""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from objectives.scenario import Scenario
from objectives.scoring import constraint_values
from runners.base import Runner, Session
from runners.load.capacity import step_at
from runners.load.measurement import first_part, summarize
from runners.load.steady_state import percentiles_met


@dataclass(frozen=True)
class HoldPlan:
    factor: int  # each window's requests, in the scenario's num_requests
    draws: int  # arrival draws, each of which the rate has to meet
    extension_cap: int = 2  # an unsettled window doubles up to this many times its start


# The simulator's draws run in rounds of this many over the worker processes: every draw of a
# round runs, and no round after one with a miss (tuner.hold's SIM_HOLD says why twelve).
SIM_ROUND = 6
# A rate every draw met still misses when the draws' spread puts a fresh draw's p99 past the
# bound: their log-mean plus this many log standard deviations, about one fresh draw in 40
# beyond it if the p99 spreads log-normally over draws. At its knee a config's p99 spreads
# wide (code-generation at 10.37 req/s: 839-2,175 ms over 12 draws), one grid step below it
# narrow (531-682).
PREDICTION_SIGMAS = 2.0
# The figures a hold keeps of each rate it tried: the worst over its draws.
WORST_HIGH = ("ttft_p99_ms", "tpot_p99_ms")
WORST_LOW = ("delivered_share", "served_rps", "output_tokens_per_s")


def _drawn(scenario: Scenario, draw: int) -> Scenario:
    """The scenario with its `draw`-th arrival draw (0: the search's own requests)."""
    if draw == 0:
        return scenario
    return scenario.model_copy(update={"workload": scenario.at_rate(scenario.nominal_rate, draw)})


def _draw(session: Session, scenario: Scenario, rate: float, plan: HoldPlan, draw: int) -> dict:
    """One rate on one arrival draw: the record of its judged window."""
    step = step_at(
        session,
        _drawn(scenario, draw),
        rate,
        scenario.load.early_rejection,
        factor=plan.factor,
        extension_cap=plan.extension_cap,
    )
    row = {key: step.metrics.get(key) for key in WORST_HIGH + WORST_LOW}
    row |= {"draw": draw, "requests": step.measurement.sent, "meets": step.meets_sla}
    row |= {"windows": step.windows, "settled": step.unsettled is None}
    fault = step.measurement.fault
    if not step.meets_sla:
        stopped = None if fault is None else f"{fault.kind}: {fault.message}"[:200]
        if fault is not None and fault.kind == "sla-violated":  # the load generator's rejection
            stopped = "TTFT p99 certainly past the bound, stopped early"
        row["missed"] = step.unsettled or stopped or _violated(step.metrics, scenario)
    if step.meets_sla and scenario.workload.burst is None:
        # The horizon half as long has to agree: near saturation one queue excursion can be
        # 1% of a window but not of one twice as long. Judged on its percentiles: the
        # delivered share of a part is not the load's.
        half = first_part(step.measurement, step.measurement.sent // 2)
        metrics = summarize(half, scenario.sla)
        row["half_ttft_p99_ms"] = metrics.get("ttft_p99_ms")
        row["meets"] = percentiles_met(metrics, scenario.sla)
        if not row["meets"]:
            row["missed"] = f"its first half: {_violated(metrics, scenario)}"
    if fault is not None:
        row["fault"] = f"{fault.kind}: {fault.message}"[:300]
    return row


def _violated(metrics: dict[str, Any], scenario: Scenario) -> str:
    """The SLOs a window's figures break, as figures (the draws' lines on the console)."""
    if metrics.get("ttft_p99_ms") is None:
        return "no first token measured"
    shown = {
        "ttft_p99": f"TTFT p99 {metrics['ttft_p99_ms']:.0f} ms",
        "tpot_p99": f"TPOT p99 {metrics.get('tpot_p99_ms') or 0:.0f} ms",
        "success_rate": f"{metrics.get('success_rate', 0):.1%} succeeded",
        "sustained": f"{metrics.get('delivered_share') or 0:.1%} of the rate delivered",
    }
    broken = [
        shown.get(name, name)
        for name, value in constraint_values(metrics, scenario.sla).items()
        if value > 0
    ]
    return ", ".join(broken) or "stopped early"


def _simulated_draw(
    runner: Runner, config: dict, scenario: Scenario, rate: float, plan: HoldPlan, draw: int
) -> dict:
    """_draw in a worker process, on an engine of its own (a simulated one costs nothing to
    start)."""
    with runner.session(config, scenario.workload) as session:
        return _draw(session, scenario, rate, plan, draw)


class Draws:
    """A rate's draws for one config: in this process on its one session, one after another
    until one misses (a real engine); or, on the simulator, in rounds of SIM_ROUND spread over
    worker processes, every draw of a round run and no round after one with a miss. Each
    draw's requests are fixed by its seed, so which worker ran it changes nothing, and one
    process runs the same rounds."""

    def __init__(self, session: Session, runner: Runner, config: dict, pool: Executor | None):
        self.session, self.runner, self.config, self.pool = session, runner, config, pool

    def run(self, scenario: Scenario, rate: float, plan: HoldPlan) -> list[dict]:
        if self.runner.name != "sim":
            rows: list[dict[str, Any]] = []
            for draw in range(plan.draws):
                rows.append(_draw(self.session, scenario, rate, plan, draw))
                if not rows[-1]["meets"]:  # minutes a draw: no more once one misses
                    break
            return rows
        rows = []
        for start in range(0, plan.draws, SIM_ROUND):
            draws = range(start, min(start + SIM_ROUND, plan.draws))
            if self.pool is not None:
                work = partial(_simulated_draw, self.runner, self.config, scenario, rate, plan)
                rows += self.pool.map(work, draws)
            else:
                rows += [_draw(self.session, scenario, rate, plan, draw) for draw in draws]
            if not all(row["meets"] for row in rows):
                break
        return rows


def fresh_draw_p99(samples: list[float]) -> float | None:
    """The p99 a fresh arrival draw may read, from the draws' own: their log-mean plus
    PREDICTION_SIGMAS of their log spread (None: fewer than three)."""
    logs = np.log([value for value in samples if value is not None and value > 0])
    if logs.size < 3:
        return None
    return float(np.exp(logs.mean() + PREDICTION_SIGMAS * logs.std(ddof=1)))


def _predicted_miss(draws: list[dict], scenario: Scenario) -> str | None:
    """Why a fresh draw would likely miss a percentile bound the draws all met (None: it
    would not, or too few draws to say). The TTFT samples are every window and its first
    half (the 32x horizon of a 64x hold)."""
    sla = scenario.sla
    ttft = [row["ttft_p99_ms"] for row in draws] + [row.get("half_ttft_p99_ms") for row in draws]
    bounds = [
        ("TTFT", ttft, sla.ttft_p99_ms),
        ("TPOT", [r["tpot_p99_ms"] for r in draws], sla.tpot_p99_ms),
    ]
    for name, samples, bound in bounds:
        predicted = fresh_draw_p99(samples)
        if bound is not None and predicted is not None and predicted > bound:
            return (
                f"{name} p99 on a fresh draw predicted {predicted:.0f} ms (the draws' "
                f"{min(s for s in samples if s):.0f}-{max(s for s in samples if s):.0f} ms) "
                f"against {bound:g}"
            )
    return None


def hold_rate(draws_of: Draws, scenario: Scenario, rate: float, plan: HoldPlan) -> dict:
    """One rate on each draw: its record, the worst draw's figures. Meeting it on every draw
    is not enough where their spread says a fresh one would miss (a rate at the knee)."""
    draws = draws_of.run(scenario, rate, plan)
    load: dict[str, Any] = {"rate": rate, "meets": all(row["meets"] for row in draws)}
    if load["meets"]:
        why = _predicted_miss(draws, scenario)
        if why is not None:
            load |= {"meets": False, "predicted_miss": why}
    load["requests"] = min(row["requests"] for row in draws)
    for key in WORST_HIGH:
        values = [row[key] for row in draws if row[key] is not None]
        load[key] = max(values) if values else None
    for key in WORST_LOW:
        values = [row[key] for row in draws if row[key] is not None]
        load[key] = min(values) if values else None
    failed = next((row["fault"] for row in draws if "fault" in row), None)
    if failed is not None and not failed.startswith("sla-violated"):
        load["fault"] = failed
    return load | {"draws": draws}
