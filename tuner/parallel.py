"""The simulator's work on every core: worker processes, forked once a batch, that simulate and
return what they measured; this process alone asks, tells and writes the storage.

A simulated trial or hold draw is a pure function of its config, scenario and seed, so which
process ran it changes nothing, and a study's proposals are fixed by the order it asks them
in (tuner.trials), not by which worker finished first: AUTOTUNE_SIM_PROCESSES=1 gives the same
study, one trial after another.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import contextmanager

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


@contextmanager
def sim_pool(runner: Runner, width: int) -> Iterator[Executor | None]:
    """Up to `width` worker processes for a simulator's work; None (run it here) for a real
    engine, one process, or a width of one."""
    workers = min(width, sim_processes())
    if runner.name != "sim" or workers < 2:
        yield None
        return
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_ignore_interrupts) as pool:
        # Forked now, before any heartbeat thread of a trial runs (a fork copies no thread,
        # but does copy a lock one holds).
        pool.submit(_nothing).result()
        yield pool
