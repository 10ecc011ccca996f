"""Before the export the pick is held at its claimed capacity for longer than the search's
window and on fresh arrival draws, a claim that misses is lowered one grid step at a time, and
the configs a lowered claim passed over are held too (tuner.hold). On the real simulator: a
claim planted above what a config sustains is lowered to a rate that holds. With a planted
engine (pure logic, tests/test_hold_rivals.py): the re-ranking and the draws."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import optuna
import pytest
import yaml

from objectives.scoring import constraint_values, is_feasible
from runners.load.capacity import evaluate
from runners.load.measurement import summarize
from runners.sim.runner import DEFAULTS, SimRunner
from tests.conftest import run_autotune, small_scenario
from tuner.hold import HoldPlan, hold_pick
from tuner.study import HOLD_ATTR

CONFIG = DEFAULTS | {
    "batch_size": 64,
    "select_batch": "decode-first",
    "quantization": "w8a8",
    "kv_compression": 0.5,
}


def _study_with(claimed: float, scenario) -> tuple[optuna.Study, optuna.trial.FrozenTrial]:
    study = optuna.create_study(directions=["minimize", "maximize"])
    study.add_trial(
        optuna.trial.create_trial(
            values=[100.0, 1000.0], user_attrs={"knobs": CONFIG, "capacity_rate": claimed}
        )
    )
    return study, study.trials[0]


def test_a_claim_above_what_the_config_sustains_is_lowered_until_it_holds():
    scenario = small_scenario(requests=200)
    runner = SimRunner()
    found = evaluate(runner, CONFIG, scenario).metrics["capacity_rate"]
    planted = found * 1.15  # three grid steps past the search's 5% bracket: overloaded
    study, trial = _study_with(planted, scenario)
    result = hold_pick(runner, study, scenario, trial, HoldPlan(4, 1))
    assert study.user_attrs[HOLD_ATTR] == result
    rates = [load["rate"] for load in result["loads"]]
    assert rates[0] == planted and not result["loads"][0]["meets"]
    # Then on the search's grid: precision 0.05 bisects a doubling into 16 steps, so every
    # rate is the nominal one times 2**(i/16), each try one such step below the last.
    assert scenario.load.precision == 0.05
    for rate in rates[1:]:
        index = math.log2(rate / scenario.nominal_rate) * 16
        assert index == pytest.approx(round(index), abs=1e-9) and rate < planted
    for higher, lower in itertools.pairwise(rates[1:]):
        assert lower == pytest.approx(higher / 2 ** (1 / 16))
    assert planted / 2 ** (1 / 16) <= rates[1] < planted  # the first grid point below
    assert result["held_rate"] == rates[-1] < planted and result["loads"][-1]["meets"]
    # the rate that held holds when measured again, independently, on 4x the requests
    long = scenario.at_rate(result["held_rate"]).model_copy(update={"num_requests": 800})
    with runner.session(CONFIG, long) as session:
        metrics = summarize(session.measure(long, scenario.sla, False), scenario.sla)
    assert is_feasible(constraint_values(metrics, scenario.sla))


def test_a_claim_that_holds_stands():
    scenario = small_scenario(requests=200)
    runner = SimRunner()
    found = evaluate(runner, CONFIG, scenario).metrics["capacity_rate"]
    study, trial = _study_with(found / 1.5, scenario)  # well inside what it sustains
    result = hold_pick(runner, study, scenario, trial, HoldPlan(2, 3))
    assert result["held_rate"] == result["claimed_rate"] and len(result["loads"]) == 1
    # held on three arrival draws, each at least twice the scenario's requests
    draws = result["loads"][0]["draws"]
    assert [d["draw"] for d in draws] == [0, 1, 2] and all(d["meets"] for d in draws)
    assert all(d["requests"] >= 2 * 200 for d in draws)


def test_the_export_states_the_hold_and_the_capacity_that_held(tmp_path: Path, scenario_file):
    done = run_autotune(
        "--scenario", str(scenario_file), "--trials", "6", "--polish", "0", "--hold", "4",
        "--no-html", "--export", "best.yaml", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "hold: trial" in done.stdout
    exported = yaml.safe_load((tmp_path / "best.yaml").read_text())
    hold = exported["hold"]
    assert hold["factor"] == 4 and hold["draws"] == 12  # the simulator's twelve arrival draws
    if hold["held_rate"] is not None:  # a load that met ran whole: at least 4x, on every draw
        held = next(load for load in hold["loads"] if load["rate"] == hold["held_rate"])
        assert len(held["draws"]) == 12 and all(d["requests"] >= 4 * 200 for d in held["draws"])
    assert hold["claimed_rate"] == exported["metrics"]["capacity_rate"]
    assert exported["capacity"]["rate"] == hold["held_rate"]


def test_a_claim_nothing_holds_is_exported_unheld_and_sizes_no_fleet():
    """Three times what the config sustains: four grid steps down (5% each) still miss, so the
    export's capacity says it did not hold, and no fleet is sized on it."""
    from tuner.answer import answer_metrics, held_capacity

    scenario = small_scenario(requests=200)
    runner = SimRunner()
    found = evaluate(runner, CONFIG, scenario).metrics["capacity_rate"]
    study, trial = _study_with(found * 3, scenario)
    result = hold_pick(runner, study, scenario, trial, HoldPlan(2, 1))
    assert result["held_rate"] is None and len(result["loads"]) == 5
    metrics = {"capacity_rate": found * 3, "capacity_rps": found * 3, "instances_for_peak": 2}
    held = answer_metrics(
        metrics, held_capacity(result, trial.number), None, 10.0, scenario.workload
    )
    assert held["capacity_unheld"] is True and held["instances_for_peak"] is None
