"""An engine as a child process: its own process group, a log file, readiness, a clean stop.

Stopping is by the group's PID only (SIGTERM, then SIGKILL after a grace period), never by
process name; the argument list is passed as is, never through a shell.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx

_PR_SET_PDEATHSIG = 1


class EngineFailed(Exception):
    """The engine could not start or stay up. kind: "start", "timeout" or "crash"."""

    def __init__(self, kind: str, message: str, log_tail: str = ""):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.log_tail = log_tail


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def choose_port(wanted: int | None, host: str = "127.0.0.1") -> int:
    """`wanted` if it is free, else a free port the kernel picks."""
    if wanted and port_is_free(wanted, host):
        return wanted
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: a new session makes the engine its own process
    # group; the parent-death signal stops it even when autotune is killed with SIGKILL.
    os.setsid()
    # Not Linux: Ctrl-C and failures still stop the group from the parent.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def tail(path: Path, lines: int = 30) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class EngineProcess:
    """`with EngineProcess(argv, env, log) as engine: engine.wait_ready(...)`; stops on exit."""

    def __init__(
        self, argv: Sequence[str], env: Mapping[str, str], log_path: Path, grace_s: float = 10.0
    ):
        self.argv = list(argv)
        self.env = dict(env)
        self.log_path = log_path
        self.grace_s = grace_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> EngineProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            log.write(("$ " + " ".join(self.argv) + "\n").encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(
                    self.argv,
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_die_with_parent,
                )
            except OSError as error:
                raise EngineFailed(
                    "start", f"cannot start {self.argv[0]}: {error.strerror}"
                ) from None
        # Beside the log, for operators (and tests) who need the engine's process group.
        self.log_path.with_name("engine.pid").write_text(f"{self.proc.pid}\n")
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 30) -> str:
        return tail(self.log_path, lines)

    def crashed(self, what: str) -> EngineFailed:
        return EngineFailed(
            "crash", f"engine exited with status {self.exited()} {what}", self.tail()
        )

    def wait_ready(
        self, probe: Callable[[], bool], timeout_s: float, interval_s: float = 0.1
    ) -> float:
        """Poll `probe` until it says ready; seconds taken. The engine exiting or the timeout
        fail."""
        started = time.monotonic()
        while True:
            if self.exited() is not None:
                raise EngineFailed(
                    "start",
                    f"engine exited with status {self.exited()} before it was ready",
                    self.tail(),
                )
            if probe():
                return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise EngineFailed(
                    "timeout", f"engine not ready after {timeout_s:g} s", self.tail()
                )
            time.sleep(interval_s)

    def stop(self) -> float:
        """SIGTERM to the group, SIGKILL after the grace period; seconds it took."""
        proc = self.proc
        if proc is None:
            return 0.0
        started = time.monotonic()
        for sig, wait_s in ((signal.SIGTERM, self.grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            if _group_gone_within(proc, wait_s):
                break
        proc.wait()
        return time.monotonic() - started


def _group_gone_within(proc: subprocess.Popen, wait_s: float) -> bool:
    # The leader may go first while workers it started (same group) still wind down.
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader, or its zombie keeps the group alive
        if not pid_alive(proc.pid, group=True):
            return True
        time.sleep(0.02)
    return False


def pid_alive(pid: int, group: bool = False) -> bool:
    """Whether a process (or, with `group`, any process of that group) still exists."""
    try:
        (os.killpg if group else os.kill)(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def http_ready(url: str) -> Callable[[], bool]:
    """A probe: GET `url` answers 200."""

    def probe() -> bool:
        try:
            return httpx.get(url, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    return probe


def log_line_ready(
    log_path: Path, line: str, fallback: Callable[[], bool] | None = None
) -> Callable[[], bool]:
    """A probe: the engine printed `line` (MindIE's "Daemon start success!"), or `fallback` says
    ready."""

    def probe() -> bool:
        try:
            if line in log_path.read_text(encoding="utf-8", errors="replace"):
                return True
        except OSError:
            pass
        return fallback() if fallback else False

    return probe
