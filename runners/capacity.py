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
   (closed loops: whole requests in flight).
The nominal step runs whole; the others stop as soon as the SLA is certainly missed (unless
`load.early_rejection` is false). A step whose requests fail (an overloaded server refusing
some) misses the SLA's success rate and is bisected on like any miss; only an engine that dies
ends the search. A closed loop's step that cannot move (rounding to a rate already measured)
ends it too. The capacity is the highest rate that met every SLO; its measured output
tokens/s and requests/s are the trial's throughput. `max_trial_s` ends the search early; the
trial says so.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from objectives.scenario import Scenario
from objectives.scoring import constraint_values, is_feasible
from runners.base import Runner, Session
from runners.measurement import Fault, Measurement, summarize

CAPACITY_RAMP = 2.0  # rate factor per bracketing step

# The per-step figures kept in the trial, so a latency-throughput curve can be drawn.
STEP_METRICS = (
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "output_tokens_per_s",
    "requests_per_s",
    "ttft_samples",
)


@dataclass
class Step:
    rate: float
    measurement: Measurement
    metrics: dict[str, Any]
    meets_sla: bool

    def record(self) -> dict[str, Any]:
        row = {"rate": self.rate, "meets_sla": self.meets_sla}
        row |= {key: self.metrics.get(key) for key in STEP_METRICS}
        if self.measurement.fault is not None:
            row["fault"] = f"{self.measurement.fault.kind}: {self.measurement.fault.message}"[:300]
        return row


@dataclass
class Evaluation:
    """What a trial stores: metrics at the nominal rate (plus capacity_*), or a fault."""

    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # runner facts (engine log, start time)
    fault: Fault | None = None
    partial: dict[str, Any] = field(default_factory=dict)  # metrics of a load stopped early


def _step(session: Session, scenario: Scenario, rate: float, stop_early: bool) -> Step:
    m = session.measure(scenario.at_rate(rate), scenario.sla, stop_early)
    metrics = summarize(m, scenario.sla) if m.sent else {}
    meets_sla = (
        m.fault is None
        and metrics.get("ttft_p99_ms") is not None
        and is_feasible(constraint_values(metrics, scenario.sla))
    )
    return Step(rate, m, metrics, meets_sla)


class _Search:
    """The bracket [highest rate that met every SLO, lowest rate that missed one], narrowed
    step by step; either end is None until a step has landed there."""

    def __init__(self, session: Session, scenario: Scenario, deadline: float | None):
        self.session, self.scenario, self.deadline = session, scenario, deadline
        self.closed = scenario.closed_loop
        self.steps: list[Step] = []
        self.time_limited = False
        self.engine_fault: Step | None = None
        self.highest_met: float | None = None
        self.lowest_missed: float | None = None

    def _as_rate(self, rate: float) -> float:
        """A closed loop's rate is a whole number of requests in flight."""
        return float(max(1, round(rate))) if self.closed else rate

    def _narrow_enough(self) -> bool:
        low, high = self.highest_met, self.lowest_missed
        return (self.closed and high - low <= 1) or high <= low * (1 + self.scenario.load.precision)

    def _measure(self, rate: float) -> bool:
        """Measure one step and move the bracket; False when the search has to end: the time is
        up, the engine failed (a missed SLA or failed requests are a step, not an end), or the
        rate is one already measured (a closed loop's rounding cannot move any further)."""
        if self.engine_fault is not None or any(step.rate == rate for step in self.steps):
            return False
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.time_limited = True
            return False
        step = _step(self.session, self.scenario, rate, self.scenario.load.early_rejection)
        self.steps.append(step)
        fault = step.measurement.fault
        if fault is not None and fault.kind != "sla-violated":
            self.engine_fault = step
            return False
        if step.meets_sla:
            self.highest_met = rate
        else:
            self.lowest_missed = rate
        return True

    def run(self, nominal: Step) -> None:
        """From the nominal step: double until a step misses (or the ceiling), else halve until
        one meets (or the floor); then bisect geometrically (closed loops: whole numbers)."""
        floor, ceiling = self.scenario.rate_bounds
        self.steps.append(nominal)
        if nominal.meets_sla:
            self.highest_met = nominal.rate
        else:
            self.lowest_missed = nominal.rate
        while self.lowest_missed is None and self.highest_met < ceiling:
            if not self._measure(self._as_rate(min(self.highest_met * CAPACITY_RAMP, ceiling))):
                return
        while self.highest_met is None and self.lowest_missed > floor:
            if not self._measure(self._as_rate(max(self.lowest_missed / CAPACITY_RAMP, floor))):
                return
        while (
            self.highest_met is not None
            and self.lowest_missed is not None
            and not self._narrow_enough()
        ):
            low, high = self.highest_met, self.lowest_missed
            middle = math.floor((low + high) / 2) if self.closed else math.sqrt(low * high)
            if not self._measure(float(middle)):
                return


