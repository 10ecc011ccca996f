"""A chip budget's co-located trials started from one chip's study.

On `--chips N` a co-located config runs one chip's config N times, so the study of the same
scenario, runner, engine, model and hardware on one chip, in the same storage, has searched
the co-located side already, with every trial of its own. A chip-budget study splits its
trials between the deployments, half for each: on customer-service at 8 chips its co-located
half read 2,145-3,556 tok/s per chip over three seeds, where co-located replicas of one chip's
export reach 3,718-3,921 (bench/README), so the comparison it printed leaned on the seed. A
new chip-budget study therefore measures the one-chip study's best configs first, as
co-located trials, and on the simulator runs that study first where the storage has none.
The one-chip study's trials then count as co-located ones (tuner.study.balance_deployments),
so the chip-budget study's own trials go to the disaggregated side until it has as many.
"""

from __future__ import annotations

from typing import Any

import optuna
from optuna.trial import TrialState

from objectives.scoring import is_feasible, pick_best
from search_spaces.edges import inside
from tuner.prepare import Prepared
from tuner.study import ONE_CHIP_TRIALS, default_study_name, trial_knobs

STARTS = 3  # the one-chip study's feasible configs measured first, best first


def _applies(p: Prepared) -> bool:
    """A chip-budget study that searches both deployments, new (nothing measured or running:
    a queued --baseline may wait), and not a grid's (it measures its own points)."""
    spec = p.space.ranges.get("deployment")
    return (
        spec is not None
        and spec.choices is not None
        and "co-located" in spec.choices
        and not isinstance(p.study.sampler, optuna.samplers.GridSampler)
        and all(t.state == TrialState.WAITING for t in p.study.get_trials(deepcopy=False))
    )


def _one_chip_identity(p: Prepared) -> dict[str, str]:
    identity = p.study.user_attrs.get("identity") or {}
    return {k: v for k, v in identity.items() if k != "chips"}


def _feasible(study: optuna.Study) -> list:
    return [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if is_feasible(t.constraints)
    ]


def _one_chip_study(p: Prepared) -> optuna.Study | None:
    """The study of this one's scenario and identity less the chip budget with the most
    feasible trials, if any."""
    wanted, scenario = _one_chip_identity(p), p.study.user_attrs.get("scenario")
    found = [
        optuna.load_study(study_name=summary.study_name, storage=p.storage)
        for summary in optuna.get_all_study_summaries(p.storage, include_best_trial=False)
        if summary.user_attrs.get("identity") == wanted
        and summary.user_attrs.get("scenario") == scenario
    ]
    return max(found, key=lambda study: len(_feasible(study)), default=None)


def wants_one_chip_first(p: Prepared) -> bool:
    """A new simulated chip-budget study with no one-chip study to start its co-located trials
    from, and none under the one-chip study's default name (one of another scenario would
    refuse the run): one chip's study costs about a minute there, and settles the co-located
    side of the comparison the run prints. A real engine's costs hours: the run says how to
    give it one instead (seed_co_located)."""
    if p.runner.name != "sim" or not _applies(p) or _one_chip_study(p) is not None:
        return False
    name = default_study_name(p.scenario, _one_chip_identity(p))
    return name not in optuna.get_all_study_names(p.storage)


def _best_configs(study: optuna.Study, p: Prepared) -> list[tuple[int, dict[str, Any]]]:
    """Up to STARTS feasible trials' knobs, in the pick rule's order (ties as it breaks them)."""
    left = _feasible(study)
    chosen: list[tuple[int, dict[str, Any]]] = []
    while left and len(chosen) < STARTS:
        key = pick_best(
            [(t.number, t.values[0], t.values[1]) for t in left],
            p.scenario.pick,
            p.scenario.tie_tolerance,
        )
        trial = next(t for t in left if t.number == key)
        left.remove(trial)
        chosen.append((trial.number, trial_knobs(study, trial)))
    return chosen


def _as_co_located(p: Prepared, knobs: dict[str, Any]) -> dict[str, Any] | None:
    """The one-chip config as this run's co-located params; None where this run could not run
    it (a knob it fixes at another value, or a value outside its range)."""
    fixed, dists = p.space.fixed(), p.space.distributions()
    params: dict[str, Any] = {"deployment": "co-located"}
    for knob, value in knobs.items():
        if knob in fixed and knob != "deployment" and fixed[knob] != value:
            return None
        dist = dists.get(knob)
        if dist is not None and knob != "deployment":
            if not inside(dist, value):
                return None
            params[knob] = value
    return params


def seed_co_located(p: Prepared, limit: int) -> tuple[str | None, int]:
    """Queue the one-chip study's best configs as co-located trials of a new chip-budget study
    that searches both deployments; a line for the console (None where nothing applies) and
    how many were queued (at most `limit`, the study's share of the run's --trials), which the
    run measures first among its study's trials, as a night's warm start."""
    if not _applies(p):
        return None, 0
    source, name = _one_chip_study(p), p.study.study_name
    if source is None:
        return (
            f"no one-chip study of this scenario in the storage: study {name} searches "
            "co-located configs from scratch on half its trials (a run without --chips first "
            "gives them one chip's whole search)"
        ), 0
    best = _best_configs(source, p)[:limit]
    if not best:
        return f"study {source.study_name} (one chip) has no config that met the SLA", 0
    queued: list[str] = []
    seen: list[dict[str, Any]] = []
    for number, knobs in best:
        params = _as_co_located(p, knobs)
        if params is None or params in seen:
            continue
        seen.append(params)
        p.study.enqueue_trial(params, user_attrs={"seeded_from": f"{source.study_name}#{number}"})
        queued.append(f"#{number}")
    if not queued:
        return (
            f"study {source.study_name} (one chip): its best configs lie outside this run's "
            "space (a knob fixed at another value, or out of range)"
        ), 0
    # The seeds are measured again here, as this study's co-located trials: counted once.
    searched = len(source.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    p.study.set_user_attr(ONE_CHIP_TRIALS, max(0, searched - len(queued)))
    return (
        f"co-located starts from study {source.study_name} (one chip): its trials "
        f"{', '.join(queued)}, measured first; its {searched} trials count as co-located "
        f"ones, so up to {searched} of this study's next trials search disaggregated configs"
    ), len(queued)
