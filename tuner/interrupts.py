"""Ctrl-C (and SIGTERM, which the CLI turns into Ctrl-C) held back while a step must not be cut
in two: Optuna's ask() stores a RUNNING trial, then runs its sampler's before_trial, before it
returns the trial; an interrupt in between would leave a RUNNING trial that no one holds to end."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

HELD = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Run the block whole; an interrupt that arrived meanwhile is raised (KeyboardInterrupt)
    as the block ends. Signal handlers live in the main thread only: elsewhere, nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    # A signal the process ignores (started by nohup, or in the background) stays ignored.
    previous = {
        signum: signal.signal(signum, lambda signum, frame: arrived.append(signum))
        for signum in HELD
        if signal.getsignal(signum) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if arrived:
        raise KeyboardInterrupt
