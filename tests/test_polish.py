"""Polish (issue 28, item 4): no export that changing one knob beats. The neighbourhood's
construction as pure logic; then a real study on the simulator whose only trial is a planted
bf16 config: w8a8 with the same other knobs halves the weight bytes every decode step reads,
so its one-knob neighbour must replace it, and the pick polish ends on has no measured
neighbour that the pick rule prefers."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from objectives.scoring import is_feasible
from runners.load.capacity import evaluate
from runners.sim.runner import SimRunner
from search_spaces.deployment import ROLE_KNOBS, as_deployment, with_deployment
from search_spaces.space import KnobRange, SearchSpace
from tests.conftest import run_autotune, small_scenario
from tuner.ladder import ladder
from tuner.neighbourhood import NUMERIC_LOG_STEP, neighbours, steps
from tuner.polish import SPLIT_KNOBS, Polish, Polisher
from tuner.pruning import prune_bounds
from tuner.storage import open_storage
from tuner.study import (
    CAPACITY_HINT,
    CONSTRAINTS_ATTR,
    PRUNE_BELOW,
    StudyRun,
    best_trial,
    create_study,
)
from tuner.trials import optimize


def test_a_categorical_knob_steps_to_each_other_value():
    dist = CategoricalDistribution(["bf16", "w8a8", "w8a16"])
    assert steps(dist, "w8a8") == ["bf16", "w8a16"]


def test_a_log_knob_steps_by_its_factor_and_stays_in_range():
    dist = IntDistribution(1, 256, log=True)
    assert steps(dist, 100) == [80, 125]  # 100 / 1.25, 100 * 1.25
    assert steps(dist, 256) == [round(256 / NUMERIC_LOG_STEP)]  # nothing above the range
    assert steps(dist, 1) == [2]  # 1 * 1.25 rounds back onto 1: one step up instead


def test_a_linear_knob_steps_by_the_grids_step():
    dist = IntDistribution(1024, 16384, step=512)
    # the grid's six points are (16384 - 1024) / 5 = 3072 apart, a multiple of the step already
    assert steps(dist, 8192) == [8192 - 3072, 8192 + 3072]
    assert steps(FloatDistribution(0.5, 1.0, step=0.5), 0.5) == [1.0]


def test_a_count_of_chips_steps_by_one():
    """prefill_instances on 8 chips runs 1..7: a fifth of the range is 1.2 chips, and the
    neighbours of 4 prefill instances are 3 and 5, not 2 and 6 (the short-prompt case's best
    split, 3P5D, lay between the 4P4D pick's neighbours)."""
    assert steps(IntDistribution(1, 7), 4) == [3, 5]
    # a range narrower than the grid's five intervals still moves by one step
    assert steps(IntDistribution(1, 3), 2) == [1, 3]


def test_neighbours_change_one_knob_each_and_leave_a_co_located_picks_role_knobs():
    space = with_deployment(SearchSpace.load("vllm"), 4, 0.9, "h100", True)
    searched_roles = set(ROLE_KNOBS) & set(space.distributions())
    assert searched_roles  # the test means something only where role knobs are searched
    params = {name: _first(dist) for name, dist in space.distributions().items()}
    params["deployment"] = "co-located"
    found = neighbours(space, params)
    assert found
    for neighbour in found:
        changed = [name for name in params if neighbour[name] != params[name]]
        assert len(changed) == 1
        assert changed[0] not in searched_roles
    params["deployment"] = "disaggregated"
    assert searched_roles <= {
        name for n in neighbours(space, params) for name in n if n[name] != params[name]
    }


def test_a_disaggregated_arm_climbs_its_balance_first(tmp_path: Path):
    """An arm's polish has a few trials (ARM_TRIALS); a disaggregated pick's first ones move
    what balances prefill against decode: a chip between the roles, then the prefill
    instances' batch (customer-service on 8 chips planted at 5P3D, prefill batch 16, three
    trials), before any other knob."""
    run, planted = _eight_chip_study(
        tmp_path,
        {"deployment": "disaggregated", "prefill_instances": 5, "batch_size": 256}
        | {"quantization": "w8a8", "prefix_caching": True, "max_prefill_batch_size": 16}
        | {"max_prefill_tokens": 8192, "prefill_batch_size": 16},
    )
    study = run.study
    result = Polisher(run).polish(3, {"deployment": "disaggregated"})
    assert result.trials == 3
    measured = study.trials[1:]
    moved = [[k for k in planted if t.params[k] != planted[k]] for t in measured]
    assert moved == [["prefill_instances"], ["prefill_instances"], ["prefill_batch_size"]]
    assert sorted(t.params["prefill_instances"] for t in measured[:2]) == [4, 6]
    assert measured[2].params["prefill_batch_size"] == 13  # 16 / 1.25, the step down first


def test_the_same_config_under_the_other_deployment():
    """A controlled comparison changes the deployment and nothing else: a prefill instance
    batches as many prompts as the replica's prefill step did, and back; a co-located
    config's split, which it never ran, starts in the middle of the chips."""
    space = with_deployment(SearchSpace.load("mindie"), 8, 0.8, "ascend-910b2", True)
    replica = {"deployment": "co-located", "batch_size": 901, "max_prefill_batch_size": 31}
    replica |= {"quantization": "w8a8", "prefill_instances": 7, "prefill_batch_size": 1}
    split = as_deployment(space, replica, "disaggregated")
    assert split == replica | {"deployment": "disaggregated", "prefill_instances": 4} | {
        "prefill_batch_size": 31
    }
    back = as_deployment(space, split | {"prefill_batch_size": 12}, "co-located")
    assert back["deployment"] == "co-located" and back["max_prefill_batch_size"] == 12
    # A disaggregated config keeps its own split; a batch past the knob's range is its end.
    assert as_deployment(space, split, "disaggregated") == split
    huge = as_deployment(space, replica | {"max_prefill_batch_size": 1000}, "disaggregated")
    assert huge["prefill_batch_size"] == space.ranges["prefill_batch_size"].high


def test_the_controlled_prefill_batch_is_the_one_the_replica_ran():
    """The replica's prefill batch as it runs: max_prefill_batch_size clamped to the batch
    (MindIE takes at most the batch), the value a --space file fixes, the batch itself on
    vLLM (no such knob: a step prefills what the batch admits), the nearest of listed
    choices; and a config already of the asked deployment is left as it is."""
    mindie = with_deployment(SearchSpace.load("mindie"), 8, 0.8, "ascend-910b2", True)
    replica = {"deployment": "co-located", "batch_size": 16, "max_prefill_batch_size": 64}
    assert as_deployment(mindie, replica, "disaggregated")["prefill_batch_size"] == 16
    assert as_deployment(mindie, replica, "co-located") == replica

    fixed = SearchSpace.load("mindie").with_range(
        "max_prefill_batch_size", KnobRange(value=20), "fixed by a --space file"
    )
    fixed = with_deployment(fixed, 8, 0.8, "ascend-910b2", True)
    plain = {"deployment": "co-located", "batch_size": 256}
    assert as_deployment(fixed, plain, "disaggregated")["prefill_batch_size"] == 20

    vllm = with_deployment(SearchSpace.load("vllm"), 8, 0.9, "h200", True)
    assert "max_prefill_batch_size" not in vllm.distributions()
    split = as_deployment(vllm, {"deployment": "co-located", "batch_size": 48}, "disaggregated")
    assert split["prefill_batch_size"] == 48 and split["prefill_instances"] == 4

    listed = SearchSpace.load("mindie").with_range(
        "prefill_batch_size", KnobRange(choices=[8, 16]), "listed in a --space file"
    )
    listed = with_deployment(listed, 8, 0.8, "ascend-910b2", True)
    replica = {"deployment": "co-located", "batch_size": 256, "max_prefill_batch_size": 31}
    assert as_deployment(listed, replica, "disaggregated")["prefill_batch_size"] == 16


def test_a_deployment_arm_is_compared_on_the_best_configs_prefill_batch_and_split(
    tmp_path: Path,
):
    """customer-service on 8 chips, seed 2, printed co-located +42%: its controlled trial ran
    the best co-located config disaggregated at a prefill batch the sampler drew (1), and the
    arm's polish climbed from a 5P3D pick no one-knob step improves. Here the controlled
    trial runs the replica's own prefill batch on 4P4D, and its split is climbed from there."""
    run, replica = _eight_chip_study(
        tmp_path,
        {"deployment": "co-located", "batch_size": 256, "quantization": "w8a8"}
        | {"max_prefill_batch_size": 16, "max_prefill_tokens": 8192, "prefill_batch_size": 1},
    )
    study, scenario = run.study, run.scenario
    Polisher(run).refine_arms([{"deployment": "disaggregated"}], 3)
    controlled, *climbed = study.trials[1:4]
    assert controlled.params == replica | {"deployment": "disaggregated"} | {
        "prefill_instances": 4,
        "prefill_batch_size": 16,
    }
    assert sorted(t.params["prefill_instances"] for t in climbed) == [3, 5]
    assert all(
        t.params == controlled.params | {"prefill_instances": t.params["prefill_instances"]}
        for t in climbed
    )

    # What the pick's polish leaves goes to the deployment that trails: the one whose best
    # SLA-feasible throughput is lower (max-throughput is the scenario's pick rule).
    assert scenario.pick == "max-throughput"
    best = {
        side: max(
            t.values[1]
            for t in study.trials
            if t.params["deployment"] == side
            and t.state == TrialState.COMPLETE  # a pruned step has no values
            and is_feasible(t.constraints)
        )
        for side in ("co-located", "disaggregated")
    }
    assert best["co-located"] != best["disaggregated"]
    behind = min(best, key=best.__getitem__)
    said = Polisher(run).polish_trailing_deployment(
        [{"deployment": "co-located"}, {"deployment": "disaggregated"}], 2
    )
    # it may overtake the leader: then it says so
    assert re.match(rf"; {behind} \((behind|was behind, now ahead)\): 2 more trials", said)
    assert [t.params["deployment"] for t in study.trials[4:]] == [behind, behind]


def _eight_chip_study(tmp_path: Path, knobs: dict, run_it: bool = True) -> tuple[StudyRun, dict]:
    """A study on 8 simulated chips whose one trial, feasible, runs `knobs` (every other knob
    at its lowest or first value; with `run_it` off, none runs): the study and the params."""
    scenario = small_scenario(requests=300)
    runner = SimRunner(chips=8)
    space = runner.adapt(SearchSpace.load("mindie").fit_workload(scenario.workload))
    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}")
    study = create_study(
        storage, "s", optuna.samplers.RandomSampler(seed=0), scenario, runner.identity()
    )
    planted = {name: _first(dist) for name, dist in space.distributions().items()} | knobs
    run = StudyRun(study, scenario, space, runner, storage)
    if run_it:
        study.enqueue_trial(planted)
        optimize(run, 1, None)
        assert is_feasible(study.trials[0].constraints)
    return run, planted


