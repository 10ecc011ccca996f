"""Picks that survive noise (tuner.repeats), as pure logic: the measurements are a stand-in
engine whose repeats are planted, so which pick is right is known without the code under test.
The real engine's repeats run in tests/test_runner_llamacpp.py."""

from __future__ import annotations

import optuna

from tests.conftest import small_scenario
from tuner.repeats import MAX_RIVALS, candidates, repeat_pick
from tuner.study import best_trial


def _add(study: optuna.Study, values: tuple[float, float], batch_size: int) -> None:
    """A feasible trial with (TTFT p99 ms, throughput) whose config is its batch size."""
    study.add_trial(
        optuna.trial.create_trial(
            values=list(values),
            user_attrs={"knobs": {"batch_size": batch_size}},
            system_attrs={"constraints": [-1.0]},
        )
    )


def _study(trials: list[tuple[float, float]]) -> optuna.Study:
    """Feasible trials, trial n with batch_size n."""
    study = optuna.create_study(directions=["minimize", "maximize"])
    for number, values in enumerate(trials):
        _add(study, values, number)
    return study


def _planted(repeats: dict[int, list[tuple[float, float, bool]]]):
    """A stand-in engine: batch_size n's k-th repeat gives repeats[n][k - 1]."""

    def measure(config, seed_offset):
        return repeats[config["batch_size"]][seed_offset - 1]

    return measure


def test_a_lucky_first_measurement_loses_to_a_steady_rival():
    """Trial 0 read 2,500 tok/s once, then 1,900 and 2,000; trial 1 reads 2,250-2,300 every
    time. Picking on one measurement exports trial 0; on the worst repeat, trial 1."""
    scenario = small_scenario()
    study = _study([(100, 2500), (100, 2300)])
    assert best_trial(study, scenario).number == 0
    measure = _planted(
        {0: [(100, 1900, True), (100, 2000, True)], 1: [(100, 2250, True), (100, 2280, True)]}
    )
    result = repeat_pick(study, scenario, 3, measure)
    assert result["pick"] == 1 and result["trials"]["0"]["throughput"] == [2500, 1900, 2000]
    assert best_trial(study, scenario).number == 1
    # a newer trial makes the decision stale: the pick rule decides again
    _add(study, (90, 2600), 9)
    assert best_trial(study, scenario).number == 2


def test_rivals_within_the_noise_tie_and_the_faster_first_token_wins():
    """Repeats vary 10%: 2,000 and 1,980 tie; trial 1's TTFT p99 is lower, so it is the pick."""
    scenario = small_scenario()
    study = _study([(300, 2100), (120, 2050)])
    measure = _planted(
        {0: [(310, 2000, True), (300, 2200, True)], 1: [(125, 1980, True), (120, 2150, True)]}
    )
    result = repeat_pick(study, scenario, 3, measure)
    assert result["noise"] >= 0.09
    assert result["pick"] == 1 and result["tied"] == [0]


def test_a_repeat_that_misses_the_sla_counts_as_nothing():
    scenario = small_scenario()
    study = _study([(100, 2500), (100, 2200)])
    measure = _planted(
        {0: [(900, 2600, False), (100, 2450, True)], 1: [(100, 2150, True), (100, 2180, True)]}
    )
    assert repeat_pick(study, scenario, 3, measure)["pick"] == 1


def test_rivals_are_the_close_ones_only_and_a_config_counts_once():
    """Within 20% of the pick's throughput, at most MAX_RIVALS, a config measured twice (by the
    polish) once."""
    scenario = small_scenario()
    study = _study([(100, 1000), (100, 950), (100, 900), (100, 850), (100, 820), (100, 700)])
    _add(study, (100, 960), 1)
    chosen = [t.number for t in candidates(study, scenario)]
    assert chosen[0] == 0 and len(chosen) == 1 + MAX_RIVALS
    assert 5 not in chosen  # 700 is 30% below
    assert len({1, 6} & set(chosen)) == 1  # the same config (batch_size 1) once


def test_under_min_ttft_a_config_whose_repeats_failed_is_not_the_pick():
    """Trial 0 had the fastest first token once, then both repeats failed; trial 1 is steady."""
    scenario = small_scenario().model_copy(update={"pick": "min-ttft"})
    study = _study([(80, 2000), (120, 2000)])
    measure = _planted({0: [None, None], 1: [(125, 1990, True), (118, 2010, True)]})
    result = repeat_pick(study, scenario, 3, measure)
    assert result["pick"] == 1 and result["tied"] == []


def test_a_repeat_that_missed_the_sla_does_not_widen_the_noise():
    scenario = small_scenario()
    study = _study([(100, 1000), (100, 900)])
    measure = _planted(
        {0: [(900, 300, False), (100, 1000, True)], 1: [(100, 900, True), (100, 905, True)]}
    )
    result = repeat_pick(study, scenario, 3, measure)
    assert result["noise"] < 0.05  # the miss counts as 0 for its config, not as spread
    assert result["pick"] == 1
