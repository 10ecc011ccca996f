"""Before the export: the pick held at the rate it claims, under a fixed load of `factor` times
the scenario's requests, judged on the SLA (the `sustained` SLO included).

A capacity search judges each rate on a window of the scenario's size, extended while it has
not settled; a rate a hair above what the engine sustains can pass it. document-summary's
export claimed 8.35 req/s and delivered 99.7% of it over 4,000 requests; held for 8,000, its
queue grew to a TTFT p99 of 6.3 s against a 3 s bound. So the pick is held for longer before it
is exported, and a claim that does not hold is lowered one step of the search's grid at a time
(at most MAX_STEPS_DOWN) until one holds. The export states the hold; its capacity is the rate
that held.
"""

from __future__ import annotations

import math
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from objectives.scenario import Scenario
from objectives.scoring import constraint_values, is_feasible
from runners.base import Runner
from runners.load.capacity import CLOSED_WINDOW_CYCLES
from runners.load.measurement import summarize
from tuner.study import trial_knobs

HOLD_ATTR = "hold"  # study attribute: the last hold, for the export and the report
SIM_HOLD_FACTOR = 16  # the simulator: 16x the requests is seconds (issue 28's acceptance)
REAL_HOLD_FACTOR = 4  # a real engine: minutes, once per run
MAX_STEPS_DOWN = 4
# The figures a hold keeps of each load it ran.
HELD_METRICS = (
    "ttft_p99_ms",
    "tpot_p99_ms",
    "delivered_share",
    "requests_per_s",
    "output_tokens_per_s",
)


def _load(scenario: Scenario, rate: float, factor: int) -> Scenario:
    requests = scenario.workload.num_requests * factor
    if scenario.closed_loop:  # as a capacity step's window: the first burst all warm-up
        requests = max(requests, CLOSED_WINDOW_CYCLES * round(rate))
    workload = scenario.at_rate(rate).model_copy(update={"num_requests": requests})
    return scenario.model_copy(update={"workload": workload})


def _step_down(scenario: Scenario, rate: float) -> float | None:
    """The search grid's next point below `rate` (None: nothing below it to try)."""
    lower = rate / (1 + scenario.load.precision)
    if scenario.closed_loop:
        lower = float(math.floor(lower)) if math.floor(lower) < rate else rate - 1
        return lower if lower >= 1 else None
    return lower


def hold_pick(
    runner: Runner, study: optuna.Study, scenario: Scenario, trial: FrozenTrial, factor: int
) -> dict[str, Any]:
    """Hold `trial`'s config at its claimed capacity (a fixed-load study: its nominal rate);
    lower a claim that misses, one grid step at a time. Kept as the study's HOLD_ATTR."""
    config = trial_knobs(study, trial)
    claimed = trial.user_attrs.get("capacity_rate") or scenario.nominal_rate
    searched = scenario.load.mode == "capacity"
    rate: float | None = claimed
    loads: list[dict[str, Any]] = []
    held = None
    # One engine for every rate tried, as a capacity search's steps share one.
    with runner.session(config, _load(scenario, claimed, factor).workload) as session:
        for _ in range(MAX_STEPS_DOWN + 1 if searched else 1):
            assert rate is not None
            load = _load(scenario, rate, factor)
            measurement = session.measure(load.workload, load.sla, False)
            metrics = summarize(measurement, load.sla, load.workload.burst)
            fault = measurement.fault
            meets = fault is None and is_feasible(constraint_values(metrics, load.sla))
            loads.append(
                {"rate": rate, "requests": load.workload.num_requests, "meets": meets}
                | {key: metrics.get(key) for key in HELD_METRICS}
                | ({"fault": f"{fault.kind}: {fault.message}"[:300]} if fault else {})
            )
            if meets:
                held = loads[-1]
                break
            if fault is not None and fault.kind != "sla-violated":
                break  # the engine failed: no lower rate would say more about the config
            rate = _step_down(scenario, rate)
            if rate is None:
                break
    result = {
        "trial": trial.number,
        "factor": factor,
        "claimed_rate": claimed,
        "held_rate": held["rate"] if held else None,
        "loads": loads,
    }
    study.set_user_attr(HOLD_ATTR, result)
    return result


def describe_hold(result: dict[str, Any], scenario: Scenario) -> str:
    """The console's line on a hold."""
    unit = "in flight" if scenario.closed_loop else "req/s"
    first = result["loads"][0]
    line = (
        f"hold: trial {result['trial']} at {result['claimed_rate']:.4g} {unit} for "
        f"{first['requests']:,} requests ({result['factor']}x the scenario's): "
    )
    if result["held_rate"] == result["claimed_rate"]:
        return line + f"holds (TTFT p99 {first['ttft_p99_ms']:.0f} ms)"
    tried = ", ".join(
        f"{load['rate']:.4g} {'holds' if load['meets'] else 'misses'}"
        + (f" (TTFT p99 {load['ttft_p99_ms']:.0f} ms)" if load["ttft_p99_ms"] else "")
        for load in result["loads"]
    )
    if result["held_rate"] is None:
        return line + f"misses at every rate tried ({tried}); the export marks its capacity unheld"
    below = (
        f"; below the scenario's nominal {scenario.nominal_rate:g} {unit}: the config does not "
        "sustain a normal day's load"
        if result["held_rate"] < scenario.nominal_rate
        else ""
    )
    return line + f"{tried}: the export's capacity is {result['held_rate']:.4g} {unit}{below}"


def held_capacity(hold: dict[str, Any] | None, trial: int) -> dict[str, Any] | None:
    """The export's `hold` block for `trial` (None when no hold of it is recorded)."""
    if hold is None or hold.get("trial") != trial:
        return None
    return {
        "factor": hold["factor"],
        "claimed_rate": hold["claimed_rate"],
        "held_rate": hold["held_rate"],
        "loads": hold["loads"],
    }
