"""Nightly re-tuning against real SQLite files, the lock, and the deploy files."""

from __future__ import annotations

import configparser
import json
import os
import shlex
import socket
import sqlite3
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import yaml

from tests.conftest import run_autotune
from tuner.export import load_export
from tuner.nightly import EXIT_FAILED, EXIT_PROMOTED, EXIT_UNCHANGED

ROOT = Path(__file__).resolve().parents[1]


def _study(tmp_path: Path, scenario_file: Path) -> str:
    db = f"sqlite:///{tmp_path / 'n.db'}"
    first = run_autotune("--scenario", str(scenario_file), "--trials", "6", "--storage", db, "--export", "seed.yaml",
                         cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    return db


def _nightly(tmp_path: Path, scenario: Path, db: str, *extra: str):
    return run_autotune("nightly", "--scenario", str(scenario), "--storage", db, "--budget", "3", "--repeats", "2",
                        "--export", "deployed.yaml", *extra, cwd=tmp_path)


def _nights(tmp_path: Path) -> list[tuple]:
    return sqlite3.connect(tmp_path / "n.db").execute(
        "select decision, reason, incumbent, candidate from autotune_nightly_runs order by id").fetchall()


def test_first_night_promotes_then_unchanged_then_drift(tmp_path: Path, scenario_file: Path):
    db = _study(tmp_path, scenario_file)
    first = _nightly(tmp_path, scenario_file, db)
    assert first.returncode == EXIT_PROMOTED, first.stderr
    deployed = tmp_path / "deployed.yaml"
    assert load_export(deployed).knobs
    assert "no deployed config yet" in (tmp_path / "deployed.nightly.md").read_text()

    before = deployed.read_bytes()
    second = _nightly(tmp_path, scenario_file, db)
    assert second.returncode in (EXIT_UNCHANGED, EXIT_PROMOTED), second.stderr
    if second.returncode == EXIT_UNCHANGED:
        assert deployed.read_bytes() == before
    nights = _nights(tmp_path)
    assert [n[0] for n in nights][:1] == ["promoted"] and len(nights) == 2
    assert len(json.loads(nights[1][2])["repeats"]) == 2

    # Drift: the deployed config now misses the SLA (one sequence at a time cannot keep up).
    data = yaml.safe_load(deployed.read_text())
    data["knobs"].update(batch_size=1, max_prefill_batch_size=1)
    deployed.write_text(yaml.safe_dump(data))
    drifted = deployed.read_text()
    third = _nightly(tmp_path, scenario_file, db)
    assert third.returncode == EXIT_PROMOTED, third.stderr
    assert "DRIFT" in (tmp_path / "deployed.nightly.md").read_text()
    assert "DRIFT" in third.stderr
    assert (tmp_path / "deployed.yaml.prev").read_text() == drifted
    assert load_export(deployed).knobs["batch_size"] != 1

    listed = run_autotune("history", "--storage", db, cwd=tmp_path)
    assert listed.returncode == 0 and "small-cs" in listed.stdout
    decisions = [n[0] for n in _nights(tmp_path)]
    assert decisions[0] == decisions[2] == "promoted" and len(decisions) == 3


def test_nothing_feasible_promotes_nothing(tmp_path: Path, scenario_file: Path):
    db = _study(tmp_path, scenario_file)
    data = yaml.safe_load(scenario_file.read_text())
    data["sla"]["ttft_p99_ms"] = 0.001
    impossible = tmp_path / "impossible.yaml"
    impossible.write_text(yaml.safe_dump(data))
    result = _nightly(tmp_path, impossible, db, "--study", "small-cs.sim.mindie.qwen2-7b.ascend-910b2")
    assert result.returncode == EXIT_FAILED, result.stderr
    assert not (tmp_path / "deployed.yaml").exists()
    assert _nights(tmp_path)[-1][0] == "failed"


def test_lock_held_by_live_process_refuses_and_stale_lock_is_taken_over(tmp_path: Path, scenario_file: Path):
    db = _study(tmp_path, scenario_file)
    name = "small-cs.sim.mindie.qwen2-7b.ascend-910b2"
    con = sqlite3.connect(tmp_path / "n.db")
    con.execute("create table if not exists autotune_nightly_locks (study_name varchar primary key, holder varchar, "
                "acquired_at datetime, beat_at datetime)")
    now = datetime.now(timezone.utc).isoformat(" ")
    con.execute("insert into autotune_nightly_locks values (?, ?, ?, ?)", (name, f"{socket.gethostname()}:{os.getpid()}", now, now))
    con.commit()
    held = _nightly(tmp_path, scenario_file, db)
    assert held.returncode == 2
    assert "holds the lock" in held.stderr and len(held.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "deployed.yaml").exists()

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    con.execute("update autotune_nightly_locks set holder = ?", (f"{socket.gethostname()}:{dead.pid}",))
    con.commit()
    taken = _nightly(tmp_path, scenario_file, db)
    assert taken.returncode == EXIT_PROMOTED, taken.stderr
    assert "stale nightly lock" in taken.stderr
    assert con.execute("select count(*) from autotune_nightly_locks").fetchone()[0] == 0


def test_nightly_bad_input(tmp_path: Path, scenario_file: Path):
    missing = _nightly(tmp_path, scenario_file, f"sqlite:///{tmp_path / 'none.db'}")
    assert missing.returncode == 2 and "no study" in missing.stderr
    assert not (tmp_path / "none.db").exists()
    db = _study(tmp_path, scenario_file)
    zero = run_autotune("nightly", "--scenario", str(scenario_file), "--storage", db, "--budget", "0", cwd=tmp_path)
    assert zero.returncode == 2 and "--budget" in zero.stderr
    (tmp_path / "deployed.yaml").write_text("knobs: [not, a, mapping]\n")
    bad = _nightly(tmp_path, scenario_file, db)
    assert bad.returncode == 2 and "deployed.yaml" in bad.stderr
    assert (tmp_path / "deployed.yaml").read_text() == "knobs: [not, a, mapping]\n"
    unwritable = run_autotune("nightly", "--scenario", str(scenario_file), "--storage", db,
                              "--export", str(tmp_path / "no" / "dir.yaml"), cwd=tmp_path)
    assert unwritable.returncode == 2 and "--export" in unwritable.stderr


def _autotune_args(command: list[str]) -> list[str]:
    at = next(i for i, part in enumerate(command) if part.endswith("autotune"))
    return command[at + 1:]


def _check_nightly_command(args: list[str]) -> None:
    """The deploy file's command line parses against the real CLI (autotune nightly --help)."""
    assert args[0] == "nightly"
    help_text = run_autotune("nightly", "--help", cwd=ROOT).stdout
    for flag in (a for a in args[1:] if a.startswith("--")):
        assert flag in help_text, flag


def test_deploy_files_parse_and_name_real_commands():
    cron = [line for line in (ROOT / "deploy/crontab").read_text().splitlines() if line and not line.startswith("#")]
    assert len(cron) == 1
    fields = cron[0].split(None, 5)
    assert len(fields) == 6 and fields[0] == "30" and fields[1] == "2"
    command = shlex.split(fields[5].split("&&", 1)[1].split(">>")[0])
    _check_nightly_command(_autotune_args(command))

    service = configparser.ConfigParser(strict=True, interpolation=None)
    service.read(ROOT / "deploy/autotune-nightly.service")
    assert service["Service"]["Type"] == "oneshot"
    _check_nightly_command(_autotune_args(shlex.split(service["Service"]["ExecStart"])))
    timer = configparser.ConfigParser(strict=True, interpolation=None)
    timer.read(ROOT / "deploy/autotune-nightly.timer")
    assert timer["Timer"]["OnCalendar"] and timer["Install"]["WantedBy"] == "timers.target"

    job = yaml.safe_load((ROOT / "deploy/k8s-cronjob.yaml").read_text())
    assert job["kind"] == "CronJob" and job["spec"]["concurrencyPolicy"] == "Forbid"
    container = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    _check_nightly_command(container["command"][1:])
    secret = container["env"][0]["valueFrom"]["secretKeyRef"]
    assert secret["name"] and secret["key"]
