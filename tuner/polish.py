"""Polish: no export that changing one knob beats.

A sampler leaves its best config wherever its last proposal landed; a neighbour one knob away
may meet every SLO and do better under the pick rule (content-generation exported w8a16 where
the same knobs at bf16 were better on throughput and quality alike). Before exporting, the
pick's one-knob neighbourhood (tuner.neighbourhood; on up to 9 chips prefill_instances moves by
1) is measured. The neighbour the pick rule prefers among the pick and its neighbours
(objectives.scoring.pick_best) becomes the pick if it is better by more than MIN_GAIN, and its
neighbourhood is measured in turn, until none beats the pick or the budget of trials is spent.
A round measures the knobs the arms did not search first, a run of wins on one knob speeds up,
and a climb that stops where a scheduling policy or cache setting ties goes on from that tie
once (Polisher._climb). A neighbour's capacity search starts from its neighbour's capacity
(CAPACITY_HINT); on the simulator a step that cannot beat where the climb stands, nor its
arm's pick, is pruned once that is certain (PRUNE_BELOW, tuner.pruning). A
disaggregated pick first climbs the knobs that balance its roles alone (its split, decode
taking the rest of the chips, and the prefill instances' batch), which decide that
deployment most.

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
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from objectives.scenario import Scenario
from objectives.scoring import is_feasible
from search_spaces.deployment import as_deployment, is_disaggregated
from tuner.arms import arm_pick, arms, pick_among
from tuner.neighbourhood import change, farther, neighbours
from tuner.pruning import prune_bounds
from tuner.study import (
    CAPACITY_HINT,
    PRUNE_BELOW,
    StudyRun,
    TrialReport,
    best_trial,
    has_running_trials,
    propose_within,
    ran_config,
    unmeasured,
)
from tuner.trials import discard_queued, optimize, waiting_ids

# Default budgets: a simulated trial costs about a second, so the simulator polishes until no
# neighbour wins (a climb's trial, its capacity searched from its neighbour's, a third of one);
# a real engine's trial costs minutes, so one neighbourhood and a bit. At 60 a climb ran out:
# customer-service with 4 system prompts, seed 1, held 52.06 req/s after 24 trials of the
# pick's own, and 57.08 after 48, as seed 0's export.
SIM_POLISH_TRIALS = 100
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
    pruned: int = 0  # of the trials, those whose search stopped once they could not win

    def summary(self) -> str:
        if self.trials == 0:
            return f"polish: {self.idle}"
        changed = "; ".join(self.changes) or "the pick stands"
        pruned = f" ({self.pruned} pruned)" if self.pruned else ""
        return f"polish: {self.trials} one-knob neighbour trials{pruned}; {changed}"


def _beats(new: FrozenTrial, old: FrozenTrial, scenario: Scenario) -> bool:
    """Whether the pick rule's new choice is better than the old by more than MIN_GAIN on the
    objective the rule ranks first (a neighbour 0.01% ahead is the same config, not a win)."""
    if new.number == old.number:
        return False
    if scenario.pick == "min-ttft":
        return new.values[0] < old.values[0] * (1 - MIN_GAIN)
    return new.values[1] > old.values[1] * (1 + MIN_GAIN)


def measured(run: StudyRun, candidates: list[dict[str, Any]]) -> list[FrozenTrial]:
    """The complete trials that ran the candidate params' configs (unmeasured's converse)."""
    wanted = [run.space.config_of(params) for params in candidates]
    return [
        t
        for t in run.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if ran_config(run, t) in wanted
    ]


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

    def why_idle(self) -> str:
        """Why _may_run said no, exactly."""
        left = self._left_s()
        if left is not None and left <= 0:
            return "no time left (--timeout): the pick is exported unpolished"
        return (
            "another run was adding trials to the study, so this one gave way: the pick is "
            "exported unpolished (a later plain run on the study polishes it)"
        )

    def _optimize(self, n: int) -> int:
        """Run `n` trials for real (the screen, if any, stands aside); how many ran."""
        before = len(self.run.reports)
        optimize(replace(self.run, screen=None), n, self._left_s(), self.on_trial)
        return len(self.run.reports) - before

    def run_queued(
        self, todo: list[dict[str, Any]], near: FrozenTrial | None = None, prune: bool = False
    ) -> int:
        """Measure the params; how many ran (none unless _may_run). Their capacity searches
        start from `near`'s capacity (a trial of a close config): the same answer, sooner.
        With `prune` (a climb's steps from `near`, an arm's proposals against its pick `near`),
        a step that can change no export, ladder row or verdict is pruned once that is certain
        (tuner.pruning)."""
        if not todo or not self._may_run():
            return 0
        study = self.run.study
        hint = None if near is None else near.user_attrs.get("capacity_rate")
        before = waiting_ids(study)
        for params in todo:
            attrs = {CAPACITY_HINT: hint} if hint else {}
            bounds = prune_bounds(self.run, near, params) if prune and near is not None else None
            if bounds is not None:
                attrs = {CAPACITY_HINT: bounds[0], PRUNE_BELOW: bounds[1]}
            study.enqueue_trial(params, user_attrs=attrs or None)
        queued = waiting_ids(study) - before
        try:
            return self._optimize(len(todo))
        finally:
            discard_queued(self.run, queued)

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
        changes go to `result`; the highest trial the climb reached is returned (a sideways
        step that led nowhere is not it, nor in the changes).

        Each round measures the steps of the knobs the arms did not search first, with the
        last move's knob stepped twice as far again (farther), and the arms' knobs (precision,
        KV, deployment: each arm's own pick was searched already) only when none of those wins:
        a move then costs a part of the neighbourhood, and the last stand all of it. Where no
        step wins, the climb may go on from a tie once per stand (_sideways)."""
        searched = {name for arm in arms(self.run) for name in arm}
        space, last, peak = self.run.space, None, here
        path: list[str] = []  # a sideways step taken from the peak, kept if a win follows
        visited = [ran_config(self.run, here)]
        while result.trials < budget:
            near = neighbours(space, here.params, (*frozen, *searched), only)
            if last is not None:
                near += farther(space, *last)
            best, moves = self._best_step(here, near, budget, result)
            if not self._wins(best, here, peak):
                every = near + neighbours(space, here.params, frozen, only)
                best, moves = self._best_step(here, every, budget, result)
            if best is not None and self._wins(best, here, peak):
                result.changes += [*path, change(here, best)]
                path, step, peak = [], best, best
            else:
                sideways = self._sideways(here, moves, visited, searched)
                if sideways is None or here.number != peak.number:
                    break
                path.append(change(here, sideways, ", a tie"))
                step = sideways
            visited.append(ran_config(self.run, step))
            last, here = (here.params, step.params), step
        return peak

    def _sideways(
        self,
        here: FrozenTrial,
        moves: list[FrozenTrial],
        visited: list[dict[str, Any]],
        searched: set[str],
    ) -> FrozenTrial | None:
        """Where a climb that no step wins goes on from, once: the pick rule's choice among
        the measured steps that tie with `here` (within MIN_GAIN) by changing a categorical
        knob the arms did not search (the scheduling policy, the prefix cache), which opens a
        landscape of its own. On capacity's grid of rates ties are common: code-completion's
        pick, batch 51 prefill-first, read 14.05 req/s as decode-first did, from which the
        batch climbed to 101 and the prefill batch to 5: 17.45 req/s."""
        dists = self.run.space.distributions()

        def categorical_step(trial: FrozenTrial) -> bool:
            changed = [k for k in trial.params if here.params.get(k) != trial.params[k]]
            return all(
                isinstance(dists.get(k), CategoricalDistribution) and k not in searched
                for k in changed
            )

        ties = [
            t
            for t in moves
            if is_feasible(t.constraints)
            and not _beats(here, t, self.run.scenario)
            and categorical_step(t)
            and ran_config(self.run, t) not in visited
        ]
        return pick_among(ties, self.run.scenario)

    def _best_step(
        self, here: FrozenTrial, steps: list[dict[str, Any]], budget: int, result: Polish
    ) -> tuple[FrozenTrial | None, list[FrozenTrial]]:
        """The steps not measured yet run (within `budget`, counted in `result`); the pick
        rule's choice among `here` and the steps that run a config other than its own, and
        those steps' trials."""
        todo = unmeasured(self.run, steps)
        before = len(self.run.reports)
        ran = self.run_queued(todo[: budget - result.trials], here, prune=True)
        result.trials += ran
        result.pruned += sum(r.status == "pruned" for r in self.run.reports[before:])
        if todo and ran == 0:
            result.idle = self.why_idle()
        # A step that runs as `here` does (a prefill batch clamped to the batch) is no move.
        stays = ran_config(self.run, here)
        moves = [t for t in measured(self.run, steps) if ran_config(self.run, t) != stays]
        return pick_among([here, *moves], self.run.scenario), moves

    def _wins(self, best: FrozenTrial | None, here: FrozenTrial, peak: FrozenTrial) -> bool:
        """Whether the climb moves from `here` to `best`: any SLA-feasible step beats an
        infeasible start; otherwise by the module's rule, against `here` and the climb's
        `peak` alike (from a sideways step, a win has to beat the peak too, not only the tie
        below it)."""
        if best is None:
            return False
        return all(
            not is_feasible(start.constraints) or _beats(best, start, self.run.scenario)
            for start in (here, peak)
        )

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
        A proposal that cannot beat the arm's pick is pruned (tuner.pruning): it is there to
        find a better one. How many ran (none when time is up or another run adds trials,
        as run_queued)."""
        if n <= 0 or not self._may_run():
            return 0
        proposals = unmeasured(self.run, propose_within(self.run, arm, n))
        pick = arm_pick(self.run.study, self.run.scenario, arm)
        return self.run_queued(proposals, pick, prune=True)

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
            near = arm_pick(self.run.study, self.run.scenario, arm) or best
            done = self.run_queued(unmeasured(self.run, [controlled]), near)
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
    phase: Callable[[str], AbstractContextManager[None]] = lambda name: nullcontext(),
) -> str:
    """After a study's trials, at most `budget` more before `deadline`: each compared arm
    searched (refine_arms, ARM_TRIALS each at most, leaving a share for the pick), then the
    pick polished, then with what is left the trailing deployment's pick. What ran, in one
    line for the console. A grid measures its points itself: nothing runs after it. `phase`
    times the arms and the polish."""
    if isinstance(run.study.sampler, optuna.samplers.GridSampler):
        return "polish: none after a grid, which measured every point it has"
    polisher = Polisher(run, on_trial, deadline)
    compared = arms(run)
    per_arm = min(ARM_TRIALS, budget // (len(compared) + 1))
    with phase("arms"):
        refined = polisher.refine_arms(compared, per_arm) if per_arm else 0
    with phase("polish"):
        polished = polisher.polish(budget - refined)
        left = budget - refined - polished.trials
        trailing = polisher.polish_trailing_deployment(compared, left) if per_arm else ""
    if not per_arm:
        return polished.summary()
    return (
        f"arms: {refined} trials searched {len(compared)} arms (each precision and KV pair, "
        f"each deployment) from the best config so far; {polished.summary()}{trailing}"
    )
