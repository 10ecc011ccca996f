"""The efficiency curve's arithmetic (bench/search_curve.py) on planted runs: the share of the
grid's best found so far, the seconds a run has spent, and the medians the table prints."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from search_curve import Curves, at_seconds, elapsed, reached

MEETS = {"ttft": -1.0}  # a constraint <= 0: the SLA is met
MISSES = {"ttft": 0.5}


def test_only_feasible_trials_count_and_the_best_so_far_never_falls():
    outcomes = [None, [100, 90.0, MISSES, 1.0], [100, 40.0, MEETS, 1.0], [100, 20.0, MEETS, 1.0]]
    assert list(reached(outcomes, best=80.0)) == [0.0, 0.0, 0.5, 0.5]


def test_seconds_add_each_trial_s_evaluation_and_the_sampler_s_time():
    outcomes = [[1, 1.0, MEETS, 2.0], None, [1, 1.0, MEETS, 3.0]]
    assert list(elapsed(outcomes, [0.5, 0.25, 0.25])) == [2.5, 2.75, 6.0]


def test_a_share_counts_only_trials_finished_within_the_time():
    shares, seconds = np.array([0.2, 0.6, 1.0]), np.array([1.0, 2.0, 4.0])
    assert at_seconds(shares, seconds, 0.5) == 0.0
    assert at_seconds(shares, seconds, 2.0) == 0.6
    assert at_seconds(shares, seconds, 3.9) == 0.6
    assert at_seconds(shares, seconds, 10.0) == 1.0


def test_the_curve_is_the_median_over_runs():
    curves = Curves()
    for found in (10.0, 50.0, 90.0):
        curves.add([[1, found, MEETS, 1.0], [1, 100.0, MEETS, 1.0]], [0.0, 0.0], best=100.0)
    assert curves.by_trials(1) == pytest.approx(0.5)
    assert curves.by_trials(2) == 1.0
    assert curves.by_trials(50) == 1.0  # past a run's end: its last share
    assert curves.by_seconds(1.0) == pytest.approx(0.5)
