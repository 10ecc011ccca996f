"""The arms that the console and the report compare (each precision and KV pair of the quality
ladder, each deployment on a chip budget), and each arm's pick."""

from __future__ import annotations

from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from objectives.scenario import Scenario
from objectives.scoring import is_feasible, pick_best
from runners.quality import quality_pair
from tuner.quality import EXCLUDED
from tuner.study import MIN_ARM_TRIALS, StudyRun, best_trial, runs_arm, trial_knobs


def arms(run: StudyRun) -> list[dict[str, Any]]:
    """The arms the run's statements compare, as the space searches them: each precision and KV
    pair the quality SLO admits (the ladder), and with a chip budget each deployment."""

    def values(name: str) -> list[Any]:
        spec = run.space.ranges.get(name)
        return (spec.listed() or []) if spec is not None else []

    excluded = {quality_pair(pair) for pair in run.study.user_attrs.get(EXCLUDED, [])}
    pairs = [
        {"quantization": q, "kv_compression": kv}
        for q in values("quantization")
        for kv in values("kv_compression")
        if (q, float(kv)) not in excluded
    ]
    deployments = [{"deployment": d} for d in values("deployment")]
    return (pairs if len(pairs) > 1 else []) + (deployments if len(deployments) > 1 else [])


def trials_to_compare(study: optuna.Study, arm_knobs: tuple[str, ...]) -> int:
    """How many measured trials an arm needs to be compared: MIN_ARM_TRIALS, or one where the
    study searches no knob besides the arm's (its one trial is the arm's whole space)."""
    searched = {
        name
        for t in study.get_trials(deepcopy=False)
        for name, dist in t.distributions.items()
        if not dist.single()
    }
    return MIN_ARM_TRIALS if searched - set(arm_knobs) else 1


def in_arm(study: optuna.Study, trial: FrozenTrial, arm: dict[str, Any]) -> bool:
    return runs_arm(trial_knobs(study, trial), arm)


def pick_among(trials: list[FrozenTrial], scenario: Scenario) -> FrozenTrial | None:
    """The pick rule within the SLA-feasible ones of `trials`."""
    feasible = [t for t in trials if t.state == TrialState.COMPLETE and is_feasible(t.constraints)]
    key = pick_best(
        [(t.number, t.values[0], t.values[1]) for t in feasible],
        scenario.pick,
        scenario.tie_tolerance,
    )
    return next((t for t in feasible if t.number == key), None)


def arm_pick(study: optuna.Study, scenario: Scenario, arm: dict[str, Any]) -> FrozenTrial | None:
    """The pick rule within the SLA-feasible trials that run the arm (every trial for {})."""
    if not arm:
        return best_trial(study, scenario)
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return pick_among([t for t in trials if in_arm(study, t, arm)], scenario)
