"""Pruning a step the run measures only to see whether it wins (tuner.polish): a climb's step,
an arm's sampled proposal. Such a step changes the export, a ladder row or a verdict only if it
beats the trial it steps from (or the arm's pick it was proposed against) or the pick of an arm
it runs; once its capacity search shows it cannot, the rest of the search is waste. The trial
ends PRUNED (tuner.study.PRUNE_BELOW, runners.load.bracket), counted as a trial of its arms but
on no Pareto front: its TTFT at the nominal rate is measured, its throughput only bounded."""

from __future__ import annotations

from typing import Any

from optuna.trial import FrozenTrial

from objectives.scoring import is_feasible
from tuner.arms import arm_pick, arms
from tuner.study import StudyRun, runs_arm

# A step is searched only down to this far below the least capacity it must reach to change
# an export, a ladder row or a verdict (prune_bounds): a miss there prunes it. The pick rule
# ranks throughput at capacity, which a window's ramp and drain move by up to ~11% at one rate
# (customer-service, 40.36 req/s: 4,475 tok/s on a 1,000-request window, 4,988 on 4,000); a
# step pruned here missed at the grid point at or below 85% (at the default tie tolerance,
# 84% of the rate at 5% precision), so its capacity lies more than 16% below.
PRUNE_MARGIN = 0.15


def prune_bounds(
    run: StudyRun, here: FrozenTrial, params: dict[str, Any]
) -> tuple[float, float] | None:
    """Where the step from `here` to `params` is searched from, and the rate PRUNE_MARGIN below
    it at which a miss prunes it; None where it is searched whole. The step matters if it beats
    `here` (where the climb stands, or the arm's pick a proposal was made against) or the pick
    of an arm it runs (the ladder's row, the deployments' verdict): the least of those
    capacities. Only on the simulator, whose one miss is the verdict (a real engine's capacity
    varies between draws, and a rival within that variation is measured again:
    tuner.repeats), under max-throughput (a step slower at capacity may still win min-ttft),
    from an SLA-feasible `here` (any feasible step beats an infeasible one), and where each
    such arm has a pick (else the step may be its first feasible trial)."""
    rate = here.user_attrs.get("capacity_rate")
    if (
        run.runner.name != "sim"
        or run.scenario.pick != "max-throughput"
        or rate is None
        or not is_feasible(here.constraints)
    ):
        return None
    config = run.space.config_of(params)
    for arm in arms(run):
        if runs_arm(config, arm):
            pick = arm_pick(run.study, run.scenario, arm)
            rival = None if pick is None else pick.user_attrs.get("capacity_rate")
            if rival is None:
                return None
            rate = min(rate, rival)
    # the pick rule ranks throughputs within tie_tolerance of the top alike (then by TTFT)
    return rate, rate * (1 - run.scenario.tie_tolerance) * (1 - PRUNE_MARGIN)
