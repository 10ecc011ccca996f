"""A study: its creation, what its trials ran, its feasible front and pick, its snapshots
(tuner.trials runs the trials)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from objectives.scenario import Scenario
from objectives.scoring import (
    DIRECTIONS,
    is_feasible,
    objective_names,
    pick_best,
)
from runners.base import Runner
from search_spaces.space import SearchSpace
from tuner.assumptions import ATTR as ASSUMPTIONS
from tuner.quality import QualityBook
from tuner.quality_plan import default_book, default_scenario
from tuner.samplers import tpe
from tuner.storage import ensure_budget, save_snapshot
from tuner.study_guards import check_comparable

CONSTRAINTS_ATTR = "constraints"  # optuna.study._constrained_optimization's key
# Study attribute: where the last run's best config sits on an end of a searched range.
RANGE_EDGES = "range_edges"
# objectives.scoring.DIRECTIONS as Optuna takes them: TTFT p99 minimised, throughput maximised.
STUDY_DIRECTIONS = tuple(StudyDirection[direction.upper()] for direction in DIRECTIONS)
# A queued trial's user attribute: the capacity of a close config (the polish's pick, an arm's
# best), where its capacity search starts (runners.load.capacity.evaluate).
CAPACITY_HINT = "capacity_hint"
# With it, the rate below which the queued trial could change no export, ladder row or
# verdict: a miss there ends its search and the trial is PRUNED (tuner.pruning).
PRUNE_BELOW = "capacity_prune_below"


def default_study_name(scenario: Scenario, identity: dict[str, str]) -> str:
    parts = [
        scenario.name,
        identity["runner"],
        identity["engine"],
        identity["model"],
        identity["hardware"],
    ]
    if "chips" in identity:  # a chip budget other than one
        parts.append(f"{identity['chips']}chips")
    return ".".join(parts)


@dataclass
class TrialReport:
    number: int
    config: dict[str, Any]
    # "feasible", "violates-sla" (the latency SLA or the quality SLO), "infeasible", "fail",
    # "pruned" (its capacity lies below a rate it had to sustain to matter: PRUNE_BELOW)
    status: str
    values: tuple[float, float] | None = None
    reason: str = ""


@dataclass
class StudyRun:
    study: optuna.Study
    scenario: Scenario
    space: SearchSpace
    runner: Runner
    storage: optuna.storages.RDBStorage | None
    reports: list[TrialReport] = field(default_factory=list)
    screen: Any = None  # tuner.screen.Screen: the simulator proposes each trial's config
    # each trial's quality figure (default: the runner's model's shipped table)
    quality: QualityBook | None = None
    # A new sampler of the study's kind and settings, given a seed offset, for a side study's
    # proposals (propose_within); a run made without a plan gets TPE.
    new_sampler: Callable[[int], optuna.samplers.BaseSampler] = tpe

    def __post_init__(self):
        if self.quality is None:  # a run made without a plan (tests, benches)
            self.quality = default_book(self.study, self.runner)
            self.scenario = default_scenario(self.scenario, self.runner, self.space)


def create_study(
    storage: optuna.storages.RDBStorage,
    name: str,
    sampler: optuna.samplers.BaseSampler,
    scenario: Scenario,
    identity: dict[str, str],
    assumptions: dict[str, Any] | None = None,
    distributions: dict[str, Any] | None = None,
) -> optuna.Study:
    """Open (or start) the study and record what its trials are measured under; refused
    (InputError, before anything is written to an existing study) where that differs from
    what its trials were (tuner.study_guards, tuner.assumptions)."""
    study = optuna.create_study(
        storage=storage,
        study_name=name,
        sampler=sampler,
        directions=list(STUDY_DIRECTIONS),
        load_if_exists=True,
    )
    check_comparable(name, study, scenario, identity, assumptions, distributions)
    study.set_user_attr("scenario", scenario.model_dump(mode="json"))
    if assumptions:  # merged: a part only this run has (a quality table) joins the record
        study.set_user_attr(ASSUMPTIONS, study.user_attrs.get(ASSUMPTIONS, {}) | assumptions)
    with warnings.catch_warnings():  # experimental in Optuna; optuna-dashboard shows the names
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(list(objective_names(scenario)))
    study.set_user_attr("identity", identity)
    ensure_budget(storage, name, len(study.trials))
    return study


# A deployment's next trial: the first of this many proposals that no trial ran.
BALANCE_PROPOSALS = 4
# A chip-budget study's attribute: the trials of the one-chip study its co-located trials
# started from (tuner.one_chip), counted as co-located trials by balance_deployments.
ONE_CHIP_TRIALS = "one_chip_trials"
# The measured trials an arm (a deployment, a precision and KV pair) needs before the console
# and the report compare it (tuner.arms.trials_to_compare): fewer is "not compared".
MIN_ARM_TRIALS = 3


def ran_config(run: StudyRun, trial: FrozenTrial) -> dict[str, Any]:
    """The config a trial ran (or will run: queued), as the space settles params (config_of):
    what tells two trials of the same config."""
    if "knobs" in trial.user_attrs:
        return trial_knobs(run.study, trial)
    return run.space.config_of(trial.params)


def unmeasured(run: StudyRun, candidates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The candidate params whose config no trial of the study ran (or will run: queued), each
    once; two params that run the same config (a co-located trial's unused role knobs, a
    prefill batch clamped to the batch) are one."""
    seen = [ran_config(run, t) for t in run.study.get_trials(deepcopy=False)]
    out = []
    for params in candidates:
        config = run.space.config_of(params)
        if config not in seen:
            seen.append(config)
            out.append(params)
    return out


