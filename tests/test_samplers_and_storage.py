"""Every sampler runs a real short study; the storage works on SQLite and the real PostgreSQL."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import optuna
import pytest
from sqlalchemy import create_engine, text

from objectives.scoring import is_feasible
from objectives.userfile import InputError
from runners.sim.runner import SimRunner
from search_spaces.space import SearchSpace
from tests.conftest import POSTGRES, require_module, run_autotune, small_scenario
from tuner.samplers import SAMPLERS, describe, make_sampler
from tuner.storage import latest_snapshot, open_storage
from tuner.study import StudyRun, create_study, snapshot
from tuner.trials import optimize


def _run(storage_url: str, sampler: str, name: str, trials: int = 6):
    scenario = small_scenario(requests=100)
    runner = SimRunner()
    space = SearchSpace.load("mindie").fit_workload(scenario.workload)
    storage = open_storage(storage_url)
    study = create_study(
        storage, name, make_sampler(sampler, 0, space, trials), scenario, runner.identity()
    )
    run = StudyRun(study, scenario, space, runner, storage)
    optimize(run, trials, None)
    snapshot(study, scenario, storage)
    return study, storage, run


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_every_sampler_runs(sampler: str, tmp_path: Path):
    if sampler == "gp":
        require_module("torch", "GPSampler needs the gp extra")
    # Past the 10 startup trials of TPE and GP, so their models are fitted (GP then needs SciPy).
    trials = 6 if sampler in ("random", "grid", "nsga2") else 12
    study, _, run = _run(f"sqlite:///{tmp_path / 's.db'}", sampler, "s", trials=trials)
    assert len(study.trials) == trials
    assert len(run.reports) == trials
    by_number = {t.number: t for t in study.trials}
    for report in run.reports:
        trial = by_number[report.number]
        assert trial.user_attrs["status"] == report.status
        measured = report.status in ("feasible", "violates-sla")
        assert (trial.state == optuna.trial.TrialState.COMPLETE) == measured
        if measured:
            assert trial.values == list(report.values) and is_feasible(trial.constraints) == (
                report.status == "feasible"
            )
    assert any(r.status in ("feasible", "violates-sla") for r in run.reports)


def test_same_seed_same_study(tmp_path: Path):
    a, _, _ = _run(f"sqlite:///{tmp_path / 'a.db'}", "tpe", "x", trials=12)
    b, _, _ = _run(f"sqlite:///{tmp_path / 'b.db'}", "tpe", "x", trials=12)
    assert [t.params for t in a.trials] == [t.params for t in b.trials]


def test_postgres_storage_keeps_trials_and_front():
    name = f"pg-{uuid.uuid4().hex[:8]}"
    _, storage, _ = _run(POSTGRES, "tpe", name, trials=5)
    try:
        again = optuna.load_study(study_name=name, storage=POSTGRES)
        assert len(again.trials) == 5
        snap = latest_snapshot(storage, name)
        feasible = [
            t
            for t in again.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
            if is_feasible(t.constraints)
        ]
        assert snap.trials_total == 5 and snap.trials_feasible == len(feasible)
        assert {m.trial_number for m in snap.members} <= {t.number for t in feasible}
    finally:
        optuna.delete_study(study_name=name, storage=POSTGRES)
        with create_engine(POSTGRES).begin() as con:
            con.execute(
                text(
                    "delete from autotune_pareto_members where snapshot_id in "
                    "(select id from autotune_pareto_snapshots where study_name = :n)"
                ),
                {"n": name},
            )
            con.execute(
                text("delete from autotune_pareto_snapshots where study_name = :n"), {"n": name}
            )


def test_auto_is_gp_for_real_engines_where_torch_and_scipy_are_installed(monkeypatch):
    require_module("torch", "GPSampler needs the gp extra")
    space = SearchSpace.load("mindie")
    assert isinstance(
        make_sampler("auto", 0, space, 50, simulated=False), optuna.samplers.GPSampler
    )
    assert describe("auto", simulated=False).startswith(
        "gp (auto: a real engine's trials are costly"
    )
    # A simulated trial is cheaper than a GP proposal: TPE, whatever is installed.
    assert isinstance(
        make_sampler("auto", 0, space, 50, simulated=True), optuna.samplers.TPESampler
    )
    assert describe("auto", simulated=True).startswith("tpe (auto: simulated trials are cheap")
    monkeypatch.setitem(
        sys.modules, "torch", None
    )  # what find_spec meets where torch is not installed
    assert isinstance(
        make_sampler("auto", 0, space, 50, simulated=False), optuna.samplers.TPESampler
    )
    assert describe("auto", simulated=False) == (
        "tpe (auto: no torch; pip install 'autotune[gp]' for gp, which needs fewer real trials)"
    )
    with pytest.raises(
        InputError, match="--sampler gp needs PyTorch and SciPy \\(torch is missing\\)"
    ):
        make_sampler("gp", 0, space, 50)


def test_the_console_says_which_sampler_runs(scenario_file: Path, tmp_path: Path):
    done = run_autotune(
        "--scenario", str(scenario_file), "--trials", "1", "--no-html", cwd=tmp_path
    )
    assert done.returncode in (0, 3), done.stderr  # 3: one random trial may miss the SLA
    assert "sampler tpe (auto: simulated trials are cheap" in done.stderr
