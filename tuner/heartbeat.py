"""Beats from a thread while a block runs: a running trial's heartbeat (Optuna's stale-trial
check fails the trial of a process that died) and the nightly lock's."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager

import optuna
from optuna.trial import TrialState
from sqlalchemy import select

from objectives.userfile import first_line
from tuner.console import err


@contextmanager
def beating(beat: Callable[[], None], every_s: float, name: str):
    """Call `beat` every `every_s` seconds from a thread (named `name`, which the log says)
    while the block runs. A beat that fails (the database away for a while, a lock lost) is
    said on stderr, one line when it starts failing and one when it beats again, and retried
    at the next beat: a thread that died silently would let the trial or lock go stale."""
    stop = threading.Event()

    def loop() -> None:
        failing = False
        while not stop.wait(every_s):
            try:
                beat()
            except Exception as error:
                if not failing:
                    err.print(
                        f"autotune: warning: {name} failed ({first_line(error)}); "
                        f"retrying every {every_s:g} s",
                        markup=False,
                        highlight=False,
                        soft_wrap=True,
                    )
                failing = True
            else:
                if failing:
                    err.print(f"autotune: {name} beats again", markup=False, highlight=False)
                failing = False

    thread = threading.Thread(target=loop, daemon=True, name=name)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def heartbeat_interval(storage: optuna.storages.RDBStorage) -> int:
    """Seconds between a running trial's heartbeats (--heartbeat)."""
    interval = storage.get_heartbeat_interval()
    assert interval is not None, "open_storage gives every storage a heartbeat interval"
    return interval


def adopt_unbeaten_trials(storage: optuna.storages.RDBStorage, study: optuna.Study) -> None:
    """Give a first heartbeat to each running trial of the study that has none. ask() stores a
    trial RUNNING before its worker records the first beat, and Optuna's stale-trial check
    passes over a trial with no heartbeat: a worker killed in between left one running for
    ever, and every worker of the study waited on it (CI: kill -9, then a rerun that hung).
    Beaten once, it is failed as stale after the grace period unless its worker beats on
    (a live one does within milliseconds: its first beat updates this row)."""
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session

    study_id = storage.get_study_id_from_name(study.study_name)
    trial = models.TrialModel
    with _create_scoped_session(storage.scoped_session) as session:
        unbeaten = session.scalars(
            select(trial.trial_id).where(
                trial.study_id == study_id,
                trial.state == TrialState.RUNNING,
                ~trial.heartbeats.any(),
            )
        ).all()
    for trial_id in unbeaten:
        storage.record_heartbeat(trial_id)  # a row its worker wrote meanwhile is left as it is


def heartbeat(storage: optuna.storages.RDBStorage, trial: optuna.Trial):
    """Keep the trial's heartbeat while it runs: if this process dies, the next one to open
    the study sees the heartbeat stop and fails the trial (Optuna's stale-trial check)."""
    storage.record_heartbeat(trial._trial_id)
    return beating(
        lambda: storage.record_heartbeat(trial._trial_id),
        heartbeat_interval(storage),
        f"the heartbeat of trial {trial.number}",
    )
