"""Picks that survive noise (real engines): the pick and its close rivals measured again with
fresh arrival draws, and the pick made on each one's worst repeat.

One real trial is one draw of the arrivals on a busy machine: on llama-server one config's
capacity read 2,128 and 2,526 tok/s in two studies, more than the gap between the top configs
(bench/README.md). So after the study, the pick and every feasible rival within RIVAL_SPAN of
its throughput (at most MAX_RIVALS) run `k - 1` more times, each with fresh requests
(runners.load.capacity.evaluate's seed_offset). The pick rule then reads each one's worst repeat
(lowest throughput, highest TTFT p99; a repeat that missed the SLA reads 0), with the noise the
repeats showed as its tie tolerance: rivals within it tie, and the second objective breaks the
tie (Optuna's pick_best). SCOOT (WWW 2025) re-tests its final configs under several request
orders and reports the worst, likewise. The simulator is deterministic for a draw, so it
repeats nothing by default.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any, NamedTuple

import optuna
from optuna.trial import FrozenTrial, TrialState

from objectives.scenario import Scenario
from objectives.scoring import constraint_values, is_feasible, objective_values, pick_best
from runners.base import Runner
from runners.load.capacity import evaluate
from tuner.answer import CAPACITY_FIGURES
from tuner.study import best_trial, keep_repeats, trial_knobs

REAL_REPEATS = 3  # each candidate measured 3 times in all: a worst of three, in minutes
RIVAL_SPAN = 0.2  # rivals within 20% of the pick's throughput (llama-server varied 19%)
MAX_RIVALS = 3
MAX_NOISE = 0.5  # the widest tie tolerance a scenario may state


class Repeat(NamedTuple):
    ttft_p99_ms: float | None
    throughput: float | None
    met: bool
    # a capacity search's figures (tuner.answer.CAPACITY_FIGURES); None for a fixed load
    capacity: dict[str, Any] | None = None


# (config, seed_offset) -> the repeat (a plain (TTFT, throughput, met) too); None when it failed
Measure = Callable[[dict[str, Any], int], tuple | None]


def capacity_figures(metrics: dict[str, Any]) -> dict[str, Any] | None:
    """A measurement's capacity figures, as a repeat records them (None: no capacity search)."""
    if "capacity_rate" not in metrics:
        return None
    return {key: metrics.get(key) for key in CAPACITY_FIGURES}


def engine_measure(runner: Runner, scenario: Scenario) -> Measure:
    def measure(config: dict[str, Any], seed_offset: int) -> Repeat | None:
        evaluation = evaluate(runner, config, scenario, seed_offset=seed_offset)
        if evaluation.fault is not None:
            return None
        values = objective_values(evaluation.metrics, scenario)
        if values is None:
            return None
        met = is_feasible(constraint_values(evaluation.metrics, scenario.sla))
        return Repeat(values[0], values[1], met, capacity_figures(evaluation.metrics))

    return measure


def candidates(study: optuna.Study, scenario: Scenario) -> list[FrozenTrial]:
    """The pick and the feasible rivals within RIVAL_SPAN of its throughput, closest first."""
    best = best_trial(study, scenario, repeated=False)
    if best is None:
        return []
    seen = {_key(trial_knobs(study, best))}
    rivals = []
    for trial in sorted(_feasible(study), key=lambda t: -t.values[1]):
        key = _key(trial_knobs(study, trial))
        if key not in seen and trial.values[1] >= best.values[1] * (1 - RIVAL_SPAN):
            seen.add(key)  # a config measured twice (the polish's) is one rival
            rivals.append(trial)
    return [best, *rivals[:MAX_RIVALS]]


def _feasible(study: optuna.Study) -> list[FrozenTrial]:
    return [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if t.constraints and is_feasible(t.constraints)
    ]


def _key(knobs: dict[str, Any]) -> str:
    return repr(sorted(knobs.items()))


def repeat_pick(
    study: optuna.Study, scenario: Scenario, k: int, measure: Measure
) -> dict[str, Any] | None:
    """Measure the candidates k times in all (the trial itself is the first), pick on the worst
    repeat; kept by the study (tuner.study.keep_repeats), which best_trial then follows."""
    # counted before the repeats: a trial another worker finishes meanwhile was no candidate,
    # so it makes the decision stale
    done = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    chosen = candidates(study, scenario)
    if len(chosen) == 0 or k < 2:
        return None
    runs: dict[int, list[Repeat]] = {}
    for trial in chosen:
        first = Repeat(
            trial.values[0], trial.values[1], True, capacity_figures(dict(trial.user_attrs))
        )
        again = [measure(trial_knobs(study, trial), offset) for offset in range(1, k)]
        runs[trial.number] = [first] + [
            Repeat(*r) if r is not None else Repeat(None, None, False) for r in again
        ]
    # A repeat that failed or missed the SLA is the worst on both objectives.
    worst = [
        (
            number,
            max(r[0] if r[2] and r[0] is not None else math.inf for r in rs),
            min(r[1] if r[2] and r[1] is not None else 0.0 for r in rs),
        )
        for number, rs in runs.items()
    ]
    spreads = [_spread([r[1] for r in rs if r[2] and r[1]]) for rs in runs.values()]
    noise = min(MAX_NOISE, max([scenario.tie_tolerance, *spreads]))
    pick = pick_best(worst, scenario.pick, noise)
    leader = next(w for w in worst if w[0] == pick)
    if scenario.pick == "min-ttft":
        tied = [w[0] for w in worst if w[0] != pick and w[1] <= leader[1] * (1 + noise)]
    else:
        tied = [w[0] for w in worst if w[0] != pick and w[2] >= leader[2] * (1 - noise)]
    result = {
        "k": k,
        "noise": noise,
        "pick": pick,
        "tied": tied,
        "complete_trials": done,  # the decision stands while the study has no newer trial
        "trials": {
            str(number): {
                "ttft_p99_ms": [r[0] for r in rs],
                "throughput": [r[1] for r in rs],
                "met": [r[2] for r in rs],
                # a capacity search's figures; a repeat that failed or missed the SLA met no
                # rate: its capacity_rate is None (the worst)
                "capacity": [
                    r.capacity if r.met else {"capacity_rate": None} if rs[0].capacity else None
                    for r in rs
                ],
            }
            for number, rs in runs.items()
        },
    }
    keep_repeats(study, result)
    return result


def _spread(values: list[float]) -> float:
    """(max - min) / median of the repeats that met the SLA (0 when fewer than two did)."""
    if len(values) < 2:
        return 0.0
    return (max(values) - min(values)) / statistics.median(values)


def describe_repeats(result: dict[str, Any]) -> str:
    """The console's line on the repeats."""
    shown = []
    for number, runs in result["trials"].items():
        values = [v for v in runs["throughput"] if v is not None]
        failed = len(runs["throughput"]) - len(values)
        shown.append(
            f"#{number} {statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"
            + (f", {failed} failed" if failed else "")
        )
    tie = (
        f"; tied within noise: {', '.join(f'#{n}' for n in result['tied'])}"
        if result["tied"]
        else ""
    )
    return (
        f"repeats: {len(result['trials'])} configs measured {result['k']} times each with fresh "
        f"arrivals, throughput median (range): {', '.join(shown)}; noise {result['noise']:.0%}; "
        f"pick on the worst repeat: #{result['pick']}{tie}"
    )
