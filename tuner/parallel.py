"""The simulator's work on every core: worker processes, forked once a run, that simulate and
return what they measured; this process alone asks, tells and writes the storage.

A simulated trial or hold draw is a pure function of its config, scenario and seed, so which
process ran it changes nothing, and a study's proposals are fixed by the order it asks them
in (tuner.trials), not by which worker finished first: AUTOTUNE_SIM_PROCESSES=1 gives the same
study, one trial after another.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
from concurrent.futures import Executor, ProcessPoolExecutor

from objectives.userfile import InputError
from runners.base import Runner

PROCESSES_ENV = "AUTOTUNE_SIM_PROCESSES"


def sim_processes() -> int:
    """The worker processes the simulator may use: AUTOTUNE_SIM_PROCESSES, or one per core this
    process may run on."""
    given = os.environ.get(PROCESSES_ENV)
    if given is None:
        return len(os.sched_getaffinity(0))
    if not given.strip().isdigit() or int(given) < 1:
        raise InputError(f"{PROCESSES_ENV}={given!r}: give a whole number of processes, 1 or more")
    return int(given)


def _ignore_interrupts() -> None:
    # Ctrl-C reaches the whole process group: the parent ends the trials; a worker's traceback
    # would only bury its message.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _nothing() -> None:
    return None


_pool: ProcessPoolExecutor | None = None


def sim_pool(runner: Runner, width: int) -> Executor | None:
    """Worker processes for a simulator's work, `width` tasks at a time; None (run it here) for
    a real engine, one process, or a width of one. One pool serves the whole run: forked at
    its first use, before the study's state grows (a fork per batch copied that state's pages
    again and again: a third more CPU seconds on realtime-chat's main job)."""
    global _pool
    if runner.name != "sim" or min(width, sim_processes()) < 2:
        return None
    if _pool is None:
        context = multiprocessing.get_context("fork")
        _pool = ProcessPoolExecutor(
            sim_processes(), mp_context=context, initializer=_ignore_interrupts
        )
        # Forked now, between trials: no heartbeat thread runs (a fork copies no thread, but
        # does copy a lock one holds).
        _pool.submit(_nothing).result()
        atexit.register(_pool.shutdown, cancel_futures=True)
    return _pool