def _first(dist):
    return dist.choices[0] if isinstance(dist, CategoricalDistribution) else dist.low


def _planted_study(tmp_path: Path) -> StudyRun:
    scenario = small_scenario(requests=300)
    runner = SimRunner()
    space = SearchSpace.load("mindie").fit_workload(scenario.workload)
    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}")
    study = create_study(
        storage, "s", optuna.samplers.RandomSampler(seed=0), scenario, runner.identity()
    )
    planted = {
        "batch_size": 64,
        "select_batch": "decode-first",
        "max_prefill_tokens": 8192,
        "quantization": "bf16",
        "kv_compression": 1.0,
        "max_prefill_batch_size": 8,
    }
    dists = space.distributions()
    study.enqueue_trial({name: value for name, value in planted.items() if name in dists})
    run = StudyRun(study, scenario, space, runner, storage)
    optimize(run, 1, None)
    return run


# More than a climb from the planted pick takes: a polish that stops below it has settled.
SETTLING_BUDGET = 400


def test_a_planted_better_neighbour_replaces_the_pick(tmp_path: Path):
    """bf16 batch 64 planted: a quantized precision (fewer weight bytes, so more KV blocks
    and faster decode steps) is one knob away and serves more, so the polish must leave bf16;
    it stops only where every neighbour of where it stands has been measured."""
    run = _planted_study(tmp_path)
    first = best_trial(run.study, run.scenario)
    assert first is not None and first.params["quantization"] == "bf16"
    result = Polisher(run).polish(SETTLING_BUDGET)
    assert 0 < result.trials < SETTLING_BUDGET, "the climb settles within the budget"
    pick = best_trial(run.study, run.scenario)
    assert pick is not None and pick.params["quantization"] != "bf16"
    assert any("quantization bf16 ->" in change for change in result.changes)
    ran = [t.user_attrs.get("knobs") for t in run.study.trials]
    for neighbour in neighbours(run.space, pick.params):
        assert run.space.config_of(neighbour) in ran


