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
Steps other than the nominal one stop as soon as the TTFT bound is certainly broken. The
capacity is the highest rate that met every SLO; its measured output tokens/s and requests/s
are the trial's throughput. `max_trial_s` ends the search early; the trial says so.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from objectives.scenario import Scenario
from objectives.scoring import constraint_values, is_feasible
from runners.base import Runner, Session
from runners.measurement import Fault, Measurement, summarize

CAPACITY_RAMP = 2.0  # rate factor per bracketing step

# The per-step figures kept in the trial, so a latency-throughput curve can be drawn.
STEP_METRICS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "output_tokens_per_s", "requests_per_s", "ttft_samples")


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


def _step(session: Session, scenario: Scenario, rate: float, stop_early: bool | None) -> Step:
    m = session.measure(scenario.at_rate(rate), scenario.sla, stop_early)
    metrics = summarize(m, scenario.sla) if m.sent else {}
    ok = (m.fault is None and metrics.get("ttft_p99_ms") is not None
          and is_feasible(constraint_values(metrics, scenario.sla)))
    return Step(rate, m, metrics, ok)


def _round(rate: float, closed: bool) -> float:
    return float(max(1, round(rate))) if closed else rate


def _narrow_enough(low: float, high: float, precision: float, closed: bool) -> bool:
    return (closed and high - low <= 1) or high <= low * (1 + precision)


class _Search:
    def __init__(self, session: Session, scenario: Scenario, deadline: float | None):
        self.session, self.scenario, self.deadline = session, scenario, deadline
        self.closed = scenario.closed_loop
        self.steps: list[Step] = []
        self.time_limited = False
        self.engine_fault: Step | None = None
        self.good: float | None = None
        self.bad: float | None = None

    def probe(self, rate: float) -> Step | None:
        """A step at `rate`; None when the time is up or the engine failed (the search ends)."""
        if self.engine_fault is not None:
            return None
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.time_limited = True
            return None
        step = _step(self.session, self.scenario, rate, True)
        self.steps.append(step)
        if step.measurement.fault is not None and step.measurement.fault.kind != "sla-violated":
            self.engine_fault = step
            return None
        return step

    def _try(self, rate: float) -> bool:
        """Probe `rate` and narrow the bracket; False when the search has to end."""
        step = self.probe(rate)
        if step is None:
            return False
        if step.meets_sla:
            self.good = rate
        else:
            self.bad = rate
        return True

    def run(self, nominal: Step) -> None:
        """Bracket, then bisect: `good` ends as the highest rate that met every SLO and `bad`
        as the lowest that broke one (None where none was seen)."""
        low_bound, high_bound = self.scenario.rate_bounds
        closed = self.closed
        self.good, self.bad = (nominal.rate, None) if nominal.meets_sla else (None, nominal.rate)
        while self.bad is None and self.good < high_bound:
            if not self._try(_round(min(self.good * CAPACITY_RAMP, high_bound), closed)):
                return
        while self.good is None and self.bad > low_bound:
            rate = _round(max(self.bad / CAPACITY_RAMP, low_bound), closed)
            if rate >= self.bad or not self._try(rate):
                return
        while self.good is not None and self.bad is not None and not _narrow_enough(
                self.good, self.bad, self.scenario.load.precision, closed):
            rate = math.floor((self.good + self.bad) / 2) if closed else math.sqrt(self.good * self.bad)
            if (closed and rate <= self.good) or not self._try(rate):
                return


def evaluate(runner: Runner, config: dict[str, Any], scenario: Scenario, seed_offset: int = 0) -> Evaluation:
    """Measure a config as the scenario's load mode says; seed_offset shifts every step's requests."""
    if seed_offset:
        scenario = scenario.model_copy(update={"workload": scenario.at_rate(scenario.nominal_rate, seed_offset)})
    started = time.monotonic()
    search = None
    with runner.session(config, scenario.workload) as session:
        nominal = _step(session, scenario, scenario.nominal_rate, None)
        measured = nominal.measurement.fault is None and nominal.metrics.get("ttft_p99_ms") is not None
        if measured and scenario.load.mode == "capacity":
            limit = scenario.load.max_trial_s
            search = _Search(session, scenario, None if limit is None else started + limit)
            search.steps.append(nominal)
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
    good, bad = search.good, search.bad
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
        metrics["capacity_note"] = f"misses the SLA even at the lowest rate searched ({low_bound:g})"
    if search.engine_fault is not None:
        fault = search.engine_fault.measurement.fault
        metrics["capacity_note"] = f"the search stopped at rate {search.engine_fault.rate:g}: {fault.kind}: {fault.message}"[:500]
    if scenario.load.peak_rate is not None:
        rps = metrics["capacity_rps"]
        metrics["instances_for_peak"] = math.ceil(scenario.load.peak_rate / rps) if rps > 0 else None
    return metrics
