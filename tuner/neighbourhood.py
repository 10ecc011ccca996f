"""A config's one-knob neighbourhood, as the polish climbs it (tuner.polish): each categorical
knob's other values, each numeric knob one step either way (a log-scaled knob by
NUMERIC_LOG_STEP, a linear one by a fifth of its range, the grid's interval, rounded to its own
step and one step at least), and after a move, that knob stepped twice as far again."""

from __future__ import annotations

from typing import Any

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import FrozenTrial

from search_spaces.space import GRID_POINTS, ROLE_KNOBS, SearchSpace, nearest_value

NUMERIC_LOG_STEP = 1.25  # a log-scaled knob's neighbours: times and divided by this


def steps(dist: BaseDistribution, value: Any) -> list[Any]:
    """A knob's values one step from `value` within its distribution: a linear knob's step is
    the grid's (SearchSpace.grid: GRID_POINTS over the range) or its own, whichever is larger."""
    if isinstance(dist, CategoricalDistribution):
        return [choice for choice in dist.choices if choice != value]
    assert isinstance(dist, (IntDistribution, FloatDistribution)), dist
    if dist.log:
        candidates = [value / NUMERIC_LOG_STEP, value * NUMERIC_LOG_STEP]
    else:
        step = max(dist.step or 0, (dist.high - dist.low) / (GRID_POINTS - 1))
        if dist.step:  # on the knob's own grid, and at least one of its steps
            step = max(1, round(step / dist.step)) * dist.step
        candidates = [value - step, value + step]
    out = []
    for candidate, direction in zip(candidates, (-1, 1), strict=True):
        candidate = nearest_value(dist, candidate)
        if candidate == value and dist.step:  # a small value's log step rounds back onto it
            candidate = nearest_value(dist, value + direction * dist.step)
        if candidate != value and candidate not in out:
            out.append(candidate)
    return out


def neighbours(
    space: SearchSpace,
    params: dict[str, Any],
    frozen: tuple[str, ...] = (),
    only: tuple[str, ...] | None = None,
) -> list[dict[str, Any]]:
    """The params one knob away from `params`, in the space's knob order, the `frozen` knobs
    left alone (and with `only`, every knob but those). A co-located pick's role knobs are
    left alone too: they do not change what it runs."""
    co_located = params.get("deployment", "co-located") != "disaggregated"
    out = []
    for name, dist in space.distributions().items():
        if name not in params or name in frozen or (co_located and name in ROLE_KNOBS):
            continue
        if only is not None and name not in only:
            continue
        out += [params | {name: value} for value in steps(dist, params[name])]
    return out


def farther(space: SearchSpace, before: dict[str, Any], after: dict[str, Any]) -> list[dict]:
    """After a move of one numeric knob, that knob stepped twice as far again (a log-scaled
    knob: by the square of the move's ratio), so a run of wins in one direction speeds up: by
    NUMERIC_LOG_STEP alone, max_prefill_batch_size climbed 4 -> 5 and its budget ran out where
    25 read 13% above 5 (customer-service with 4 system prompts, seed 1). Nothing after a
    categorical move."""
    moved = [name for name in after if before.get(name) != after[name]]
    dists = space.distributions()
    if len(moved) != 1 or moved[0] not in dists:
        return []
    name = moved[0]
    dist, old, new = dists[name], before[name], after[name]
    if not isinstance(dist, (IntDistribution, FloatDistribution)):
        return []
    further = nearest_value(dist, new * (new / old) ** 2 if dist.log else new + 2 * (new - old))
    return [after | {name: further}] if further != new else []


def change(before: FrozenTrial, after: FrozenTrial, why: str = "") -> str:
    moved = difference(before.params, after.params) + why
    return f"trial {before.number} -> {after.number} ({moved})"


def difference(before: dict[str, Any], after: dict[str, Any]) -> str:
    return ", ".join(
        f"{name} {before.get(name)} -> {after[name]}"
        for name in after
        if before.get(name) != after[name]
    )