def test_a_pruned_step_is_slower_than_where_the_climb_stood(tmp_path: Path):
    """The polish prunes a step once it misses at a rate it had to sustain to beat the pick:
    each pruned trial says so, and its capacity, searched whole afterwards on the same
    simulator, lies below the rate it was pruned at, and so below the trial it stepped from."""
    run = _planted_study(tmp_path)
    Polisher(run).polish(60)
    pruned = run.study.get_trials(states=(TrialState.PRUNED,))
    assert pruned  # bf16's neighbours include far slower ones (prefill-first, a small batch)
    for trial in pruned:
        assert trial.user_attrs["status"] == "pruned"
        assert "capacity lies below" in trial.user_attrs["pruned"]
        below = trial.user_attrs["capacity_below"]
        assert below <= trial.user_attrs[PRUNE_BELOW] < trial.user_attrs[CAPACITY_HINT]
        whole = evaluate(run.runner, trial.user_attrs["knobs"], run.scenario)
        assert whole.metrics["capacity_rate"] < below


def test_pruning_changes_neither_the_pick_nor_the_ladder(tmp_path: Path, monkeypatch):
    """The same planted study polished twice, pruning and measuring every step whole: the
    pick (its knobs and figures) and every ladder row's best are the same; only trials that
    could not win ended early."""

    def polished(where: Path) -> tuple[dict, list, list]:
        where.mkdir()
        run = _planted_study(where)
        Polisher(run).polish(60)
        best = best_trial(run.study, run.scenario)
        assert best is not None
        rows = [(r.pair, r.throughput) for r in ladder(run.study)]
        return best.params, list(best.values), rows

    pruned = polished(tmp_path / "pruned")
    monkeypatch.setattr("tuner.polish.prune_bounds", lambda *args: None)
    whole = polished(tmp_path / "whole")
    assert pruned == whole


