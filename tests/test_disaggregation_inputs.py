"""Bad input for a chip budget (--chips) and prefill/decode disaggregation, through the real
command line: one line naming the flag, file or field, exit status 2, nothing written. And the
inputs next to them that are fine: the same profile with the deployment fixed co-located runs, a
closed loop on a budget runs co-located only."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from runners.sim.profiles import load_hardware
from search_spaces.space import ROLE_KNOBS
from tests.conftest import run_autotune


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _space(tmp: Path, knobs: str) -> str:
    return _write(tmp / "space.yaml", f"knobs:\n{knobs}")


def _no_link_profile(tmp: Path) -> str:
    """ascend-910b2 without its kv_link block (every other figure as shipped)."""
    data = load_hardware("ascend-910b2").model_dump(mode="json")
    del data["kv_link"]
    data["name"] = "ascend-910b2-no-link"
    return _write(tmp / "no-link.yaml", yaml.safe_dump(data))


def _closed_loop(tmp: Path, scenario_file: Path) -> str:
    data = yaml.safe_load(scenario_file.read_text())
    data["workload"]["arrival"] = {"kind": "closed", "concurrency": 4}
    data["name"] = "closed-cs"
    return _write(tmp / "closed.yaml", yaml.safe_dump(data))


DISAGGREGATED = "  deployment: {value: disaggregated}\n"

# case -> (arguments after --scenario, the words the error line must hold)
CASES = {
    "disaggregated on one chip": (
        lambda tmp, sc: ["--chips", "1", "--space", _space(tmp, DISAGGREGATED)],
        ["space.yaml", "knobs.deployment", "--chips 2 or more", "--chips is 1"],
    ),
    "prefill instances fill the budget": (
        lambda tmp, sc: [
            "--chips",
            "8",
            "--space",
            _space(tmp, "  prefill_instances: {value: 8}\n"),
        ],
        ["space.yaml", "knobs.prefill_instances", "8", "--chips 8", "1..7"],
    ),
    "prefill and decode instances above the budget": (
        lambda tmp, sc: [
            "--chips",
            "8",
            "--space",
            _space(tmp, "  prefill_instances: {value: 3}\n  decode_instances: {value: 6}\n"),
        ],
        ["space.yaml", "prefill_instances + decode_instances", "3 + 6 = 9", "--chips 8"],
    ),
    "a memory share of 0": (
        lambda tmp, sc: [
            "--chips",
            "4",
            "--space",
            _space(tmp, "  prefill_memory_share: {value: 0}\n"),
        ],
        ["space.yaml", "knobs.prefill_memory_share", "0 is outside"],
    ),
    "a memory share range from 0": (
        lambda tmp, sc: [
            "--chips",
            "4",
            "--space",
            _space(tmp, "  decode_memory_share: {low: 0.0, high: 0.9}\n"),
        ],
        ["space.yaml", "knobs.decode_memory_share", "0 is outside"],
    ),
    "a memory share of 1.5": (
        lambda tmp, sc: [
            "--chips",
            "4",
            "--space",
            _space(tmp, "  decode_memory_share: {value: 1.5}\n"),
        ],
        ["space.yaml", "knobs.decode_memory_share", "1.5 is outside"],
    ),
    "a profile without kv_link when disaggregation is searched": (
        lambda tmp, sc: ["--chips", "4", "--hardware", _no_link_profile(tmp)],
        ["--hardware", "ascend-910b2-no-link", "kv_link", "deployment: co-located"],
    ),
    "disaggregated fixed under a closed loop": (
        lambda tmp, sc: [
            "--scenario",
            _closed_loop(tmp, sc),
            "--chips",
            "4",
            "--space",
            _space(tmp, DISAGGREGATED),
        ],
        ["space.yaml", "knobs.deployment", "disaggregated", "open-loop"],
    ),
}


CASES["a grid over both deployments with role knobs searched"] = (
    lambda tmp, sc: ["--chips", "4", "--sampler", "grid"],
    ["--sampler grid", "prefill_instances", "co-located"],
)
CASES["--screen on a chip budget"] = (
    lambda tmp, sc: ["--chips", "2", "--screen", "sim"],
    ["--screen", "--chips 2"],
)


def _on_runner(runner: str) -> Callable[[Path, Path], list[str]]:
    return lambda tmp, sc: ["--chips", "2", "--runner", runner]


# A real engine measures one instance. (vLLM takes a budget: runners.registry's
# CHIP_BUDGET_RUNNERS.)
for _runner in ("llamacpp", "mindie", "openai"):
    CASES[f"--chips 2 on --runner {_runner}"] = (
        _on_runner(_runner),
        ["--chips: 2", "one instance"],
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_chip_budget_input_exits_2_with_one_line(
    case: str, tmp_path: Path, scenario_file: Path
):
    make_args, expected = CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    args = make_args(tmp_path, scenario_file)
    if "--scenario" not in args:
        args = ["--scenario", str(scenario_file), *args]
    before = sorted(tmp_path.iterdir())
    result = run_autotune(*args, "--trials", "2", cwd=work, timeout=60)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("autotune: error:")
    for words in expected:
        assert words in lines[0], (words, lines[0])
    assert list(work.iterdir()) == [], "nothing may be written on bad input"
    assert sorted(tmp_path.iterdir()) == before, "nothing may be written beside the inputs"


def _trial_knobs(work: Path) -> list[dict]:
    """Every finished trial's config, as the study stored it."""
    with sqlite3.connect(work / "studies.db") as db:
        rows = db.execute(
            "SELECT value_json FROM trial_user_attributes WHERE key = 'knobs'"
        ).fetchall()
    return [json.loads(value) for (value,) in rows]


def test_a_profile_without_kv_link_runs_co_located(tmp_path: Path, scenario_file: Path):
    work = tmp_path / "work"
    work.mkdir()
    result = run_autotune(
        "--scenario",
        str(scenario_file),
        "--chips",
        "4",
        "--hardware",
        _no_link_profile(tmp_path),
        "--space",
        _space(tmp_path, "  deployment: {value: co-located}\n"),
        "--polish",
        "0",
        "--trials",
        "2",
        cwd=work,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    best = yaml.safe_load((work / "best-config.yaml").read_text())
    assert (best["chips"], best["deployment"]) == (4, "co-located")
    trials = _trial_knobs(work)
    assert len(trials) == 2
    assert all(knobs["deployment"] == "co-located" for knobs in trials)


def test_a_closed_loop_on_a_budget_searches_co_located_only(tmp_path: Path, scenario_file: Path):
    work = tmp_path / "work"
    work.mkdir()
    result = run_autotune(
        "--scenario",
        _closed_loop(tmp_path, scenario_file),
        "--chips",
        "4",
        "--polish",
        "0",
        "--trials",
        "4",
        cwd=work,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert any("co-located" in note and "open-loop" in note for note in notes), notes
    trials = _trial_knobs(work)
    assert len(trials) == 4
    for knobs in trials:
        assert knobs["deployment"] == "co-located"
        assert not set(ROLE_KNOBS) & set(knobs), knobs
