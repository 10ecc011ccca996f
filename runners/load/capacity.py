"""One trial's evaluation of a config under a scenario: the load at the nominal rate, and in
capacity mode the highest rate at which every SLO holds.

The capacity search (scenario `load.mode: capacity`) runs against one session, so a real
engine starts once per trial. Every step replays the same request lengths and arrival pattern
scaled to its rate (common random numbers: rates and configs differ by their load, not by the
luck of the draw); a real engine gets fresh prompt text each step.

1. the nominal rate (the scenario's `rate`, or `concurrency` for a closed loop): its metrics
   are the trial's latency and its SLA constraint;
2. bracket: from the nominal rate double the rate until a step breaks an SLO or `max_rate` is
   reached; if the nominal rate breaks one, halve down to `min_rate` instead;
3. bisect the bracket geometrically until its width is within `precision` of its low end
   (closed loops: whole requests in flight); runners.load.bracket.
The nominal step runs whole; the others stop as soon as the SLA is certainly missed (unless
`load.early_rejection` is false). A step whose requests fail (an overloaded server refusing
some) misses the SLA's success rate and is bisected on like any miss; only an engine that dies
ends the search. A closed loop's step that cannot move (rounding to a rate already measured)
ends it too. The capacity is the highest rate that met every SLO; its measured output
tokens/s and requests/s are the trial's throughput. `max_trial_s` ends the search early; the
trial says so.

Steady state: each step's window is judged by runners.load.steady_state's rule, extended until
it settles or reaches EXTENSION_CAP times `num_requests`. A load with a burst (a fixed load
only) is not steady by design: it runs once, as written, and its burst figures judge it; nor
is a trace's replay (objectives.trace), which runs its whole window at every rate, scaled in
time, and is judged as measured: a capacity on a trace is the highest multiple of its rate
whose replay meets every SLO, sustained (the delivered rate) included. An
open loop of conversations searched for its capacity starts from a window as long as one
(SESSION_SPANS).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from objectives.scenario import SLA, Closed, Scenario, Workload
from objectives.scoring import constraint_values, is_feasible
from runners.base import Runner, Session
from runners.load.bracket import Search
from runners.load.draws import mean_length
from runners.load.measurement import Fault, summarize, warmup_requests
from runners.load.steady_state import RISING_TREND, settle_margin, slowing, unsettled
from runners.load.step import Step

# With the fourth-root margin, a cap of 4 left customer-service's export 1 seed in 3 above what
# 16x its requests sustain; 8 none (bench/bench_steady_state.py --exports), at 1.7x the
# simulated requests per trial.
EXTENSION_CAP = 8  # a step's longest window, in the scenario's num_requests
# Below the nominal rate a window sends fewer requests, in proportion to its rate, so that it
# lasts no longer than a nominal one (at 1/16 of customer-service's rate, 1,000 requests would
# take 44 minutes on a real engine); never fewer than this, for the p99's sake.
MIN_WINDOW = 200
MAX_WINDOW_REQUESTS = 1_000_000  # Workload.num_requests' own limit
# A closed loop's window sends at least this many requests per request in flight, so that its
# warm-up (a tenth) holds the first burst, every seat's first request sent at once: 600
# requests at 600 in flight measure only the time to prefill them all. The search's ceiling is
# then no longer num_requests (content-generation's capacity read 600 in flight on its 600
# requests, 736 on 9,600).
CLOSED_WINDOW_CYCLES = 10
# An open loop of conversations: a window lasts at least this many typical conversations. The
# turn rate of conversations that start at random drifts over a conversation's length (26-31
# req/s over 35 s stretches of a 27.9 req/s plan), and a shorter window misses the stretches
# above the mean: multi-turn-chat claimed 30.6 req/s on 2,000-request windows (67 s, about
# half a conversation) and held 27.8 over 16,000.
SESSION_SPANS = 1


@dataclass
class Evaluation:
    """What a trial stores: metrics at the nominal rate (plus capacity_*), or a fault."""

    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # runner facts (engine log, start time)
    fault: Fault | None = None
    partial: dict[str, Any] = field(default_factory=dict)  # metrics of a load stopped early
    pruned: str | None = None  # why the capacity search stopped below `prune_below` (evaluate)


def _moved(sla: SLA, factor: float) -> SLA:
    """The SLA with its percentile bounds times `factor`: what early rejection stops on."""
    tpot = sla.tpot_p99_ms
    return sla.model_copy(
        update={
            "ttft_p99_ms": sla.ttft_p99_ms * factor,
            "tpot_p99_ms": None if tpot is None else tpot * factor,
        }
    )


def step_at(
    session: Session,
    scenario: Scenario,
    rate: float,
    stop_early: bool,
    deadline: float | None = None,
    unsettled_misses: bool = True,
    factor: int = 1,
    extension_cap: int = EXTENSION_CAP,
) -> Step:
    """Measure one rate until its window is settled (the module's steady-state rule). The
    nominal step passes `unsettled_misses=False`: its verdict is its judged window's SLA check,
    the trial's constraint, which every config's trial is compared on. A window starts at
    `factor` times the scenario's requests (a hold's longer load, tuner.hold) and is extended
    up to `extension_cap` times that."""
    sla, base = scenario.sla, scenario.workload.num_requests * factor
    replay = scenario.workload.trace is not None  # every rate replays the same requests
    if rate < scenario.nominal_rate and not replay:  # as long as a nominal window, not longer
        base = max(min(base, MIN_WINDOW), math.ceil(base * rate / scenario.nominal_rate))
    if scenario.closed_loop:  # every seat serves a few requests: no window is all fill and drain
        base = max(base, CLOSED_WINDOW_CYCLES * round(rate))
    elif scenario.workload.sessions is not None and scenario.load.mode == "capacity":
        conversation = math.ceil(SESSION_SPANS * scenario.workload.session_span_s * rate)
        base = min(max(base, conversation), MAX_WINDOW_REQUESTS)
    cap = min(base * extension_cap, max(base, MAX_WINDOW_REQUESTS))
    if scenario.workload.burst is not None or replay:  # one test, run as written
        cap = base
    size, windows, sent = base, 0, 0
    while True:
        last = size * 2 > cap
        margin = settle_margin(size - warmup_requests(size))
        workload = scenario.at_rate(rate).model_copy(update={"num_requests": size})
        started = time.monotonic()
        # Stopped early, a window must be a miss whatever follows: beyond the margin before the
        # last window; in the last one, anything from the margin's lower edge up is a miss.
        rejection = _moved(sla, 1 - margin if last else 1 + margin)
        measurement = session.measure(workload, rejection, stop_early)
        windows, sent = windows + 1, sent + measurement.sent
        metrics = summarize(measurement, sla, workload.burst) if measurement.sent else {}
        meets_sla = (
            measurement.fault is None
            and metrics.get("ttft_p99_ms") is not None
            and is_feasible(constraint_values(metrics, sla))
        )
        # A load stopped early, or one without a TTFT, is a miss whatever the horizon.
        # A trace's replay is judged as the traffic it is, not as a sample of a steady one.
        why = (
            unsettled(metrics, sla, meets_sla, margin)
            if measurement.fault is None and metrics.get("ttft_p99_ms") is not None and not replay
            else None
        )
        if why is not None and not last:
            elapsed = time.monotonic() - started
            if deadline is None or time.monotonic() + 2 * elapsed <= deadline:
                size *= 2
                continue
            why += "; no time left to extend it"
            return Step(rate, measurement, metrics, meets_sla, windows, sent, why, True)
        if why is not None and unsettled_misses:
            why += f" at {factor * extension_cap}x the scenario's requests: a miss"
            meets_sla = False
        trend = metrics.get("ttft_trend")
        slowed = why is None and meets_sla and slowing(metrics) and (trend or 0) > RISING_TREND
        return Step(rate, measurement, metrics, meets_sla, windows, sent, why, slowed=slowed)


def evaluate(
    runner: Runner,
    config: dict[str, Any],
    scenario: Scenario,
    seed_offset: int = 0,
    on_session: Callable[[Session], None] | None = None,
    capacity_hint: float | None = None,
    prune_below: float | None = None,
) -> Evaluation:
    """Measure a config as the scenario's load mode says; seed_offset shifts every step's
    requests. `on_session` is called once the engine serves the config, before any load. A
    `capacity_hint` (a close config's capacity) starts an open loop's search there; with
    `prune_below` (a rate under the hint), a miss at or below that rate ends the search and the
    evaluation is `pruned`: the capacity is known to lie below it, not where."""
    if seed_offset:
        scenario = scenario.model_copy(
            update={"workload": scenario.at_rate(scenario.nominal_rate, seed_offset)}
        )
    started = time.monotonic()
    limit = scenario.load.max_trial_s
    deadline = None if limit is None else started + limit
    search = None
    with runner.session(config, scenario.workload) as session:
        if on_session is not None:
            on_session(session)
        # Measured whole: its TTFT p99 is an objective and its SLA check the trial's constraint.
        nominal = step_at(session, scenario, scenario.nominal_rate, False, deadline, False)
        measured = (
            nominal.measurement.fault is None and nominal.metrics.get("ttft_p99_ms") is not None
        )
        if measured and scenario.load.mode == "capacity":
            early = scenario.load.early_rejection
            search = Search(
                lambda rate: step_at(session, scenario, rate, early, deadline), scenario, deadline
            )
            search.run(nominal, capacity_hint, prune_below)
    # After the session: the engine has stopped, and its stop time is among the facts.
    extra = session.extra | nominal.measurement.extra
    if nominal.measurement.fault is not None:
        return Evaluation(extra=extra, fault=nominal.measurement.fault, partial=nominal.metrics)
    metrics = dict(nominal.metrics) | {
        key: value for key, value in nominal.horizon().items() if key != "warmup_requests"
    }
    if search is None:
        return Evaluation(metrics, extra)
    extra["search_s"] = time.monotonic() - started
    if search.pruned_at is None:
        return Evaluation(metrics | _capacity_metrics(scenario, search), extra)
    why = (
        f"pruned: missed the SLA at {search.pruned_at:.4g} {_unit(scenario)}, at or below "
        f"{prune_below:.4g}, the least it had to sustain to matter; its capacity lies below"
    )
    metrics |= {"capacity_below": search.pruned_at} | _steps_metrics(search)
    return Evaluation(metrics, extra, pruned=why)


def _steps_metrics(search: Search) -> dict[str, Any]:
    """Every step the search measured, and the requests they sent in all."""
    return {
        "capacity_requests_all_steps": sum(step.requests_all_windows for step in search.steps),
        "capacity_steps": [step.record() for step in search.steps],
    }


def _unit(scenario: Scenario) -> str:
    return "concurrency" if scenario.closed_loop else "req/s"


def sustained_tokens_per_s(workload: Workload, rate: float | None, measured: float) -> float:
    """The throughput a config sustains at `rate`, ranked by the pick rule, the ladder and
    the deployment verdicts: for an open loop the offered rate times the workload's mean
    output length. A load meeting the `sustained` SLO serves what it is offered, and what a
    window reads beside that is its ramp and drain, which depend on the window's length, not
    on the config: at 44.02 req/s one config read 5,428 tok/s on a 4,000-request window and a
    config of the same capacity 4,872 on a 1,000-request one. A closed loop's rate is the
    requests in flight: its throughput is the one measured."""
    if rate is None or isinstance(workload.arrival, Closed):
        return measured if rate is not None else 0.0
    return rate * mean_length(workload.output_tokens)


def _capacity_metrics(scenario: Scenario, search: Search) -> dict[str, Any]:
    highest_met, lowest_missed = search.highest_met, search.lowest_missed
    capacity_step = next(
        (step for step in search.steps if step.rate == highest_met and step.meets_sla), None
    )
    floor, ceiling = scenario.rate_bounds
    capacity_metrics = capacity_step.metrics if capacity_step else None
    measured_tokens = capacity_metrics["output_tokens_per_s"] if capacity_metrics else 0.0
    metrics: dict[str, Any] = {
        "capacity_rate": highest_met,  # req/s, or requests in flight for a closed loop
        "capacity_rate_unit": _unit(scenario),
        "capacity_rps": capacity_metrics["served_rps"] if capacity_metrics else 0.0,
        "capacity_output_tokens_per_s": sustained_tokens_per_s(
            scenario.workload, highest_met, measured_tokens
        ),
        # as the load that decided it read it, ramp and drain included
        "capacity_measured_output_tokens_per_s": measured_tokens,
        "capacity_ttft_p99_ms": capacity_metrics["ttft_p99_ms"] if capacity_metrics else None,
        "capacity_tpot_p99_ms": capacity_metrics["tpot_p99_ms"] if capacity_metrics else None,
        # what the engine kept up with at capacity, against what it was offered (the rate)
        "capacity_delivered_share": (
            capacity_metrics.get("delivered_share") if capacity_metrics else None
        ),
        # the load that decided it: requests in its judged window, and whether it settled
        "capacity_horizon_requests": (
            capacity_step.measurement.sent if capacity_step is not None else None
        ),
        "capacity_settled": capacity_step.unsettled is None if capacity_step else None,
        "capacity_bracket": [highest_met, lowest_missed],
        "capacity_at_ceiling": (
            highest_met is not None and lowest_missed is None and highest_met >= ceiling
        ),
        "capacity_time_limited": search.time_limited,
    } | _steps_metrics(search)
    if highest_met is None:
        metrics["capacity_note"] = f"misses the SLA even at the lowest rate searched ({floor:g})"
    slowed = [step.rate for step in search.steps if step.slowed]
    if slowed:
        note = (
            f"the engine slowed down during the loads at {', '.join(f'{r:g}' for r in slowed)}: "
            "the TTFT of requests that found it idle rose as each load went on"
        )
        metrics["capacity_note"] = "; ".join(filter(None, [metrics.get("capacity_note"), note]))
    engine_fault = search.engine_fault
    # An engine fault is a step whose measurement failed other than by missing the SLA.
    if engine_fault is not None and engine_fault.measurement.fault is not None:
        fault = engine_fault.measurement.fault
        stopped = f"the search stopped at rate {engine_fault.rate:g}: {fault.kind}: {fault.message}"
        metrics["capacity_note"] = "; ".join(
            filter(None, [stopped[:500], metrics.get("capacity_note")])
        )
    if scenario.load.peak_rate is not None:
        metrics["instances_for_peak"] = fleet_for_peak(
            scenario.load.peak_rate, highest_met, metrics["capacity_rps"], scenario.closed_loop
        )
    return metrics


def fleet_for_peak(
    peak_rate: float, rate: float | None, served_rps: float, closed_loop: bool
) -> int | None:
    """Instances for a peak of `peak_rate` req/s, each taking what its capacity load both was
    offered and served: a window's served rate can read a little above the offered one (the
    drawn arrivals ran ahead of the rate), and sizing on that would leave the fleet short.
    A closed loop's rate is requests in flight: what it served sizes it. None: nothing
    served."""
    per_instance = served_rps if closed_loop or rate is None else min(rate, served_rps)
    return math.ceil(peak_rate / per_instance) if per_instance > 0 else None
