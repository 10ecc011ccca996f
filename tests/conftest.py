from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from objectives.scenario import Scenario, load_scenario


def run_autotune(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """The real command line, in a child process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "tuner", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
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