def evaluate(
    runner: Runner,
    config: dict[str, Any],
    scenario: Scenario,
    seed_offset: int = 0,
    on_session: Callable[[Session], None] | None = None,
) -> Evaluation:
    """Measure a config as the scenario's load mode says; seed_offset shifts every step's
    requests. `on_session` is called once the engine serves the config, before any load."""
    if seed_offset:
        scenario = scenario.model_copy(
            update={"workload": scenario.at_rate(scenario.nominal_rate, seed_offset)}
        )
    started = time.monotonic()
    search = None
    with runner.session(config, scenario.workload) as session:
        if on_session is not None:
            on_session(session)
        # Measured whole: its TTFT p99 is an objective and its SLA check the trial's constraint.
        nominal = _step(session, scenario, scenario.nominal_rate, stop_early=False)
        measured = (
            nominal.measurement.fault is None and nominal.metrics.get("ttft_p99_ms") is not None
        )
        if measured and scenario.load.mode == "capacity":
            limit = scenario.load.max_trial_s
            search = _Search(session, scenario, None if limit is None else started + limit)
            search.run(nominal)
    # After the session: the engine has stopped, and its stop time is among the facts.
    extra = session.extra | nominal.measurement.extra
    if nominal.measurement.fault is not None:
        return Evaluation(extra=extra, fault=nominal.measurement.fault, partial=nominal.metrics)
    metrics = dict(nominal.metrics)
    if search is not None:
        metrics |= _capacity_metrics(scenario, search)
        extra["search_s"] = time.monotonic() - started
    return Evaluation(metrics, extra)


def _capacity_metrics(scenario: Scenario, search: _Search) -> dict[str, Any]:
    good, bad = search.highest_met, search.lowest_missed
    at = next((s for s in search.steps if s.rate == good and s.meets_sla), None)
    low_bound, high_bound = scenario.rate_bounds
    metrics: dict[str, Any] = {
        "capacity_rate": good,  # req/s, or requests in flight for a closed loop
        "capacity_rate_unit": "concurrency" if scenario.closed_loop else "req/s",
        "capacity_rps": at.metrics["requests_per_s"] if at else 0.0,
        "capacity_output_tokens_per_s": at.metrics["output_tokens_per_s"] if at else 0.0,
        "capacity_ttft_p99_ms": at.metrics["ttft_p99_ms"] if at else None,
        "capacity_bracket": [good, bad],
        "capacity_at_ceiling": good is not None and bad is None and good >= high_bound,
        "capacity_time_limited": search.time_limited,
        "capacity_steps": [s.record() for s in search.steps],
    }
    if good is None:
        metrics["capacity_note"] = (
            f"misses the SLA even at the lowest rate searched ({low_bound:g})"
        )
    if search.engine_fault is not None:
        fault = search.engine_fault.measurement.fault
        metrics["capacity_note"] = (
            f"the search stopped at rate {search.engine_fault.rate:g}: {fault.kind}: {fault.message}"[
                :500
            ]
        )
    if scenario.load.peak_rate is not None:
        rps = metrics["capacity_rps"]
        metrics["instances_for_peak"] = (
            math.ceil(scenario.load.peak_rate / rps) if rps > 0 else None
        )
    return metrics
