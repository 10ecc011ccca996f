"""A chip budget's co-located trials started from one chip's study.

On `--chips N` a co-located config runs one chip's config N times, so the study of the same
scenario, runner, engine, model and hardware on one chip, in the same storage, has searched
the co-located side already, with every trial of its own. A chip-budget study splits its
trials between the deployments, half for each: on customer-service at 8 chips its co-located
half read 2,145-3,556 tok/s per chip by seed, where one chip's study reaches 3,588-3,718
(bench/README), so the comparison it printed leaned on the seed. A new chip-budget study
therefore measures the one-chip study's best configs first, as co-located trials.
"""

from __future__ import annotations

from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import TrialState

from objectives.scoring import is_feasible, pick_best
from tuner.prepare import Prepared
from tuner.study import trial_knobs

SEEDS = 3  # the one-chip study's feasible configs measured first, best first


def _one_chip_study(p: Prepared) -> optuna.Study | None:
    """The study of this one's scenario and identity, less the chip budget, if any."""
    identity = p.study.user_attrs.get("identity") or {}
    wanted = {k: v for k, v in identity.items() if k != "chips"}
    scenario = p.study.user_attrs.get("scenario")
    for summary in optuna.get_all_study_summaries(p.storage, include_best_trial=False):
        attrs = summary.user_attrs
        if attrs.get("identity") == wanted and attrs.get("scenario") == scenario:
            return optuna.load_study(study_name=summary.study_name, storage=p.storage)
    return None


def _best_configs(study: optuna.Study, p: Prepared) -> list[tuple[int, dict[str, Any]]]:
    """Up to SEEDS feasible trials' knobs, the pick rule's order (ties as the rule breaks them)."""
    left = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if is_feasible(t.constraints)
    ]
    chosen: list[tuple[int, dict[str, Any]]] = []
    while left and len(chosen) < SEEDS:
        key = pick_best(
            [(t.number, t.values[0], t.values[1]) for t in left],
            p.scenario.pick,
            p.scenario.tie_tolerance,
        )
        trial = next(t for t in left if t.number == key)
        left.remove(trial)
        chosen.append((trial.number, trial_knobs(study, trial)))
    return chosen


def _inside(dist: BaseDistribution, value: Any) -> bool:
    if isinstance(dist, CategoricalDistribution):
        return value in dist.choices
    assert isinstance(dist, (IntDistribution, FloatDistribution))
    return dist.low <= value <= dist.high


def wants_one_chip_first(p: Prepared) -> bool:
    """A new simulated study on a chip budget that searches both deployments, with no one-chip
    study to start its co-located trials from: one chip's study costs about a minute there,
    and settles the co-located side of the comparison the run prints. A real engine's costs
    hours: the run says how to give it one instead (seed_co_located)."""
    spec = p.space.ranges.get("deployment")
    return (
        p.runner.name == "sim"
        and not isinstance(p.study.sampler, optuna.samplers.GridSampler)
        and spec is not None
        and spec.choices is not None
        and "co-located" in spec.choices
        and not p.study.trials
        and _one_chip_study(p) is None
    )


def seed_co_located(p: Prepared) -> tuple[str | None, int]:
    """Queue the one-chip study's best configs as co-located trials of a new chip-budget study
    that searches both deployments (not a grid's: it measures its own points); a line for the
    console (None where nothing applies) and how many were queued, which the run measures on
    top of its --trials, as a night's warm start."""
    spec = p.space.ranges.get("deployment")
    if (
        spec is None
        or spec.choices is None
        or "co-located" not in spec.choices
        or p.study.trials
        or isinstance(p.study.sampler, optuna.samplers.GridSampler)
    ):
        return None, 0
    source = _one_chip_study(p)
    name = p.study.study_name
    if source is None:
        return (
            f"no one-chip study of this scenario in the storage: study {name} searches "
            "co-located configs from scratch on half its trials (a run without --chips first "
            "gives them one chip's whole search)"
        ), 0
    dists = p.space.distributions()
    queued = []
    for number, knobs in _best_configs(source, p):
        params = {"deployment": "co-located"}
        for knob, value in knobs.items():
            dist = dists.get(knob)
            if dist is not None and knob != "deployment":
                if not _inside(dist, value):
                    break  # outside this run's space: not a config it searches
                params[knob] = value
        else:
            p.study.enqueue_trial(
                params, user_attrs={"seeded_from": f"{source.study_name}#{number}"}
            )
            queued.append(f"#{number}")
    if not queued:
        return f"study {source.study_name} (one chip) has no config inside this run's space", 0
    return (
        f"co-located starts from study {source.study_name} (one chip): its trials "
        f"{', '.join(queued)}, measured first"
    ), len(queued)