def propose_within(run: StudyRun, fixed: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """`n` params a new sampler of the study's kind proposes with the `fixed` knobs held
    (Optuna's PartialFixedSampler), shown only the study's finished trials that ran those
    values, in a side study in memory: what a knob is worth under one deployment or precision
    is not what it is worth under another. On 8 chips the study's good trials were
    disaggregated, whose decode instances hardly use the prefill batch, and the co-located
    trials its sampler proposed kept theirs at 1 or 2, far from one chip's best (bench/README)."""
    study = run.study
    # Seeded by the study's size: a sampler made afresh for each proposal would otherwise
    # draw its first, random, proposals alike.
    with warnings.catch_warnings():  # experimental in Optuna since 2.4, and as it was
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.PartialFixedSampler(fixed, run.new_sampler(len(study.trials)))
    side = optuna.create_study(directions=study.directions, sampler=sampler)
    # pruned trials too: Optuna's TPE counts them among the worse (tuner.pruning)
    for finished in study.get_trials(
        deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)
    ):
        if runs_arm(trial_knobs(study, finished), fixed):
            side.add_trial(finished)
    proposals = []
    for _ in range(n):
        proposed = side.ask()
        run.space.suggest(proposed)
        proposals.append(proposed.params)
    return proposals


def balance_deployments(run: StudyRun) -> None:
    """When a study searches both deployments on a chip budget, each trial runs the one that has
    fewer trials so far (co-located first on a tie), its other knobs proposed from that
    deployment's trials alone (propose_within): left to the sampler, a deployment that led
    early took nearly every trial (6 of 80 trials disaggregated, whose own study then found a
    better config); given the deployment but shown every trial, the sampler searched the other
    one where the leader's knobs were good (8 chips, customer-service, seed 0: co-located 2,439
    tok/s per chip, 3,556 proposed from its own trials).

    The one-chip study that co-located started from (ONE_CHIP_TRIALS) counts as co-located
    trials, since it searched that side already: given half the study instead, disaggregated
    read 3,037-3,856 tok/s per chip over three seeds. Each deployment first gets the
    MIN_ARM_TRIALS that a comparison needs of this study's own trials. Queued trials (a
    baseline, a screen's pick, a night's warm start) keep their own; a grid covers both."""
    study, space = run.study, run.space
    spec = space.ranges.get("deployment")
    if spec is None or spec.choices is None or len(spec.choices) < 2:
        return
    if isinstance(study.sampler, optuna.samplers.GridSampler):
        return
    trials = study.get_trials(deepcopy=False)
    if any(t.state == TrialState.WAITING for t in trials):
        return
    ran = {choice: 0 for choice in spec.choices}
    for t in trials:
        # A trial asked but not yet run (a batch's, tuner.trials) has its queued params only.
        deployment = t.params.get(
            "deployment", t.system_attrs.get("fixed_params", {}).get("deployment")
        )
        if deployment in ran:
            ran[deployment] += 1
    counts = dict(ran)
    if "co-located" in counts:
        counts["co-located"] += study.user_attrs.get(ONE_CHIP_TRIALS, 0)
    short = [choice for choice in ran if ran[choice] < MIN_ARM_TRIALS]
    if short:  # the sides take turns until each can be compared
        fewer = min(short, key=lambda choice: ran[choice])
    else:
        fewer = min(counts, key=lambda choice: counts[choice])
    proposals = propose_within(run, {"deployment": fewer}, BALANCE_PROPOSALS)
    study.enqueue_trial((unmeasured(run, proposals) or proposals)[0])


