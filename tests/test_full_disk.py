"""An export onto a full disk, after the study: one line naming --export and how to write it
later, exit 2, and every measured trial kept. The full disk is a real one: a 64 KiB tmpfs,
filled (mounting needs root, which CI's machine has; elsewhere the test skips)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import optuna
import pytest

from tests.conftest import run_autotune


@pytest.fixture
def full_disk(tmp_path: Path):
    mount = tmp_path / "full"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"x" * 4096):
                pass
        except OSError:
            pass  # full
        os.close(fd)
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_an_export_onto_a_full_disk_is_one_line_and_keeps_the_trials(
    tmp_path: Path, scenario_file: Path, full_disk: Path
):
    result = run_autotune(
        "--scenario", str(scenario_file), "--trials", "2", "--polish", "0", "--no-html",
        "--export", str(full_disk / "best.yaml"), cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("autotune: error: --export: cannot write"), lines[-1]
    assert "No space left on device" in lines[-1] and "autotune export --study" in lines[-1]
    assert not (full_disk / "best.yaml").exists()
    assert [p.name for p in full_disk.iterdir()] == ["filler"], "no temporary file left behind"
    (study,) = optuna.get_all_study_summaries(f"sqlite:///{tmp_path / 'studies.db'}")
    assert study.n_trials == 2
