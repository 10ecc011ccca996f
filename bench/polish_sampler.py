"""A local polish around any Optuna sampler: one-knob moves from the best config found so far.

Model-based samplers (TPE, GP) find the region of a good config quickly but can spend many
trials before landing on the best point of it: on the sim grid a config within 95% of the best
capacity is often one knob away from a config they already found. `PolishSampler` delegates to
an inner sampler and, once the search stalls, proposes the untried one-knob neighbours of the
best SLA-feasible trial (a numeric knob one step up or down: x2 or /2 on a log scale, about an
eighth of its range otherwise; a categorical knob's other values), and keeps polishing from a
neighbour that improved on it. While no trial meets the SLA it steers towards feasibility the
same way, every other trial, from the trial with the smallest largest violation (the
constraint values of objectives/scoring.py: relative overshoot of the TTFT/TPOT bound, missing
success rate). When the best trial has no untried neighbour left the inner sampler goes on.

The inner sampler sees every trial, polished ones included, so its model learns from them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.samplers import BaseSampler
from optuna.study import Study, StudyDirection
from optuna.trial import FrozenTrial, TrialState

CONSTRAINTS_KEY = "constraints"  # optuna.study._constrained_optimization's system attribute


def _violation(trial: FrozenTrial) -> float | None:
    constraints = trial.system_attrs.get(CONSTRAINTS_KEY)
    return None if constraints is None else max(constraints, default=0.0)


def _moves(value: Any, dist: BaseDistribution) -> list[Any]:
    """The values one step from `value`: numeric up and down, categorical every other choice."""
    if isinstance(dist, CategoricalDistribution):
        return [c for c in dist.choices if c != value]
    assert isinstance(dist, (IntDistribution, FloatDistribution))
    if dist.log:
        candidates = [value * 2, value / 2]
    else:
        step = dist.step or (1 if isinstance(dist, IntDistribution) else 0.0)
        delta = (dist.high - dist.low) / 8
        if step:
            delta = max(step, round(delta / step) * step)
        candidates = [value + delta, value - delta]
    moved = []
    for candidate in candidates:
        candidate = min(dist.high, max(dist.low, candidate))
        if isinstance(dist, IntDistribution):
            step = dist.step or 1
            candidate = int(dist.low + round((candidate - dist.low) / step) * step)
            candidate = min(dist.high, max(dist.low, candidate))
        elif dist.step:
            candidate = dist.low + round((candidate - dist.low) / dist.step) * dist.step
        if not math.isclose(candidate, value) and candidate not in moved:
            moved.append(candidate)
    return moved


class PolishSampler(BaseSampler):
    """`inner` until it stalls, then one-knob moves around the best SLA-feasible trial.

    patience: trials without a better feasible `objective` before the polish starts.
    min_trials: finished trials before any polish (the inner sampler's exploration).
    objective: the index of the objective the polish improves (default: the throughput).
    """

    def __init__(
        self,
        inner: BaseSampler,
        patience: int = 3,
        min_trials: int = 10,
        objective: int = 1,
        seed: int | None = None,
    ):
        self._inner = inner
        self._patience = patience
        self._min_trials = min_trials
        self._objective = objective
        self._rng = np.random.default_rng(seed)
        self._plans: dict[int, dict[str, Any]] = {}

    # --- the plan of a trial ---------------------------------------------------------------
    def _score(self, study: Study, trial: FrozenTrial) -> float:
        value = trial.values[self._objective]
        return value if study.directions[self._objective] == StudyDirection.MAXIMIZE else -value

    def _plan(self, study: Study, number: int) -> dict[str, Any] | None:
        finished = [
            t
            for t in study.get_trials(deepcopy=False)
            if t.state in (TrialState.COMPLETE, TrialState.FAIL) and t.number < number
        ]
        if len(finished) < self._min_trials:
            return None
        complete = [t for t in finished if t.state == TrialState.COMPLETE and t.values]
        feasible = [t for t in complete if (_violation(t) or 0.0) <= 0.0]
        if feasible:
            best = max(feasible, key=lambda t: (self._score(study, t), -t.number))
            stalled = sum(t.number > best.number for t in finished)
            if stalled < self._patience and best._trial_id not in self._plans:
                return None
        else:
            judged = [t for t in complete if _violation(t) is not None]
            if not judged or number % 2:
                return None
            best = min(judged, key=lambda t: (_violation(t), t.number))
        tried = [t.params for t in study.get_trials(deepcopy=False) if t.number != number]
        neighbours = []
        for name, dist in best.distributions.items():
            for value in _moves(best.params[name], dist):
                neighbours.append(best.params | {name: value})
        untried = [p for p in neighbours if p not in tried]
        if not untried:
            return None
        return untried[self._rng.integers(len(untried))]

    # --- BaseSampler ---------------------------------------------------------------------
    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        self._inner.before_trial(study, trial)
        plan = self._plan(study, trial.number)
        if plan is not None:
            self._plans[trial._trial_id] = plan

    def infer_relative_search_space(
        self, study: Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        if trial._trial_id in self._plans:
            return {}
        return self._inner.infer_relative_search_space(study, trial)

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        if trial._trial_id in self._plans:
            return {}
        return self._inner.sample_relative(study, trial, search_space)

    def sample_independent(
        self,
        study: Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        plan = self._plans.get(trial._trial_id)
        if plan is not None and param_name in plan:
            value = plan[param_name]
            if param_distribution._contains(param_distribution.to_internal_repr(value)):
                return value
        return self._inner.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(
        self,
        study: Study,
        trial: FrozenTrial,
        state: TrialState,
        values: Any,
    ) -> None:
        self._inner.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._inner.reseed_rng()
        self._rng = np.random.default_rng()
