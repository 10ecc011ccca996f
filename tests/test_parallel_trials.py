"""The simulator's trials in batches over worker processes (tuner.trials, tuner.parallel), run
as a user runs them, on a real SQLite file and the real PostgreSQL: a seed's study does not
depend on how many processes ran it. The expectation is stated outside the code: one process
running the batches one trial after another proposes and measures exactly what two do, so
every trial (its knobs, values, state and measured figures) and the export are equal, less the
fields that record when, where and how long it ran."""

from __future__ import annotations

import uuid
from pathlib import Path

import optuna
import pytest
import yaml

from testing.exports import without_wall_clock
from tests.conftest import POSTGRES, run_autotune

TRIALS, POLISH = 12, 8  # past TPE's 10 random startup trials: its model proposes in batches


def _tune(tmp_path: Path, scenario_file: Path, storage: str, processes: int, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_PROCESSES", str(processes))
    work = tmp_path / f"p{processes}"
    work.mkdir()
    name = f"parallel-{uuid.uuid4().hex[:8]}"
    done = run_autotune(
        "--scenario", str(scenario_file), "--trials", str(TRIALS + POLISH), "--polish", str(POLISH),
        "--storage", storage.format(work=work), "--study", name, "--no-html", "--seed", "3",
        cwd=work,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    study = optuna.load_study(study_name=name, storage=storage.format(work=work))
    trials = [
        (t.number, t.state, t.params, t.values, without_wall_clock(t.user_attrs))
        for t in study.trials
    ]
    exported = yaml.safe_load((work / "best-config.yaml").read_text())
    assert exported.pop("study") == name  # each study its own name: PostgreSQL holds both
    return trials, without_wall_clock(exported), study.user_attrs["hold"]


@pytest.mark.parametrize("storage", ["sqlite:///{work}/studies.db", POSTGRES])
def test_two_processes_run_the_study_one_process_runs(
    storage: str, tmp_path: Path, scenario_file: Path, monkeypatch
):
    serial, serial_export, serial_hold = _tune(tmp_path, scenario_file, storage, 1, monkeypatch)
    parallel, parallel_export, parallel_hold = _tune(
        tmp_path, scenario_file, storage, 2, monkeypatch
    )
    # the study's trials and the polish's: exactly that many (a batch never runs past it)
    assert TRIALS < len(parallel) <= TRIALS + POLISH
    assert all(state != optuna.trial.TrialState.RUNNING for _, state, *_ in parallel)
    assert parallel == serial
    assert parallel_export == serial_export
    assert without_wall_clock(parallel_hold) == without_wall_clock(serial_hold)


def test_a_bad_process_count_is_refused_before_a_study_opens(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_PROCESSES", "two")
    done = run_autotune("--scenario", "customer-service", "--trials", "2", cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "AUTOTUNE_SIM_PROCESSES='two'" in lines[0], done.stderr
    assert list(tmp_path.iterdir()) == []  # no studies.db, no export
