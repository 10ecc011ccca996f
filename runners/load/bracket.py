"""The capacity search's bracket (runners.load.capacity): [highest rate that met every SLO,
lowest rate that missed one], from the nominal step doubled or halved to a bracket and bisected
geometrically; or, from a close config's capacity (a hint), walked on the grid the bisection
ends on, and with a rate the config has to reach to matter, pruned by a miss below it."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from objectives.scenario import Scenario
from runners.load.step import Step

CAPACITY_RAMP = 2.0  # rate factor per bracketing step


def grid_unit(precision: float) -> float:
    """The search's finest step, in log2 of the rate: from the nominal rate it brackets a
    doubling and halves it until the bracket is within `precision`, so every rate it measures
    at that depth is the nominal rate times 2 to a whole multiple of this."""
    unit = 1.0
    while 2**unit > 1 + precision:
        unit /= 2
    return unit


def step_down(scenario: Scenario, rate: float) -> float | None:
    """The search grid's next rate below `rate` (None: nothing below it to try): an open loop's
    grid is the nominal rate times 2 to a whole multiple of grid_unit; a closed loop's search
    ends on a bracket `precision` wide, in whole requests in flight, and steps down by that."""
    if scenario.closed_loop:
        lower = float(math.floor(rate / (1 + scenario.load.precision)))
        lower = lower if lower < rate else rate - 1
        return lower if lower >= 1 else None
    nominal, unit = scenario.nominal_rate, grid_unit(scenario.load.precision)
    # 1e-6: a rate the grid produced reads back as its own index, not one above
    index = math.ceil(math.log2(rate / nominal) / unit - 1e-6) - 1
    return nominal * 2 ** (index * unit)


class Search:
    """The bracket [highest rate that met every SLO, lowest rate that missed one], narrowed
    step by step; either end is None until a step has landed there."""

    def __init__(
        self, measure: Callable[[float], Step], scenario: Scenario, deadline: float | None
    ):
        self.measure_step, self.scenario, self.deadline = measure, scenario, deadline
        self.closed = scenario.closed_loop
        self.steps: list[Step] = []
        self.time_limited = False
        self.engine_fault: Step | None = None
        self.highest_met: float | None = None
        self.lowest_missed: float | None = None
        self.pruned_at: float | None = None  # the rate below prune_below that missed (run)

    def _as_rate(self, rate: float) -> float:
        """A closed loop's rate is a whole number of requests in flight."""
        return float(max(1, round(rate))) if self.closed else rate

    def _narrow_enough(self, highest_met: float, lowest_missed: float) -> bool:
        if self.closed and lowest_missed - highest_met <= 1:
            return True
        return lowest_missed <= highest_met * (1 + self.scenario.load.precision)

    def _measure(self, rate: float) -> Step | None:
        """Measure one step and move the bracket; None when the search has to end: the time is
        up, the engine failed (a missed SLA or failed requests are a step, not an end), or the
        rate is one already measured (a closed loop's rounding cannot move any further)."""
        if self.engine_fault is not None or any(step.rate == rate for step in self.steps):
            return None
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.time_limited = True
            return None
        step = self.measure_step(rate)
        self.steps.append(step)
        self.time_limited |= step.cut_short
        fault = step.measurement.fault
        if fault is not None and fault.kind != "sla-violated":
            self.engine_fault = step
            return None
        if step.meets_sla:
            self.highest_met = rate
        else:
            self.lowest_missed = rate
        return step

    def _ramp_up(self, met_rate: float, ceiling: float) -> bool:
        """From a rate that met every SLO, double until a step misses one or the ceiling is
        reached; False when the search has to end."""
        while met_rate < ceiling:
            step = self._measure(self._as_rate(min(met_rate * CAPACITY_RAMP, ceiling)))
            if step is None:
                return False
            if not step.meets_sla:
                return True
            met_rate = step.rate
        return True

    def _ramp_down(self, missed_rate: float, floor: float) -> bool:
        """From a rate that missed an SLO, halve until a step meets every one or the floor is
        reached; False when the search has to end."""
        while missed_rate > floor:
            step = self._measure(self._as_rate(max(missed_rate / CAPACITY_RAMP, floor)))
            if step is None:
                return False
            if step.meets_sla:
                return True
            missed_rate = step.rate
        return True

    def _bisect(self) -> None:
        """Narrow a bracket that has both ends, geometrically (closed loops: whole numbers)."""
        while True:
            highest_met, lowest_missed = self.highest_met, self.lowest_missed
            if highest_met is None or lowest_missed is None:
                return  # no bracket: every step met (to the ceiling) or missed (to the floor)
            if self._narrow_enough(highest_met, lowest_missed):
                return
            if self.closed:
                middle = float(math.floor((highest_met + lowest_missed) / 2))
            else:
                middle = math.sqrt(highest_met * lowest_missed)
            if self._measure(middle) is None:
                return

    def run(
        self, nominal: Step, hint: float | None = None, prune_below: float | None = None
    ) -> None:
        """From the nominal step: double until a step misses (or the ceiling), else halve until
        one meets (or the floor); then bisect geometrically (closed loops: whole numbers).
        With a `hint`, from the hint instead where it can (_run_from), and with `prune_below`
        too, ended by a miss at or below that rate (pruned_at)."""
        floor, ceiling = self.scenario.rate_bounds
        self.steps.append(nominal)
        self.time_limited |= nominal.cut_short
        if nominal.meets_sla:
            self.highest_met = nominal.rate
        else:
            self.lowest_missed = nominal.rate
        if hint is not None and self._run_from(nominal.rate, hint, prune_below):
            return
        if nominal.meets_sla:
            bracketing = self._ramp_up(nominal.rate, ceiling)
        else:
            bracketing = self._ramp_down(nominal.rate, floor)
        if bracketing:
            self._bisect()

    def _run_from(self, nominal: float, hint: float, prune_below: float | None = None) -> bool:
        """Search from `hint` (a capacity measured on a config close to this one) on the grid
        that the search from the nominal rate bisects down to, nominal * 2**(i * unit): probe
        the grid point nearest the hint, step away from it by 1, 2, 4... points until the
        bracket has both ends (the nominal rate's verdict is one), then bisect by whole points.
        Past the whole doublings of the nominal rate that [floor, ceiling] holds, it does what
        the search from the nominal rate does there (_edge). So where the engine's verdict
        rises no higher as the rate does, it ends on the same two rates; with a right hint,
        after two steps instead of seven or eight, the steps near capacity being the ones that
        run to EXTENSION_CAP. A hint above a worse neighbour's capacity is bisected down from,
        through rates far below it that settle at once; stepping down from it, through rates
        near it that run long, cost 14% more simulated requests (customer-service's arms and
        polish, seed 0: 1,248k against 1,091k). False, with nothing measured, for a closed
        loop (whole numbers are not this grid) and a hint outside [floor, ceiling].

        With `prune_below`, the first miss is followed by the grid point at or below that
        rate, and a miss there (or at the nominal rate, where that lies below it) ends the
        search (pruned_at): the capacity lies below it, and how far below is not searched."""
        floor, ceiling = self.scenario.rate_bounds
        if self.closed or not floor < hint < ceiling:
            return False
        unit = grid_unit(self.scenario.load.precision)
        per_doubling = round(1 / unit)
        top = per_doubling * math.floor(math.log2(ceiling / nominal) + 1e-9)
        bottom = -per_doubling * math.floor(math.log2(nominal / floor) + 1e-9)

        def rate(index: int) -> float:
            return nominal * 2 ** (index * unit)

        met: int | None = 0 if self.highest_met is not None else None
        missed: int | None = 0 if self.lowest_missed is not None else None
        probe, stride = round(math.log2(hint / nominal) / unit), 1
        # 1e-6: a rate the grid produced reads back as its own index, not one below
        prune = (
            None
            if prune_below is None
            else math.floor(math.log2(prune_below / nominal) / unit + 1e-6)
        )
        if prune is not None and missed == 0 and prune >= 0:  # a miss at the nominal rate
            self.pruned_at = nominal
            return True
        jump: int | None = None  # after a miss above it, the prune rate's grid point next
        while met is None or missed is None or missed - met > 1:
            if missed is None and met == top:
                return self._edge(ceiling, rate(top))
            if met is None and missed == bottom:
                return self._edge(floor, rate(bottom))
            if jump is not None:
                probe, jump = max(jump, bottom), None
            elif met is not None and missed is not None:
                probe = (met + missed) // 2
            else:  # within the doublings the bounds hold, on the bracket's open side
                low = bottom if met is None else met + 1
                high = top if missed is None else missed - 1
                probe = min(max(probe, low), high)
            step = self._measure(rate(probe))
            if step is None:
                return True
            if step.meets_sla:
                met, probe = probe, probe + stride
            else:
                missed, probe = probe, probe - stride
                if prune is not None and (met is None or met < prune):
                    if missed <= prune:
                        self.pruned_at = step.rate
                        return True
                    jump = prune
            stride *= 2
        return True

    def _edge(self, bound: float, last: float) -> bool:
        """Past the last whole doubling (or halving) within the bounds, as the plain search
        goes on: the bound itself, and a bracket with it bisected geometrically."""
        if not math.isclose(bound, last) and self._measure(bound) is not None:
            self._bisect()
        return True
