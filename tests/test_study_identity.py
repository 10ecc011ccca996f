"""A study knows what its figures stand on (issue 42, item 2): an edited hardware profile that
keeps its name, a changed quality table and a changed runner setting are each refused in one
line naming what changed, exit 2, the study's database unchanged to the byte."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from types import SimpleNamespace

import yaml

from objectives.quality import SHIPPED
from runners.engines.llamacpp import LlamaCppSettings
from runners.engines.served import ServedRunner
from runners.sim.profiles import HARDWARE
from tests.conftest import run_autotune
from tuner.assumptions import changed

RUN = ("--trials", "2", "--polish", "0", "--hold", "0", "--no-html")


def _content(db: Path) -> list[str]:
    """The database as SQL: equal when every row of every table is."""
    with sqlite3.connect(db) as connection:
        return list(connection.iterdump())


def _refused(result, *named: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    (line,) = result.stderr.strip().splitlines()
    for part in named:
        assert part in line, line


def test_an_edited_profile_with_the_same_name_is_refused(tmp_path: Path, scenario_file: Path):
    """The issue's case: a copy of ascend-910b2 with twice its bandwidth, same name; its
    trials would read other throughputs for the same knobs in one front."""
    profile = tmp_path / "hw.yaml"
    profile.write_text((HARDWARE / "ascend-910b2.yaml").read_text())
    args = ("--scenario", str(scenario_file), "--hardware", str(profile), *RUN)
    assert run_autotune(*args, cwd=tmp_path).returncode == 0
    before = _content(tmp_path / "studies.db")
    data = yaml.safe_load(profile.read_text())
    data["bandwidth_tbs"]["value"] *= 2
    data["bandwidth_tbs"]["note"] = "edited"
    profile.write_text(yaml.safe_dump(data))
    _refused(
        run_autotune(*args, cwd=tmp_path),
        "measured on other figures",
        "hardware profile bandwidth_tbs.value 1.6 -> 3.2",
        "give a new --study name",
    )
    assert _content(tmp_path / "studies.db") == before
    # only the note edited back to the figure: the same figures, so the study resumes
    data["bandwidth_tbs"]["value"] /= 2
    profile.write_text(yaml.safe_dump(data))
    assert run_autotune(*args, cwd=tmp_path).returncode == 0


def test_a_changed_quality_table_is_refused(tmp_path: Path, scenario_file: Path):
    """A stricter table puts w8a16's drop at 2.2 where the study's trials stored 0.7."""
    table = tmp_path / "quality.yaml"
    table.write_text((SHIPPED / "qwen2-7b.yaml").read_text())
    args = ("--scenario", str(scenario_file), "--quality", str(table), *RUN)
    assert run_autotune(*args, cwd=tmp_path).returncode == 0
    before = _content(tmp_path / "studies.db")
    data = yaml.safe_load(table.read_text())
    (w8a16,) = [e for e in data["models"][0]["entries"] if e.get("quantization") == "w8a16"]
    w8a16["accuracy_drop"] = 2.2
    table.write_text(yaml.safe_dump(data))
    _refused(run_autotune(*args, cwd=tmp_path), "quality table w8a16 kv 1", "0.7 -> 2.2")
    assert _content(tmp_path / "studies.db") == before


def _settings_assumptions(**fields) -> dict:
    """A llama-server runner's assumptions for these settings (the method reads only them)."""
    return ServedRunner.assumptions(SimpleNamespace(settings=LlamaCppSettings(**fields)))  # type: ignore[arg-type]


def test_a_runner_setting_that_changes_measurements_is_named_and_paths_are_not():
    """Threads and extra arguments change what llama-server measures; where its files lie,
    its port and its log folder do not (each host of a shared study has its own)."""
    base = _settings_assumptions(threads=1, engine_cmd=["/opt/a/llama-server"])
    assert changed(base, _settings_assumptions(threads=4, engine_cmd=["/opt/a/llama-server"])) == [
        "runner settings threads 1 -> 4"
    ]
    moved = _settings_assumptions(
        threads=1, engine_cmd=["/usr/local/bin/llama-server"], model=Path("/elsewhere/m"),
        port=9999, log_dir=Path("/tmp/logs"),
    )  # fmt: skip
    assert changed(base, moved) == []
    extra = _settings_assumptions(
        threads=1, engine_cmd=["/opt/a/llama-server"], extra_args=["-ub", "64"]
    )
    assert [line.split(" ", 3)[2] for line in changed(base, extra)] == ["extra_args"]


def test_a_narrower_choice_of_a_searched_knob_is_refused_up_front(
    tmp_path: Path, scenario_file: Path
):
    """Optuna keeps one set of choices per categorical parameter: a second run searching
    quantization over fewer values ended in a ValueError traceback at its first trial."""
    args = ("--scenario", str(scenario_file), *RUN)
    assert run_autotune(*args, cwd=tmp_path).returncode == 0
    before = _content(tmp_path / "studies.db")
    space = tmp_path / "space.yaml"
    space.write_text("knobs:\n  quantization: {choices: [bf16, w8a8]}\n")
    _refused(
        run_autotune(*args, "--space", str(space), cwd=tmp_path),
        "knobs.quantization: this run searches ['bf16', 'w8a8']",
        "give a new --study name",
    )
    assert _content(tmp_path / "studies.db") == before
