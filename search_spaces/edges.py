"""Where a config sits on the edge of the searched space: the range, not the model or the
hardware, may be what stopped the search, and the user should hear which knob and how to widen
it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from search_spaces.knobs import KNOBS
from search_spaces.space import KnobRange, SearchSpace

Side = Literal["low", "high"]
# A value this close to an end, as a share of the range's width (log width for a log range),
# sits on it: a sampler rarely lands exactly on the end of a wide integer range.
NEAR_END = 0.05


def inside(dist: BaseDistribution, value: Any) -> bool:
    """Whether a run searching `dist` could propose `value` (a choice it has, or a value in its
    range on its step): a config carried over from another study or run may not be."""
    if isinstance(dist, CategoricalDistribution):
        return value in dist.choices
    assert isinstance(dist, (IntDistribution, FloatDistribution))
    if not dist.low <= value <= dist.high:
        return False
    steps = None if dist.step is None else (value - dist.low) / dist.step
    return steps is None or math.isclose(steps, round(steps), abs_tol=1e-9)


@dataclass(frozen=True)
class RangeEdge:
    knob: str
    side: Side
    value: float
    searched: tuple[float, float]
    widened: str | None  # the range a --space file could give instead; None: it cannot move
    why_fixed: str = ""  # why that end cannot move (what memory holds, the longest prompt)

    def message(self) -> str:
        low, high = self.searched
        where = (
            f"{self.knob} = {_number(self.value)} sits on the {self.side} end of its range "
            f"{_number(low)}..{_number(high)}"
        )
        if self.widened is None:
            return f"{where}, and that end cannot move: {self.why_fixed}"
        further = "larger" if self.side == "high" else "smaller"
        return (
            f"{where}: a {further} value may be better; widen it in a --space file "
            f"(knobs: {{{self.knob}: {self.widened}}}) and run again"
        )


def range_edges(space: SearchSpace, config: dict[str, Any]) -> list[RangeEdge]:
    """The numeric knobs whose value in `config` is at (NEAR_END) an end of the range searched,
    leaving out an end that is the knob's own limit (nothing to widen, nothing to tell)."""
    edges = []
    for name, spec in space.ranges.items():
        value = config.get(name)
        if spec.low is None or spec.high is None or spec.low == spec.high or value is None:
            continue
        scale = math.log if spec.log else float
        width = scale(spec.high) - scale(spec.low)
        limit_low, limit_high = KNOBS[name].limits or (-math.inf, math.inf)
        ends: list[tuple[Side, float, float]] = [
            ("high", spec.high, limit_high),
            ("low", spec.low, limit_low),
        ]
        for side, end, limit in ends:
            if abs(scale(float(value)) - scale(end)) > NEAR_END * width or end == limit:
                continue
            bound, why = space.hard_ends.get(f"{name}.{side}", (limit, ""))
            bound = min(bound, limit) if side == "high" else max(bound, limit)
            new_end = _widened(spec, side, bound, KNOBS[name].kind == "int")
            widened = None
            if new_end != end:
                low, high = (spec.low, new_end) if side == "high" else (new_end, spec.high)
                form = ", log: true" if spec.log else f", step: {spec.step:g}" if spec.step else ""
                widened = f"{{low: {_number(low)}, high: {_number(high)}{form}}}"
            elif not why:
                continue  # the knob's own limit, after rounding
            edge = RangeEdge(name, side, float(value), (spec.low, spec.high), widened, why)
            edges.append(edge)
    return edges


def _widened(spec: KnobRange, side: Side, bound: float, integer: bool) -> float:
    """One more octave for a log range, half the width again for a linear one, at least one
    step (or one, for an integer knob); never past `bound`, and on the range's step."""
    assert spec.low is not None and spec.high is not None
    low, high, unit = spec.low, spec.high, spec.step or (1 if integer else 0)
    if side == "high":
        end = max(high * 2 if spec.log else high + (high - low) / 2, high + unit)
        end = min(end, bound)
        end = low + math.floor((end - low) / spec.step) * spec.step if spec.step else end
        return math.floor(end) if integer else end
    end = min(low / 2 if spec.log else low - (high - low) / 2, low - unit)
    end = max(end, bound)
    end = high - math.floor((high - end) / spec.step) * spec.step if spec.step else end
    return math.ceil(end) if integer else end


def _number(value: float) -> str:
    """A knob value as a --space file takes it: whole numbers without an exponent."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
