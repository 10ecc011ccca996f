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
import time
from datetime import datetime, timezone
from pathlib import Path

import optuna
import yaml
from sqlalchemy.orm import Session

from tests.conftest import run_autotune
from tuner.export import load_export
from tuner.nightly import EXIT_FAILED, EXIT_PROMOTED, EXIT_UNCHANGED

ROOT = Path(__file__).resolve().parents[1]


def _study(tmp_path: Path, scenario_file: Path) -> str:
    db = f"sqlite:///{tmp_path / 'n.db'}"
    first = run_autotune(
        "--scenario",
        str(scenario_file),
        "--polish",
        "0",
        "--trials",
        "6",
        "--storage",
        db,
        "--export",
        "seed.yaml",
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr
    return db


def _nightly(tmp_path: Path, scenario: Path, db: str, *extra: str):
    return run_autotune(
        "nightly",
        "--scenario",
        str(scenario),
        "--storage",
        db,
        "--budget",
        "3",
        "--repeats",
        "2",
        "--export",
        "deployed.yaml",
        *extra,
        cwd=tmp_path,
    )


def _nights(tmp_path: Path) -> list[tuple]:
    return (
        sqlite3.connect(tmp_path / "n.db")
        .execute(
            "select decision, reason, incumbent, candidate from autotune_nightly_runs order by id"
        )
        .fetchall()
    )


def test_first_night_promotes_then_unchanged_then_drift(tmp_path: Path, scenario_file: Path):
    db = _study(tmp_path, scenario_file)
    first = _nightly(tmp_path, scenario_file, db)
    assert first.returncode == EXIT_PROMOTED, first.stderr
    deployed = tmp_path / "deployed.yaml"
    assert load_export(deployed).knobs
    assert "no deployed config yet" in (tmp_path / "deployed.nightly.md").read_text()

    # A second night whose best cannot beat the deployed config by the margin changes nothing.
    before = deployed.read_bytes()
    second = _nightly(tmp_path, scenario_file, db, "--min-gain", "10")
    assert second.returncode == EXIT_UNCHANGED, second.stderr
    assert deployed.read_bytes() == before
    assert not (tmp_path / "deployed.yaml.prev").exists()
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
    data = yaml.safe_load(scenario_file.read_text())
    data["sla"]["ttft_p99_ms"] = 0.001
    impossible = tmp_path / "impossible.yaml"
    impossible.write_text(yaml.safe_dump(data))
    db = f"sqlite:///{tmp_path / 'n.db'}"
    assert (
        run_autotune(
            "--scenario", str(impossible), "--trials", "3", "--storage", db, cwd=tmp_path
        ).returncode
        == 3
    )
    result = _nightly(tmp_path, impossible, db)
    assert result.returncode == EXIT_FAILED, result.stderr
    assert not (tmp_path / "deployed.yaml").exists()
    assert _nights(tmp_path)[-1][0] == "failed"


def test_lock_held_by_live_process_refuses_and_stale_lock_is_taken_over(
    tmp_path: Path, scenario_file: Path
):
    db = _study(tmp_path, scenario_file)
    name = "small-cs.sim.mindie.qwen2-7b.ascend-910b2"
    con = sqlite3.connect(tmp_path / "n.db")
    con.execute(
        "create table if not exists autotune_nightly_locks "
        "(study_name varchar primary key, holder varchar, acquired_at datetime, beat_at datetime)"
    )
    now = datetime.now(timezone.utc).isoformat(" ")
    con.execute(
        "insert into autotune_nightly_locks values (?, ?, ?, ?)",
        (name, f"{socket.gethostname()}:{os.getpid()}", now, now),
    )
    con.commit()
    held = _nightly(tmp_path, scenario_file, db)
    assert held.returncode == 2
    assert "holds the lock" in held.stderr and len(held.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "deployed.yaml").exists()

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    con.execute(
        "update autotune_nightly_locks set holder = ?", (f"{socket.gethostname()}:{dead.pid}",)
    )
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
    zero = run_autotune(
        "nightly", "--scenario", str(scenario_file), "--storage", db, "--budget", "0", cwd=tmp_path
    )
    assert zero.returncode == 2 and "--budget" in zero.stderr
    (tmp_path / "deployed.yaml").write_text("knobs: [not, a, mapping]\n")
    bad = _nightly(tmp_path, scenario_file, db)
    assert bad.returncode == 2 and "deployed.yaml" in bad.stderr
    assert (tmp_path / "deployed.yaml").read_text() == "knobs: [not, a, mapping]\n"
    unwritable = run_autotune(
        "nightly",
        "--scenario",
        str(scenario_file),
        "--storage",
        db,
        "--export",
        str(tmp_path / "no" / "dir.yaml"),
        cwd=tmp_path,
    )
    assert unwritable.returncode == 2 and "--export" in unwritable.stderr


def _autotune_args(command: list[str]) -> list[str]:
    at = next(i for i, part in enumerate(command) if part.endswith("autotune"))
    return command[at + 1 :]


def _check_nightly_command(args: list[str]) -> None:
    """The deploy file's command line parses against the real CLI (autotune nightly --help)."""
    assert args[0] == "nightly"
    help_text = run_autotune("nightly", "--help", cwd=ROOT).stdout
    for flag in (a for a in args[1:] if a.startswith("--")):
        assert flag in help_text, flag


def test_deploy_files_parse_and_name_real_commands():
    cron = [
        line
        for line in (ROOT / "deploy/crontab").read_text().splitlines()
        if line and not line.startswith("#")
    ]
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
    # A Job fails on any non-zero exit: there a promotion must exit 0.
    command = container["command"]
    assert command[command.index("--promoted-exit") + 1] == "0"
    secret = container["env"][0]["valueFrom"]["secretKeyRef"]
    assert secret["name"] and secret["key"]


def test_warm_start_remeasures_the_front_then_runs_the_budget(tmp_path: Path, scenario_file: Path):
    db = _study(tmp_path, scenario_file)
    con = sqlite3.connect(tmp_path / "n.db")
    front = [
        json.loads(p)
        for (p,) in con.execute(
            "select params from autotune_pareto_members "
            "where snapshot_id = (select max(id) from autotune_pareto_snapshots) "
            "order by ttft_p99_ms"
        )
    ]
    assert front
    night = _nightly(tmp_path, scenario_file, db, "--promoted-exit", "0")
    assert night.returncode == 0, (
        night.stderr
    )  # promoted (a first night), told as 0 as a Kubernetes Job wants
    assert _nights(tmp_path)[-1][0] == "promoted"
    study = optuna.load_study(study_name="small-cs.sim.mindie.qwen2-7b.ascend-910b2", storage=db)
    tonight = study.trials[6:]
    assert len(tonight) == len(front) + 3  # the front again, then --budget new configs
    warm = tonight[: len(front)]
    assert all(t.user_attrs.get("warm_start") for t in warm)
    assert sorted(json.dumps(t.user_attrs["knobs"], sort_keys=True) for t in warm) == sorted(
        json.dumps(p, sort_keys=True) for p in front
    )
    assert not any(t.user_attrs.get("warm_start") for t in tonight[len(front) :])


def test_a_night_whose_measurements_all_failed_stores_no_nan(tmp_path: Path, scenario_file: Path):
    db = _study(tmp_path, scenario_file)
    seed = load_export(tmp_path / "seed.yaml").model_dump()
    seed["knobs"] |= {
        "max_prefill_tokens": 1_000_000
    }  # activations alone overflow the device: never runs
    (tmp_path / "deployed.yaml").write_text(yaml.safe_dump(seed))
    night = _nightly(tmp_path, scenario_file, db)
    assert night.returncode == EXIT_PROMOTED, (
        night.stderr
    )  # drift: the deployed config cannot run at all
    stored = (
        sqlite3.connect(tmp_path / "n.db")
        .execute("select incumbent from autotune_nightly_runs order by id desc")
        .fetchone()[0]
    )
    assert "NaN" not in stored and "Infinity" not in stored
    incumbent = json.loads(stored)
    assert incumbent["ttft_p99_ms_mean"] is None and not incumbent["feasible_all"]
    assert all(r["fault"] for r in incumbent["repeats"])


def test_lock_is_kept_alive_while_the_night_runs(tmp_path: Path):
    from sqlalchemy import create_engine

    from tuner.nightly import acquire_lock, lock_kept, release_lock
    from tuner.storage import Base, NightlyLock

    engine = create_engine(f"sqlite:///{tmp_path / 'lock.db'}")
    Base.metadata.create_all(engine)
    acquire_lock(engine, "s")

    def beat_at():
        with Session(engine) as session:
            return session.get(NightlyLock, "s").beat_at

    first = beat_at()
    with lock_kept(engine, "s", every_s=0.05):
        time.sleep(0.5)
    assert beat_at() > first
    release_lock(engine, "s")


def test_a_study_refuses_a_scenario_whose_measures_changed(tmp_path: Path, scenario_file: Path):
    db = _study(tmp_path, scenario_file)
    data = yaml.safe_load(scenario_file.read_text())
    data["sla"]["ttft_p99_ms"] = 900
    scenario_file.write_text(yaml.safe_dump(data))
    again = run_autotune(
        "--scenario", str(scenario_file), "--trials", "1", "--storage", db, cwd=tmp_path
    )
    assert again.returncode == 2 and "measured under another scenario (sla changed)" in again.stderr
    assert (
        len(
            optuna.load_study(
                study_name="small-cs.sim.mindie.qwen2-7b.ascend-910b2", storage=db
            ).trials
        )
        == 6
    )
    data["description"] = "reworded"  # words alone change no measurement
    data["sla"]["ttft_p99_ms"] = 500
    scenario_file.write_text(yaml.safe_dump(data))
    assert (
        run_autotune(
            "--scenario", str(scenario_file), "--trials", "1", "--storage", db, cwd=tmp_path
        ).returncode
        == 0
    )