def test_only_a_simulated_max_throughput_climb_from_a_feasible_trial_prunes(tmp_path: Path):
    """Where a step is searched to the end: on a real engine (its capacity varies between
    draws, and close rivals are measured again), under min-ttft (a slower step may answer
    sooner), from a trial that misses the SLA (any feasible step beats it), and into an arm
    with no pick yet (its first feasible trial is the ladder's row). Otherwise the step must
    beat the least of where the climb stands and its arm's pick."""
    run = _planted_study(tmp_path)
    study = run.study
    here = study.trials[0]
    rate = here.user_attrs["capacity_rate"]
    same_arm = here.params | {"batch_size": 80}
    # The rate a step has to sustain to matter is where the climb stands; it is pruned only
    # once it misses clearly below that (a margin under it, wider for a lenient tie).
    beat, prune_at = prune_bounds(run, here, same_arm)
    assert beat == pytest.approx(rate) and prune_at < beat
    lenient = replace(run, scenario=run.scenario.model_copy(update={"tie_tolerance": 0.2}))
    lenient_beat, lenient_prune_at = prune_bounds(lenient, here, same_arm)
    assert lenient_beat == pytest.approx(rate) and lenient_prune_at < prune_at
    other_arm = here.params | {"quantization": "w8a8"}
    assert prune_bounds(run, here, other_arm) is None  # no w8a8 trial yet
    study.enqueue_trial(other_arm)
    optimize(run, 1, None)
    rival = study.trials[-1].user_attrs["capacity_rate"]
    assert rival != rate
    beat, _ = prune_bounds(run, here, other_arm | {"batch_size": 80})
    assert beat == pytest.approx(min(rate, rival))  # the least of where it stands and the arm's
    for changed in (
        replace(run, runner=SimpleNamespace(name="vllm")),
        replace(run, scenario=run.scenario.model_copy(update={"pick": "min-ttft"})),
    ):
        assert prune_bounds(changed, here, same_arm) is None
    missed = study.trials[0]
    missed.system_attrs[CONSTRAINTS_ATTR] = [1.0]
    assert prune_bounds(run, missed, same_arm) is None


