"""The engine process lifecycle, with small stand-in engine scripts written by the tests
(real processes, real signals, real sockets): own process group, SIGTERM then SIGKILL, no
process left behind, readiness timeout, a missing binary, a taken port, autotune killed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from runners.engines.process import (
    EngineFailed,
    EngineProcess,
    choose_port,
    http_ready,
    log_line_ready,
    port_is_free,
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; only its parent's wait is missing.
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "stand_in_engine.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


STUBBORN = """
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # an engine that ignores SIGTERM
    ignores_sigterm = "signal.signal(signal.SIGTERM, signal.SIG_IGN)"
    child = subprocess.Popen(
        [sys.executable, "-c", f"import signal, time; {ignores_sigterm}; time.sleep(600)"]
    )
    print("child", child.pid, flush=True)
    print("ready", flush=True)
    time.sleep(600)
"""


def _child_pid(log: Path) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("child "):
                return int(line.split()[1])
        time.sleep(0.05)
    raise AssertionError("the stand-in never printed its child's pid")


def test_engine_runs_in_its_own_group_and_stop_kills_the_whole_group(tmp_path):
    log = tmp_path / "engine.log"
    with EngineProcess(_script(tmp_path, STUBBORN), os.environ, log, grace_s=0.5) as engine:
        assert os.getpgid(engine.pid) == engine.pid != os.getpgid(0)
        engine.wait_ready(log_line_ready(log, "ready"), timeout_s=10)
        child = _child_pid(log)
        assert os.getpgid(child) == engine.pid
        took = engine.stop()
    assert took >= 0.5  # SIGTERM was ignored for the whole grace period, then SIGKILL
    assert not _alive(engine.pid) and _wait_gone(child)


def test_engine_that_exits_early_is_a_start_failure_with_its_log(tmp_path):
    argv = _script(tmp_path, 'import sys; print("error: unknown flag --bogus"); sys.exit(3)')
    with (
        pytest.raises(EngineFailed) as failure,
        EngineProcess(argv, os.environ, tmp_path / "engine.log") as engine,
    ):
        engine.wait_ready(lambda: False, timeout_s=10)
    assert failure.value.kind == "start" and "status 3" in failure.value.message
    assert "unknown flag --bogus" in failure.value.log_tail


def test_missing_binary_is_a_start_failure(tmp_path):
    with (
        pytest.raises(EngineFailed) as failure,
        EngineProcess([str(tmp_path / "no-such-engine")], os.environ, tmp_path / "engine.log"),
    ):
        pass
    assert failure.value.kind == "start" and "no-such-engine" in failure.value.message


def test_engine_that_never_gets_ready_times_out_and_is_stopped(tmp_path):
    argv = _script(tmp_path, "import time; time.sleep(600)")
    with (
        pytest.raises(EngineFailed) as failure,
        EngineProcess(argv, os.environ, tmp_path / "engine.log", grace_s=1) as engine,
    ):
        engine.wait_ready(http_ready(f"http://127.0.0.1:{choose_port(None)}/health"), timeout_s=0.5)
    assert failure.value.kind == "timeout"
    assert _wait_gone(engine.pid)


def test_taken_port_is_replaced():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert not port_is_free(port)
        other = choose_port(port)
        assert other != port and port_is_free(other)


def test_engine_dies_with_autotune_even_on_sigkill(tmp_path):
    """autotune killed with SIGKILL runs no cleanup: the parent-death signal stops the engine."""
    engine_log = tmp_path / "engine.log"
    parent = _script(
        tmp_path,
        f"""
        import os, sys, time
        sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
        from runners.engines.process import EngineProcess
        up = "import time; print('up', flush=True); time.sleep(600)"
        engine = EngineProcess([sys.executable, "-c", up],
                               os.environ, __import__("pathlib").Path({str(engine_log)!r}))
        engine.__enter__()
        print(engine.pid, flush=True)
        time.sleep(600)
    """,
    )
    proc = subprocess.Popen(parent, stdout=subprocess.PIPE, text=True)
    engine_pid = int(proc.stdout.readline())
    assert _alive(engine_pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _wait_gone(engine_pid), "the engine outlived a SIGKILLed autotune"
