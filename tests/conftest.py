from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from sqlalchemy import create_engine, text

from objectives.scenario import Scenario, load_scenario
from testing.engines import engine_executable, engine_folder, engine_installed

# A test run that a non-interactive shell started in the background inherits SIGINT ignored, and
# so would every autotune it starts (an ignored signal survives exec): the Ctrl-C tests need it
# delivered as at a terminal. A Python handler is reset to the default in children on exec.
signal.signal(signal.SIGINT, signal.default_int_handler)

# Tests that start real engines run one after the other on one xdist worker: two vLLM servers at
# once would not fit the memory, and engines measuring side by side would measure each other.
ENGINE_FIXTURES = {"vllm_python", "llama_server"}


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the group into the node id
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("engines"))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """xdist groups a test by a suffix it writes into the test's node id; pytest 9 no longer
    reads what xdist 3.8 writes, so its engine tests ran on both workers at once, unnoticed
    (pyproject pins pytest below 9): a grouping that did not take is an error, not a hope."""
    if not getattr(session.config.option, "loadgroup", False):  # (an xdist worker's, set there)
        return
    ungrouped = [
        item.nodeid
        for item in session.items
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid
    ]
    if ungrouped:
        raise pytest.UsageError(
            f"xdist did not group {len(ungrouped)} engine tests (e.g. {ungrouped[0]}): "
            f"pytest {pytest.__version__} with this pytest-xdist runs them side by side"
        )


def run_autotune(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """The real command line, in a child process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "tuner", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def small_scenario(name: str = "customer-service", requests: int = 200, **workload) -> Scenario:
    base = load_scenario(name)
    update = {"num_requests": requests, **workload}
    return base.model_copy(update={"workload": base.workload.model_copy(update=update)})


@pytest.fixture
def scenario_file(tmp_path: Path) -> Path:
    path = tmp_path / "small.yaml"
    data = small_scenario().model_dump(mode="json")
    data["name"] = "small-cs"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Qwen2 (HF directory) built offline; see testing/tiny_model.py."""
    from testing.tiny_model import build_tiny_qwen2

    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def gguf_cache(tmp_path_factory) -> Path:
    """One GGUF cache for the session: the tiny model is converted once."""
    return tmp_path_factory.mktemp("gguf")


def _missing(message: str) -> None:
    """Something a test needs is not installed: CI (AUTOTUNE_REQUIRE_ENGINES) installs all of it,
    so there this fails; locally the test skips."""
    if os.environ.get("AUTOTUNE_REQUIRE_ENGINES"):
        pytest.fail(message)
    pytest.skip(message)


def _engine(engine: str) -> Path:
    """An engine .ci/setup-engines installed in ENGINES_DIR."""
    if not engine_installed(engine):
        _missing(f"{engine_folder(engine)} is not installed: run .ci/setup-engines")
    return engine_executable(engine)


def require_module(name: str, why: str):
    """A Python module a test needs (e.g. torch, which CI installs): pytest.importorskip, except
    that under AUTOTUNE_REQUIRE_ENGINES a missing one fails instead of hiding the test."""
    try:
        return importlib.import_module(name)
    except ImportError:
        _missing(f"{name} is not installed: {why}")


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    return _engine("vllm")


@pytest.fixture(scope="session")
def llama_server() -> Path:
    return _engine("llamacpp")


def calibrate_summary(stdout: str) -> dict[str, tuple[float, ...]]:
    """`autotune calibrate`'s summary table, per metric: median |% error| before, after, held out
    before and held out after (the columns it prints first)."""
    rows = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.split("│")]
        if (
            len(cells) > 6
            and cells[2].endswith("%")
            and cells[1] in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "output_tokens_per_s")
        ):
            rows[cells[1]] = tuple(
                float("inf") if c == "inf" else float(c.rstrip("%")) if c != "-" else float("nan")
                for c in cells[2:6]
            )
    return rows


# A child that waits at a gate (two pipes) before running autotune: commands started together.
GATED = (
    "import os, sys; import tuner.cli as cli; ready, go = int(sys.argv[1]), int(sys.argv[2]); "
    "os.write(ready, b'r'); os.read(go, 1); sys.argv = ['autotune'] + sys.argv[3:]; cli.main()"
)


def started_together(commands: list[list[str]], cwd: Path) -> list[subprocess.CompletedProcess]:
    """The autotune commands, started at once: each waits at a gate until all are up."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", GATED, str(ready_w), str(go_r), *command],
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                pass_fds=(ready_w, go_r),
            )
            for command in commands
        ]
        for _ in procs:
            os.read(ready_r, 1)
        os.write(go_w, b"g" * len(procs))
        results = []
        for proc, command in zip(procs, commands, strict=True):
            stdout, stderr = proc.communicate(timeout=300)
            results.append(subprocess.CompletedProcess(command, proc.returncode, stdout, stderr))
        return results
    finally:
        for fd in (ready_r, ready_w, go_r, go_w):
            os.close(fd)


# The real PostgreSQL every storage test uses (trust auth, database `test`).
POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@contextmanager
def postgres_schema(prefix: str) -> Iterator[str]:
    """A storage URL on a schema of its own, dropped afterwards: a first run's table creation
    there races as on a new database."""
    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    engine = create_engine(POSTGRES)
    with engine.begin() as connection:
        connection.execute(text(f"create schema {schema}"))
    try:
        yield f"{POSTGRES}?options=-csearch_path%3D{schema}"
    finally:
        with engine.begin() as connection:
            connection.execute(text(f"drop schema {schema} cascade"))
        engine.dispose()