def has_running_trials(study: optuna.Study) -> bool:
    return bool(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))


def trial_knobs(study: optuna.Study, trial: FrozenTrial) -> dict[str, Any]:
    """Every knob of a trial, as it ran: stored on the trial itself, since each run of a study
    may hold other knobs fixed (studies from before that fall back to the study's record)."""
    if "knobs" in trial.user_attrs:
        return dict(trial.user_attrs["knobs"])
    return study.user_attrs.get("fixed_knobs", {}) | trial.params


def runs_arm(config: dict[str, Any], arm: dict[str, Any]) -> bool:
    """Whether a config (knob values as the space settles them) runs the arm's values."""
    return all(config.get(name) == value for name, value in arm.items())


def feasible_front(study: optuna.Study) -> list[FrozenTrial]:
    """Optuna's best_trials are the Pareto front of the feasible trials when constraints exist."""
    front = [t for t in study.best_trials if is_feasible(t.constraints)]
    return sorted(front, key=lambda t: t.values[0])


# Study attribute: the pick made on repeated measurements (tuner.repeats), which stands while
# the study has no newer complete trial.
REPEATS_ATTR = "repeats"


# Study attribute: the last hold (tuner.hold), whose choice stands likewise.
HOLD_ATTR = "hold"


# Each record is kept twice: as the study's latest (which best_trial follows) and under the
# trial it decided for ("hold:7"), so another run's newer record cannot change what `autotune
# export` or `report` states for a trial this run held or repeated.
def keep_hold(study: optuna.Study, result: dict[str, Any]) -> None:
    study.set_user_attr(f"{HOLD_ATTR}:{result['trial']}", result)
    study.set_user_attr(HOLD_ATTR, result)


def keep_repeats(study: optuna.Study, result: dict[str, Any]) -> None:
    for number in result["trials"]:
        study.set_user_attr(f"{REPEATS_ATTR}:{number}", result)
    study.set_user_attr(REPEATS_ATTR, result)


def hold_of(study: optuna.Study, trial: int) -> dict[str, Any] | None:
    """The latest hold that chose `trial` (a study kept before per-trial records: its last
    hold, where it chose the trial)."""
    latest = study.user_attrs.get(HOLD_ATTR)
    fallback = latest if latest is not None and latest.get("trial") == trial else None
    return study.user_attrs.get(f"{HOLD_ATTR}:{trial}", fallback)


def repeats_of(study: optuna.Study, trial: int) -> dict[str, Any] | None:
    """The latest repeats that measured `trial` again, likewise."""
    latest = study.user_attrs.get(REPEATS_ATTR)
    fallback = latest if latest is not None and str(trial) in latest["trials"] else None
    return study.user_attrs.get(f"{REPEATS_ATTR}:{trial}", fallback)


def best_trial(
    study: optuna.Study, scenario: Scenario, repeated: bool = True, held: bool = True
) -> FrozenTrial | None:
    """The pick rule's choice on the feasible front; with `held`, the config the hold
    exported, and with `repeated`, the pick tuner.repeats made on the worst of repeated
    measurements, where they still stand."""
    hold = study.user_attrs.get(HOLD_ATTR) if held else None
    if hold is not None and "complete_trials" in hold:
        # The hold's choice, where it held the pick the study would make without it.
        unheld = best_trial(study, scenario, repeated, held=False)
        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if hold["complete_trials"] == len(done) and unheld and hold["picked"] == unheld.number:
            return next(t for t in done if t.number == hold["trial"])
    decided: dict[str, Any] | None = study.user_attrs.get(REPEATS_ATTR) if repeated else None
    if decided is not None:
        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if decided["complete_trials"] == len(done):
            return next(t for t in done if t.number == decided["pick"])
    front = feasible_front(study)
    key = pick_best(
        [(t.number, t.values[0], t.values[1]) for t in front], scenario.pick, scenario.tie_tolerance
    )
    return None if key is None else next(t for t in front if t.number == key)


def snapshot(
    study: optuna.Study,
    scenario: Scenario,
    storage: optuna.storages.RDBStorage,
    best: FrozenTrial | None = None,
) -> int:
    """Save the front; `best`: the run's answer (None: the pick rule's, as the study keeps its
    hold and repeats)."""
    front = feasible_front(study)
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    best = best if best is not None else best_trial(study, scenario)
    feasible = sum(1 for t in done if is_feasible(t.constraints))
    members = [(t, trial_knobs(study, t)) for t in front]
    return save_snapshot(
        storage,
        study.study_name,
        members,
        len(study.trials),
        feasible,
        best.number if best else None,
    )
