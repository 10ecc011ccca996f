"""Many workers on one study in the real PostgreSQL, and crash safety with kill -9 (SQLite)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import yaml
from optuna.trial import TrialState
from sqlalchemy import create_engine, text

from tests.conftest import POSTGRES, run_autotune, small_scenario
from tuner.storage import claim_trial, latest_snapshot, open_storage


def _scenario(tmp_path: Path, requests: int) -> Path:
    path = tmp_path / f"sc{requests}.yaml"
    data = small_scenario(requests=requests).model_dump(mode="json")
    data["name"] = "workers"
    path.write_text(yaml.safe_dump(data))
    return path


def _drop(name: str) -> None:
    optuna.delete_study(study_name=name, storage=POSTGRES)
    with create_engine(POSTGRES).begin() as con:
        con.execute(
            text(
                "delete from autotune_pareto_members where snapshot_id in "
                "(select id from autotune_pareto_snapshots where study_name = :n)"
            ),
            {"n": name},
        )
        for table in ("autotune_pareto_snapshots", "autotune_trial_budgets"):
            con.execute(text(f"delete from {table} where study_name = :n"), {"n": name})


def test_three_workers_run_exactly_the_requested_trials(tmp_path: Path):
    scenario = _scenario(tmp_path, 1500)
    name = f"workers-{uuid.uuid4().hex[:8]}"
    total = 18
    args = [
        "worker",
        "--scenario",
        str(scenario),
        "--storage",
        POSTGRES,
        "--study",
        name,
        "--trials",
        str(total),
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tuner", *args, "--export", f"w{i}.yaml"],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    try:
        outputs = [p.communicate(timeout=600) for p in procs]
        assert all(p.returncode in (0, 3) for p in procs), outputs
        study = optuna.load_study(study_name=name, storage=POSTGRES)
        trials = study.trials
        assert len(trials) == total
        assert sorted(t.number for t in trials) == list(range(total))
        assert all(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in trials)
        workers = [t.user_attrs["worker"] for t in trials]
        assert len(set(workers)) >= 2, "the trials should be shared between workers"
        for t in trials:
            if t.state == TrialState.COMPLETE:
                # The nominal load in windows of 1,500 requests doubling until one settles, its
                # first tenth warm-up (runners.load.capacity, runners.load.measurement).
                sent = t.user_attrs["requests_sent"]
                assert sent == 1500 * 2 ** (t.user_attrs["windows"] - 1)
                assert t.user_attrs["ttft_samples"] == sent - sent // 10
                assert t.values[1] == t.user_attrs["capacity_output_tokens_per_s"]
            else:
                assert t.user_attrs["fault"]
        snap = latest_snapshot(open_storage(POSTGRES), name)
        assert snap.trials_total == total
        feasible = {t.number for t in study.best_trials}
        assert {m.trial_number for m in snap.members} == feasible
    finally:
        _drop(name)


def test_kill_9_mid_trial_then_rerun_continues(tmp_path: Path):
    scenario = _scenario(tmp_path, 40000)  # about a second or more per trial
    db = f"sqlite:///{tmp_path / 'crash.db'}"
    args = [
        sys.executable,
        "-m",
        "tuner",
        "worker",
        "--scenario",
        str(scenario),
        "--storage",
        db,
        "--study",
        "c",
        "--trials",
        "5",
        "--heartbeat",
        "1",
    ]
    victim = subprocess.Popen(
        args,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    try:
        while True:
            assert time.monotonic() < deadline, "the study never got going"
            time.sleep(0.2)
            try:
                trials = optuna.load_study(study_name="c", storage=db).trials
            except KeyError:
                continue
            done = [t for t in trials if t.state == TrialState.COMPLETE]
            if len(done) >= 2 and any(t.state == TrialState.RUNNING for t in trials):
                break
        os.killpg(victim.pid, signal.SIGKILL)
    finally:
        victim.wait()
    before = {
        t.number: t.values
        for t in optuna.load_study(study_name="c", storage=db).trials
        if t.state == TrialState.COMPLETE
    }
    killed = [
        t.number
        for t in optuna.load_study(study_name="c", storage=db).trials
        if t.state == TrialState.RUNNING
    ]
    # the trials of the batch it was running (tuner.trials: two sampled ones at a time)
    assert 1 <= len(killed) <= 2

    again = run_autotune(*args[3:], cwd=tmp_path, timeout=600)
    assert again.returncode in (0, 3), again.stderr
    trials = optuna.load_study(study_name="c", storage=db).trials
    by_number = {t.number: t for t in trials}
    for number, values in before.items():
        assert by_number[number].state == TrialState.COMPLETE and by_number[number].values == values
    assert all(by_number[number].state == TrialState.FAIL for number in killed)
    counted = [t for t in trials if t.number not in killed]
    assert len(counted) == 5 and all(
        t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in counted
    )


def test_a_trial_killed_before_its_first_heartbeat_does_not_hold_the_study(tmp_path: Path):
    """A worker killed between ask() (which stores the trial RUNNING) and its trial's first
    heartbeat leaves a running trial with no heartbeat, and its claimed slot. The next worker
    must fail it as stale, take back the slot and run the study's trials, not wait for ever."""
    scenario = _scenario(tmp_path, 1500)
    db = f"sqlite:///{tmp_path / 'orphan.db'}"
    args = ["worker", "--scenario", str(scenario), "--storage", db, "--study", "o"]
    first = run_autotune(*args, "--trials", "2", "--heartbeat", "1", cwd=tmp_path, timeout=300)
    assert first.returncode in (0, 3), first.stderr
    storage = open_storage(db, heartbeat_s=1)
    study_id = storage.get_study_id_from_name("o")
    orphan = storage.create_new_trial(study_id)  # what the killed worker's ask() stored
    assert claim_trial(storage, "o", None)  # and the slot it had claimed first
    assert storage.get_trial(orphan).state == TrialState.RUNNING

    again = run_autotune(*args, "--trials", "3", "--heartbeat", "1", cwd=tmp_path, timeout=300)
    assert again.returncode in (0, 3), again.stderr
    trials = optuna.load_study(study_name="o", storage=db).trials
    assert {t._trial_id: t.state for t in trials}[orphan] == TrialState.FAIL
    counted = [t for t in trials if t._trial_id != orphan]
    assert len(counted) == 3 and all(t.state == TrialState.COMPLETE for t in counted)
