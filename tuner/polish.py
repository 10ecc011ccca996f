"""Polish: no export that changing one knob beats.

A sampler leaves its best config wherever its last proposal landed; a neighbour one knob away
may meet every SLO and do better under the pick rule (content-generation exported w8a16 where
the same knobs at bf16 were better on throughput and quality alike). Before exporting, the
pick's one-knob neighbourhood is measured: each categorical knob's other values, each numeric
knob one step either way (a log-scaled knob by NUMERIC_LOG_STEP, a linear one by a fifth of its
range, the grid's interval, rounded to its own step and one step at least: on up to 9 chips
prefill_instances moves by 1). The neighbour the pick rule prefers among the pick and its
neighbours (objectives.scoring.pick_best) becomes the pick if it is better by more than
MIN_GAIN, and its neighbourhood is measured in turn, until none beats the pick or the budget of
trials is spent. A disaggregated pick first climbs the knobs that balance its roles alone (its
split, decode taking the rest of the chips, and the prefill instances' batch), which decide
that deployment most.

Comparisons get the same treatment (refine_arms): each arm the console and report compare (a
precision and KV pair of the quality ladder, a deployment on a chip budget) is measured with
the best config so far and only the arm changed (across deployments,
search_spaces.deployment.as_deployment, its split climbed from the middle), then its own pick
is polished a little, so no statement stands on whichever arm the sampler happened to visit.
What the pick's polish leaves goes to the deployment that trails the pick, whose distance from
it is the printed verdict's margin.

The neighbours are ordinary trials of the study (enqueued, then run as any other), so the front,
the report and later runs see them, and a neighbour measured before is not measured again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import FrozenTrial, TrialState

from objectives.scenario import Scenario
from objectives.scoring import is_feasible, pick_best
from runners.quality import quality_pair
from search_spaces.deployment import as_deployment, is_disaggregated
from search_spaces.space import GRID_POINTS, ROLE_KNOBS, SearchSpace, nearest_value
from tuner.quality import EXCLUDED
from tuner.study import (
    MIN_ARM_TRIALS,
    StudyRun,
    TrialReport,
    best_trial,
    has_running_trials,
    optimize,
    propose_within,
    ran_config,
    trial_knobs,
    unmeasured,
)

NUMERIC_LOG_STEP = 1.25  # a log-scaled knob's neighbours: times and divided by this
# Default budgets: a simulated trial costs about a second, so the simulator polishes until no
# neighbour wins; a real engine's trial costs minutes, so one neighbourhood and a bit.
SIM_POLISH_TRIALS = 60
REAL_POLISH_TRIALS = 12
# Of that budget, each arm compared (refine_arms) gets at most this many: its controlled trial
# and a short polish. An arm with fewer measured trials than MIN_ARM_TRIALS is "not compared".
ARM_TRIALS = 6
MIN_GAIN = 0.01  # how much better a neighbour must be to move the pick and the climb on
# A chip budget's split between the roles (decode_instances is the rest unless searched), and
# with the prefill instances' batch, the knobs that balance prefill against decode.
SPLIT_KNOBS = ("prefill_instances", "decode_instances")
BALANCE_KNOBS = (*SPLIT_KNOBS, "prefill_batch_size")


@dataclass
class Polish:
    """What the polish did: trials run, each change of the pick (`from -> to: knob`), and why
    it ran none where it did not."""

    trials: int = 0
    changes: list[str] = field(default_factory=list)
    idle: str = "no one-knob neighbour left to measure"

    def summary(self) -> str:
        if self.trials == 0:
            return f"polish: {self.idle}"
        changed = "; ".join(self.changes) or "the pick stands"
        return f"polish: {self.trials} one-knob neighbour trials; {changed}"


def _steps(dist: BaseDistribution, value: Any) -> list[Any]:
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
        out += [params | {name: value} for value in _steps(dist, params[name])]
    return out


def _difference(before: dict[str, Any], after: dict[str, Any]) -> str:
    return ", ".join(
        f"{name} {before.get(name)} -> {after[name]}"
        for name in after
        if before.get(name) != after[name]
    )


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
    knobs = trial_knobs(study, trial)
    return all(knobs.get(name) == value for name, value in arm.items())


def _beats(new: FrozenTrial, old: FrozenTrial, scenario: Scenario) -> bool:
    """Whether the pick rule's new choice is better than the old by more than MIN_GAIN on the
    objective the rule ranks first (a neighbour 0.01% ahead is the same config, not a win)."""
    if new.number == old.number:
        return False
    if scenario.pick == "min-ttft":
        return new.values[0] < old.values[0] * (1 - MIN_GAIN)
    return new.values[1] > old.values[1] * (1 + MIN_GAIN)


def _pick_among(trials: list[FrozenTrial], scenario: Scenario) -> FrozenTrial | None:
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
    return _pick_among([t for t in trials if in_arm(study, t, arm)], scenario)


def measured(run: StudyRun, candidates: list[dict[str, Any]]) -> list[FrozenTrial]:
    """The complete trials that ran the candidate params' configs (unmeasured's converse)."""
    wanted = [run.space.config_of(params) for params in candidates]
    return [
        t
        for t in run.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if ran_config(run, t) in wanted
    ]


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


@dataclass
class Polisher:
    """The search after a study's trials: the run, the progress callback, and the time the
    run's --timeout leaves (None: no limit)."""

    run: StudyRun
    on_trial: Callable[[TrialReport], None] = lambda report: None
    deadline: float | None = None

    def _left_s(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def _may_run(self) -> bool:
        """Time is left and no other run adds trials to the study now (a trial of its is
        running): queued trials are popped by whichever run asks first (on SQLite two can pop
        the same one), so this run gives way and a later plain run on the study polishes it."""
        left = self._left_s()
        return (left is None or left > 0) and not has_running_trials(self.run.study)

    def _optimize(self, n: int) -> int:
        """Run `n` trials for real (the screen, if any, stands aside); how many ran."""
        before = len(self.run.reports)
        optimize(replace(self.run, screen=None), n, self._left_s(), self.on_trial)
        return len(self.run.reports) - before

    def run_queued(self, todo: list[dict[str, Any]]) -> int:
        """Measure the params; how many ran (none unless _may_run)."""
        if not todo or not self._may_run():
            return 0
        for params in todo:
            self.run.study.enqueue_trial(params)
        return self._optimize(len(todo))

    def polish(self, budget: int, arm: dict[str, Any] | None = None) -> Polish:
        """Measure the pick's one-knob neighbours until none beats it (the module's rule), at
        most `budget` trials; a disaggregated pick's BALANCE_KNOBS first, alone. With an `arm`
        (knob values held fixed: a precision and KV pair, a deployment), the pick is the arm's
        own and its knobs stay as they are."""
        arm = arm or {}
        result = Polish()
        pick = arm_pick(self.run.study, self.run.scenario, arm)
        if pick is None:
            result.idle = "no SLA-feasible pick to start from"
            return result
        if is_disaggregated(pick.params):
            # A disaggregated pick climbs the knobs that balance its roles first: they decide
            # that deployment most, and an arm's polish (ARM_TRIALS) has a few trials, which
            # the whole neighbourhood spent on the knobs listed first (customer-service on 8
            # chips: two seeds' disaggregated arms stopped at 5P3D, 73% of 4P4D's capacity;
            # short prompts, seed 2: 3P5D at a prefill batch of 13, 95% of what 20 gives).
            pick = self._climb(pick, budget, tuple(arm), BALANCE_KNOBS, result)
        self._climb(pick, budget, tuple(arm), None, result)
        return result

    def climb(self, params: dict[str, Any], knobs: tuple[str, ...], budget: int) -> int:
        """From the trial that ran `params`, one of `knobs` stepped while a step wins (_climb),
        whether or not that trial is any arm's pick; how many trials ran."""
        start = next(iter(measured(self.run, [params])), None)
        result = Polish()
        if start is not None:
            self._climb(start, budget, (), knobs, result)
        return result.trials

    def _climb(
        self,
        here: FrozenTrial,
        budget: int,
        frozen: tuple[str, ...],
        only: tuple[str, ...] | None,
        result: Polish,
    ) -> FrozenTrial:
        """From trial `here`, to the best of its one-knob neighbours (neighbours' `frozen` and
        `only`) while that beats where the climb stands (the module's rule; any SLA-feasible
        step beats an infeasible start), until `result` counts `budget` trials. The trials and
        changes go to `result`; where the climb stopped is returned."""
        scenario = self.run.scenario
        while result.trials < budget:
            steps = neighbours(self.run.space, here.params, frozen, only)
            todo = unmeasured(self.run, steps)
            ran = self.run_queued(todo[: budget - result.trials])
            result.trials += ran
            if todo and ran == 0:
                result.idle = "no time left, or another run is adding trials to the study"
            # A step that runs as `here` does (a prefill batch clamped to the batch) is no move.
            stays = ran_config(self.run, here)
            moves = [t for t in measured(self.run, steps) if ran_config(self.run, t) != stays]
            best = _pick_among([here, *moves], scenario)
            if best is None or (is_feasible(here.constraints) and not _beats(best, here, scenario)):
                break
            result.changes.append(
                f"trial {here.number} -> {best.number} ({_difference(here.params, best.params)})"
            )
            here = best
        return here

    def polish_trailing_deployment(self, compared: list[dict[str, Any]], budget: int) -> str:
        """The deployment arm of `compared` whose pick trails the study's pick, polished with
        `budget` (what the pick's own polish left): the printed verdict's margin is that pick's
        distance from the leader, and the leader's pick is the polished one already. What ran,
        as a clause for the console ("" when nothing did)."""
        best = best_trial(self.run.study, self.run.scenario)
        if best is None or budget <= 0:
            return ""
        leader = best.params.get("deployment")
        trailing = [
            arm
            for arm in compared
            if set(arm) == {"deployment"}
            and arm["deployment"] != leader
            and arm_pick(self.run.study, self.run.scenario, arm) is not None
        ]
        if leader is None or not trailing:
            return ""
        result = self.polish(budget, trailing[0])
        if result.trials == 0:
            return ""
        changed = "; ".join(result.changes) or "its pick stands"
        now = best_trial(self.run.study, self.run.scenario)
        ahead = now is not None and now.params.get("deployment") != leader
        behind = "was behind, now ahead" if ahead else "behind"
        return f"; {trailing[0]['deployment']} ({behind}): {result.trials} more trials, {changed}"

    def run_sampled(self, arm: dict[str, Any], n: int) -> int:
        """`n` trials proposed within the arm (tuner.study.propose_within): the arm searched
        where its own trials point, not only one knob from where the controlled trial landed.
        How many ran (none when time is up or another run adds trials, as run_queued)."""
        if n <= 0 or not self._may_run():
            return 0
        return self.run_queued(unmeasured(self.run, propose_within(self.run, arm, n)))

    def refine_arms(self, compared: list[dict[str, Any]], per_arm: int) -> int:
        """Search each arm of `compared` (`arms`) a little, so that what the console and report
        compare stands on both sides: first the best config so far with only the arm
        changed (a controlled comparison; across deployments as_deployment's, whose split
        is then climbed), then half the rest proposed within the arm by
        a new sampler shown only the arm's trials (propose_within), then the arm's own
        pick polished. At most `per_arm` trials an arm; how many ran."""
        ran = 0
        for arm in compared:
            best = best_trial(self.run.study, self.run.scenario)
            if best is None:  # nothing met the SLA: no statement compares arms
                break
            controlled = best.params | {k: v for k, v in arm.items() if k in best.params}
            deployed = best.params.get("deployment")
            crossing = arm.get("deployment", deployed) != deployed
            if crossing:
                controlled = as_deployment(self.run.space, best.params, arm["deployment"])
            done = self.run_queued(unmeasured(self.run, [controlled]))
            if crossing and is_disaggregated(controlled):
                # A co-located config's split means nothing: the controlled trial's is
                # climbed from the middle before the comparison stands on it.
                done += self.climb(controlled, SPLIT_KNOBS, per_arm - done)
            ran, budget = ran + done, per_arm - done
            done = self.run_sampled(arm, budget // 2)
            ran, budget = ran + done, budget - done
            ran += self.polish(budget, arm).trials
        return ran


def refine_and_polish(
    run: StudyRun,
    budget: int,
    on_trial: Callable[[TrialReport], None] = lambda report: None,
    deadline: float | None = None,
) -> str:
    """After a study's trials, at most `budget` more before `deadline`: each compared arm
    searched (refine_arms, ARM_TRIALS each at most, leaving a share for the pick), then the
    pick polished, then with what is left the trailing deployment's pick. What ran, in one
    line for the console. A grid measures its points itself: nothing runs after it."""
    if isinstance(run.study.sampler, optuna.samplers.GridSampler):
        return "polish: none after a grid, which measured every point it has"
    polisher = Polisher(run, on_trial, deadline)
    compared = arms(run)
    per_arm = min(ARM_TRIALS, budget // (len(compared) + 1))
    refined = polisher.refine_arms(compared, per_arm) if per_arm else 0
    polished = polisher.polish(budget - refined)
    left = budget - refined - polished.trials
    trailing = polisher.polish_trailing_deployment(compared, left) if per_arm else ""
    if not per_arm:
        return polished.summary()
    return (
        f"arms: {refined} trials searched {len(compared)} arms (each precision and KV pair, "
        f"each deployment) from the best config so far; {polished.summary()}{trailing}"
    )
