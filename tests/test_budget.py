"""`--trials` as the run's whole budget (tuner.budget): the split on hand counts, and a real run
on a real SQLite file that measures no more trials than it was given and says the split."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from objectives.userfile import InputError
from tests.conftest import run_autotune
from tuner.budget import split


def _shares(*args, **kwargs) -> tuple[int, int, int]:
    budget = split(*args, **kwargs)
    assert budget.study + budget.polish + budget.repeat_trials == budget.total
    return budget.study, budget.polish, budget.repeat_trials


def test_the_defaults_are_the_runs_before_the_budget():
    # the simulator: 50 study trials, then 100 of arms and polish; no repeats (deterministic)
    assert split(None, None, None, simulated=True).total == 150
    assert _shares(None, None, None, simulated=True) == (50, 100, 0)
    # a real engine: 50, 12, and the pick with up to 3 rivals measured twice more each (8)
    assert split(None, None, None, simulated=False).total == 70
    assert _shares(None, None, None, simulated=False) == (50, 12, 8)


def test_another_total_keeps_the_defaults_shares():
    assert _shares(30, None, None, simulated=True) == (10, 20, 0)  # a third, two thirds
    assert _shares(3, None, None, simulated=True) == (1, 2, 0)
    assert _shares(1, None, None, simulated=True) == (1, 0, 0)  # the study's first
    assert _shares(30, 0, None, simulated=True) == (30, 0, 0)
    assert _shares(30, 12, None, simulated=True) == (18, 12, 0)
    # a grid measures its points itself: nothing is polished after it (tuner.polish)
    assert _shares(30, None, None, simulated=True, grid=True) == (30, 0, 0)
    assert _shares(30, 10, None, simulated=True, grid=True) == (30, 0, 0)
    # a real engine: --repeats 2 costs one more measurement of each of 4 candidates; of the 16
    # left, 12/62 (3) polish
    assert _shares(20, None, 2, simulated=False) == (13, 3, 4)
    assert _shares(20, None, 0, simulated=False) == (16, 4, 0)


def test_a_budget_that_leaves_the_study_nothing_is_refused_naming_what_spent_it():
    with pytest.raises(InputError, match=r"^the default --trials 150 leaves no trial"):
        split(None, 150, None, simulated=True)
    with pytest.raises(InputError, match=r"^--trials 5 leaves no trial .*--polish 5.*at least 6"):
        split(5, 5, None, simulated=True)
    with pytest.raises(InputError, match=r"^--trials 5 .*--repeats 3 \(8 trials\).*at least 9"):
        split(5, None, 3, simulated=False)
    # the default repeats give way: a small real-engine budget runs its trials unrepeated
    assert _shares(5, None, None, simulated=False) == (4, 1, 0)
    assert _shares(1, None, None, simulated=False) == (1, 0, 0)
    # they stay while the study keeps as many trials as they spend (8): 16 is the least
    assert _shares(15, None, None, simulated=False) == (12, 3, 0)
    assert _shares(16, None, None, simulated=False) == (6, 2, 8)


def test_a_run_measures_no_more_than_its_trials_and_says_the_split(
    tmp_path: Path, scenario_file: Path
):
    db = tmp_path / "studies.db"
    done = run_autotune(
        "--scenario", str(scenario_file), "--trials", "9", "--storage", f"sqlite:///{db}",
        "--no-html", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "budget: --trials 9: 3 study trials, 6 for the arms and polish" in done.stderr
    (measured,) = sqlite3.connect(db).execute("select count(*) from trials").fetchone()
    assert 3 < measured <= 9  # the study's 3, then at most 6 of arms and polish

    refused = run_autotune(
        "--scenario", str(scenario_file), "--trials", "4", "--polish", "4",
        "--storage", f"sqlite:///{tmp_path / 'other.db'}", cwd=tmp_path,
    )  # fmt: skip
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "--trials 4" in lines[0], lines
    assert not (tmp_path / "other.db").exists()