def test_polish_measures_nothing_twice(tmp_path: Path):
    run = _planted_study(tmp_path)
    settled = Polisher(run).polish(SETTLING_BUDGET)
    assert settled.trials < SETTLING_BUDGET, "the climb settles within the budget"
    before = len(run.study.trials)
    configs = [tuple(sorted(t.user_attrs["knobs"].items())) for t in run.study.trials]
    assert len(configs) == len(set(configs))
    # A second polish of a settled pick has nothing left to measure around it.
    again = Polisher(run).polish(SETTLING_BUDGET)
    assert again.trials == 0
    assert len(run.study.trials) == before


def test_the_console_says_what_polish_did(tmp_path: Path, scenario_file: Path):
    result = run_autotune(
        "--scenario", str(scenario_file), "--trials", "9", "--polish", "5", "--no-html",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    said = re.findall(r"polish: (\d+) one-knob neighbour trials", result.stderr)
    assert len(said) == 1
    assert "arms: " not in result.stderr  # 5 trials leave no arm its share (ARM_TRIALS)
    assert 1 <= int(said[0]) <= 5
    no_polish = run_autotune(
        "--scenario", str(scenario_file), "--trials", "2", "--polish", "0", "--no-html",
        "--study", "other", cwd=tmp_path,
    )  # fmt: skip
    assert "polish:" not in no_polish.stderr


@dataclass
class _LandscapePolisher(Polisher):
    """A polisher whose trials are read off a planted landscape instead of run: the climb's
    decisions alone, as pure logic."""

    # params -> tok/s; None: misses the SLA
    landscape: Callable[[dict], float | None] = lambda params: None

    def run_queued(self, todo, near=None, prune=False):
        dists = self.run.space.distributions()
        for params in todo:
            throughput = self.landscape(params)
            self.run.study.add_trial(
                optuna.trial.create_trial(
                    params=params,
                    distributions={name: dists[name] for name in params},
                    values=[50.0, throughput or 10.0],
                    user_attrs={"knobs": self.run.space.config_of(params)},
                    system_attrs={CONSTRAINTS_ATTR: [0.0 if throughput else 1.0]},
                )
            )
        return len(todo)


def test_a_split_climb_leaves_an_infeasible_start_and_stops_at_its_peak(tmp_path: Path):
    """Planted: 4P4D misses the SLA; 3P 100 tok/s, 5P 120, 6P 130, 7P 125. From 4P any
    feasible step wins (5P, the better of 3P and 5P), then 6P beats it by 8%, and 7P does
    not beat 6P: four trials; with a budget of two, only 4P's neighbours."""
    run, planted = _eight_chip_study(tmp_path, {"deployment": "disaggregated"}, run_it=False)
    start = planted | {"prefill_instances": 4, "prefill_batch_size": 16}
    landscape = {1: 50.0, 2: 80.0, 3: 100.0, 4: None, 5: 120.0, 6: 130.0, 7: 125.0}

    def climbed(budget: int) -> tuple[int, list[int]]:
        polisher = _LandscapePolisher(
            run, landscape=lambda params: landscape[params["prefill_instances"]]
        )
        first = len(run.study.trials)
        polisher.run_queued([start])
        ran = polisher.climb(start, SPLIT_KNOBS, budget)
        return ran, [t.params["prefill_instances"] for t in run.study.trials[first + 1 :]]

    ran, measured = climbed(2)
    assert (ran, sorted(measured)) == (2, [3, 5])
    ran, measured = climbed(10)  # 3 and 5 measured already: 6, then 7
    assert (ran, measured) == (2, [6, 7])


def test_a_climb_speeds_up_along_a_winning_knob_and_measures_the_arms_knobs_last(tmp_path: Path):
    """Planted on one chip: throughput 100 * (1 - log2(mpbs / 32)**2 / 8), at least 5, times
    1.5 at w8a8; every other knob flat (max_prefill_batch_size is mpbs). Worked by hand from
    mpbs 4 at bf16: 3 and 5 measured, 5 wins; from 5, 6 and 8 (5 * (5/4)**2 = 7.8, the last move
    squared): 8; from 8, 6, 10 and 20 (8 * (8/5)**2): 20; from 20, 16, 25 and 64: 25; from 25,
    31 and 39: 31 (+1.6%); from 31 no mpbs step wins, so the precision and KV steps run, the
    first time: w8a8 wins; from there nothing does. By 1.25x steps alone, 4 to 31 is nine
    moves."""
    run = _planted_study(tmp_path)
    # two knobs off the study's simulated trial: no step of the climb runs its config
    start = run.study.trials[0].params | {
        "max_prefill_batch_size": 4,
        "batch_size": 100,
        "prefix_caching": True,
    }

    def planted(params: dict) -> float:
        peak = max(0.05, 1 - math.log2(params["max_prefill_batch_size"] / 32) ** 2 / 8)
        return 100 * peak * (1.5 if params["quantization"] == "w8a8" else 1.0)

    polisher = _LandscapePolisher(run, landscape=planted)
    first = len(run.study.trials)
    polisher.run_queued([start])
    result = Polish()
    polisher._climb(run.study.trials[first], 200, (), None, result)
    moves = [change.split("(")[1].rstrip(")") for change in result.changes]
    assert moves == [
        "max_prefill_batch_size 4 -> 5",
        "max_prefill_batch_size 5 -> 8",
        "max_prefill_batch_size 8 -> 20",
        "max_prefill_batch_size 20 -> 25",
        "max_prefill_batch_size 25 -> 31",
        "quantization bf16 -> w8a8",
    ]
    trials = run.study.trials[first:]
    peak_at_bf16 = next(
        t.number
        for t in trials
        if t.params["max_prefill_batch_size"] == 31 and t.params["quantization"] == "bf16"
    )
    off_arm = [
        t.number
        for t in trials
        if (t.params["quantization"], t.params["kv_compression"]) != ("bf16", 1.0)
    ]
    assert off_arm and min(off_arm) > peak_at_bf16


def test_a_climb_stuck_on_a_tie_goes_on_from_a_tied_scheduling_policy_once(tmp_path: Path):
    """Planted on one chip: prefill-first reads 100 tok/s at any batch; decode-first 100 at
    batch 64, rising with the batch to 125 (100 * batch / 64); the prefix cache flipped reads
    0.5% less; every other knob flat. From prefill-first at batch 64 no step wins, and
    decode-first ties: the climb goes on from it, where batch 80 wins and then 125 (80 *
    (80/64)**2), its peak. There the prefix cache's flip ties too, but from the sideways
    step's peak nothing does: it climbs on from one tie per stand, not from a tie of a tie.
    Where decode-first reads 98 at batch 64 (below the tie), the climb ends where it began."""
    run = _planted_study(tmp_path)
    start = run.study.trials[0].params | {
        "select_batch": "prefill-first",
        "max_prefill_batch_size": 4,  # two knobs off the study's simulated trial
        "max_prefill_tokens": 4096,
    }

    def planted(params: dict, decode_first_at_64: float) -> float:
        if params["select_batch"] == "decode-first":
            value = decode_first_at_64 * min(params["batch_size"], 125) / 64
        else:
            value = 100.0
        return value * (0.995 if params["prefix_caching"] != start["prefix_caching"] else 1)

    polisher = _LandscapePolisher(run, landscape=lambda params: planted(params, 100.0))
    first = len(run.study.trials)
    polisher.run_queued([start])
    result = Polish()
    peak = polisher._climb(run.study.trials[first], 200, (), None, result)
    moves = [change.split("(")[1].rstrip(")") for change in result.changes]
    assert moves == [
        "select_batch prefill-first -> decode-first, a tie",
        "batch_size 64 -> 80",
        "batch_size 80 -> 125",
    ]
    assert (peak.params["batch_size"], peak.params["select_batch"]) == (125, "decode-first")
    assert peak.params["prefix_caching"] == start["prefix_caching"]

    (tmp_path / "below").mkdir()
    run = _planted_study(tmp_path / "below")
    polisher = _LandscapePolisher(run, landscape=lambda params: planted(params, 98.0))
    first = len(run.study.trials)
    polisher.run_queued([start])
    result = Polish()
    peak = polisher._climb(run.study.trials[first], 200, (), None, result)
    assert result.changes == [] and peak.number == first


def test_a_step_past_a_tie_has_to_beat_where_the_climb_stood_not_only_the_tie(tmp_path: Path):
    """Planted: prefill-first 100 tok/s at any batch; decode-first 99.2 at batch 64 (a tie,
    0.8% below) and 100.2 from batch 80 on: 1.0% above the tie, 0.2% above the start. That
    is no win: the climb ends where it began, and says nothing of the tie."""
    run = _planted_study(tmp_path)
    start = run.study.trials[0].params | {
        "select_batch": "prefill-first",
        "max_prefill_batch_size": 4,  # two knobs off the study's simulated trial
        "max_prefill_tokens": 4096,
    }

    def planted(params: dict) -> float:
        if params["prefix_caching"] != start["prefix_caching"]:
            return 99.0  # a tie too, below decode-first's: the sideways step is decode-first
        if params["select_batch"] == "prefill-first":
            return 100.0
        return 99.2 if params["batch_size"] <= 64 else 100.2

    polisher = _LandscapePolisher(run, landscape=planted)
    first = len(run.study.trials)
    polisher.run_queued([start])
    result = Polish()
    peak = polisher._climb(run.study.trials[first], 200, (), None, result)
    assert result.changes == [] and peak.number == first
    tied_then_up = [
        t
        for t in run.study.trials[first:]
        if t.params["select_batch"] == "decode-first" and t.params["batch_size"] == 80
    ]
    assert tied_then_up  # the climb did go on from the tie, and measured the step past it


def test_steps_a_run_queued_and_did_not_run_do_not_outlive_it(tmp_path: Path):
    """A run whose time ends inside the polish (here: the deadline passes while its trials
    run, so none of the two runs) fails the steps it queued: a later run's first trials are
    its sampler's, not two steps of a climb that no longer runs (issue 42: `--trials 4
    --timeout 34` left two WAITING with a prune bound)."""
    run = _planted_study(tmp_path)
    here = best_trial(run.study, run.scenario)
    steps = [dict(here.params, batch_size=size) for size in (70, 80)]

    class OutOfTime(Polisher):
        def _optimize(self, n: int) -> int:
            return 0

    assert OutOfTime(run).run_queued(steps, here, prune=True) == 0
    states = [t.state for t in run.study.trials]
    assert TrialState.WAITING not in states
    left = [t for t in run.study.trials if t.user_attrs.get("fault_kind") == "not-run"]
    assert len(left) == 2 and all(t.state == TrialState.FAIL for t in left)
