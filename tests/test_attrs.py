"""A trial's attributes in one transaction (tuner.attrs), on a real SQLite file and on
Optuna's in-memory storage, which has no transactions to share."""

from __future__ import annotations

from pathlib import Path

import optuna
from sqlalchemy import event

from tuner.attrs import set_user_attrs

ATTRS = {"capacity_rate": 44.02, "capacity_steps": [{"rate": 6.0, "meets_sla": True}], "ok": None}


def test_a_trials_attributes_are_one_commit_and_read_back_as_set(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    storage = optuna.storages.RDBStorage(url)
    study = optuna.create_study(storage=storage, study_name="s")
    trial = study.ask()
    commits = []
    event.listen(storage.engine, "commit", lambda connection: commits.append(1))
    set_user_attrs(trial, ATTRS)
    assert len(commits) == 1  # set_user_attr one by one: one commit each
    assert trial.user_attrs == ATTRS  # read back by the running trial, as set_user_attr does
    study.tell(trial, 1.0)
    again = optuna.load_study(study_name="s", storage=optuna.storages.RDBStorage(url))
    assert again.trials[0].user_attrs == ATTRS


def test_a_storage_without_transactions_gets_them_one_by_one():
    study = optuna.create_study()
    trial = study.ask()
    set_user_attrs(trial, ATTRS)
    assert trial.user_attrs == ATTRS


def test_a_row_another_process_wrote_first_loses_no_attribute(tmp_path: Path, monkeypatch):
    """Another worker writes one of the keys between this transaction's read and its commit
    (planted: the writer raises the unique-key IntegrityError that race raises at the
    second key). The transaction rolls back whole; every attribute must still be set, one by
    one as Optuna's own setter writes them (it ignored the error and lost all three)."""
    from sqlalchemy.exc import IntegrityError

    url = f"sqlite:///{tmp_path / 'studies.db'}"
    storage = optuna.storages.RDBStorage(url)
    study = optuna.create_study(storage=storage, study_name="s")
    trial = study.ask()
    real = storage._set_trial_attr_without_commit
    written: list[str] = []

    def racing(session, model, trial_id, key, value):
        written.append(key)
        if len(written) == 2:
            raise IntegrityError("INSERT", {}, Exception("UNIQUE constraint failed"))
        real(session, model, trial_id, key, value)

    monkeypatch.setattr(storage, "_set_trial_attr_without_commit", racing)
    set_user_attrs(trial, ATTRS)
    again = optuna.load_study(study_name="s", storage=optuna.storages.RDBStorage(url))
    assert again.trials[0].user_attrs == ATTRS


def test_what_a_load_measured_is_kept_when_scoring_it_fails(tmp_path: Path, monkeypatch):
    """A failure after the load and before the trial's one attribute write (planted: the
    constraints' writer raises) kept nothing the simulation measured; now the measured
    attributes are on the trial before the error goes on."""
    import pytest

    import tuner.trials
    from runners.sim.runner import SimRunner
    from search_spaces.space import SearchSpace
    from tests.conftest import small_scenario
    from tuner.storage import open_storage
    from tuner.study import StudyRun, create_study

    scenario, runner = small_scenario(requests=200), SimRunner()
    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}")
    study = create_study(
        storage, "s", optuna.samplers.RandomSampler(seed=0), scenario, runner.identity()
    )
    space = SearchSpace.load("mindie").fit_workload(scenario.workload)
    run = StudyRun(study, scenario, space, runner, storage)

    def broken(trial, constraints):
        raise RuntimeError("planted")

    monkeypatch.setattr(tuner.trials, "record_constraints", broken)
    with pytest.raises(RuntimeError, match="planted"):
        tuner.trials.optimize(run, 1, None)
    (trial,) = optuna.load_study(study_name="s", storage=storage).trials
    assert trial.user_attrs["capacity_rate"] is not None or "capacity_note" in trial.user_attrs
    assert "ttft_p99_ms" in trial.user_attrs
