"""The outside bad-input battery (issue 19): each case exits 2 with one line naming the flag or
field and what is allowed, and writes nothing; two first runs on one new database both complete."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml

from tests.conftest import postgres_schema, run_autotune, started_together
from tests.test_bad_input import _quality_table, _scenario_with, _write

# 10 values, each level ten of the one before: 10^8 once expanded, in 400 bytes.
ALIAS_BOMB = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 8)
)
LONG_NAME = "a" * 300  # longer than the 255 bytes a file name may have on Linux filesystems


def _to_dev_null(tmp: Path, name: str) -> str:
    """A link to /dev/null: what writing it would destroy is the link itself, never the device."""
    link = tmp / name
    link.symlink_to("/dev/null")
    return str(link)


def _fifo(tmp: Path, name: str) -> str:
    os.mkfifo(tmp / name)
    return str(tmp / name)


def _hardware_share(tmp: Path, value: float) -> str:
    from runners.sim.profiles import load_hardware

    data = load_hardware("h100").model_dump(mode="json")
    data["mbu"]["value"] = value
    return _write(tmp / "hw.yaml", yaml.safe_dump(data))


CASES = {
    # 1. an output that exists must be a regular file
    "export to a link to /dev/null": (
        lambda tmp, sc: ["--scenario", str(sc), "--export", _to_dev_null(tmp, "null.yaml")],
        "--export: ",
        "is not a regular file",
    ),
    "html to a link to /dev/null": (
        lambda tmp, sc: ["--scenario", str(sc), "--html", _to_dev_null(tmp, "null.html")],
        "--html: ",
        "is not a regular file",
    ),
    "export to a pipe": (
        lambda tmp, sc: ["--scenario", str(sc), "--export", _fifo(tmp, "pipe.yaml")],
        "--export: ",
        "is not a regular file",
    ),
    "report -o to a link to /dev/null": (
        lambda tmp, sc: ["report", "-o", _to_dev_null(tmp, "null.html")],
        "-o: ",
        "is not a regular file",
    ),
    # 3.
    "timeout nan": (
        lambda tmp, sc: ["--scenario", str(sc), "--timeout", "nan"],
        "'--timeout'",
        "not a finite number",
    ),
    # 4.
    "worker trials beyond any integer column": (
        lambda tmp, sc: ["worker", "--scenario", str(sc), "--trials", "99999999999999999999"],
        "'--trials'",
        "1<=x<=1000000",
    ),
    "seed below numpy's range": (
        lambda tmp, sc: ["--scenario", str(sc), "--seed", "-1"],
        "'--seed'",
        "0<=x<=4294967295",
    ),
    "seed above numpy's range": (
        lambda tmp, sc: ["--scenario", str(sc), "--seed", "99999999999999999999"],
        "'--seed'",
        "0<=x<=4294967295",
    ),
    "heartbeat past what a wait can take": (
        lambda tmp, sc: ["--scenario", str(sc), "--heartbeat", "10000000000"],
        "'--heartbeat'",
        "1<=x<=3600",
    ),
    "export name too long": (
        lambda tmp, sc: ["--scenario", str(sc), "--export", str(tmp / f"{LONG_NAME}.yaml")],
        "--export: ",
        "File name too long",
    ),
    "html name too long": (
        lambda tmp, sc: ["--scenario", str(sc), "--html", str(tmp / f"{LONG_NAME}.html")],
        "--html: ",
        "File name too long",
    ),
    "export folder name too long": (
        lambda tmp, sc: ["--scenario", str(sc), "--export", str(tmp / LONG_NAME / "best.yaml")],
        "--export: ",
        "File name too long",
    ),
    "calibrate seed below numpy's range": (
        lambda tmp, sc: ["calibrate", "--seed", "-1", "-o", "c.yaml"],
        "'--seed'",
        "0<=x<=4294967295",
    ),
    # 7. the flag given is the one named
    "profile-hardware base unknown": (
        lambda tmp, sc: ["profile-hardware", "--base", "no-such", "-o", "hw.yaml"],
        "--base: unknown profile 'no-such'",
        "presets",
    ),
    # 8. (a closed loop with fewer requests than in flight is no longer refused: each window
    # sends at least 10 requests per request in flight, runners.load.capacity.CLOSED_WINDOW_CYCLES)
    "a boolean for a rate": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d.update(load={"min_rate": True})),
        ],
        "load.min_rate: ",
        "valid number",
    ),
    "a boolean for a count": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d["workload"].update(num_requests=True)),
        ],
        "workload.num_requests: ",
        "valid integer",
    ),
    "negative workload seed": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d["workload"].update(seed=-1)),
        ],
        "workload.seed: ",
        "greater than or equal to 0",
    ),
    # 10.
    "no-html with html": (
        lambda tmp, sc: ["--scenario", str(sc), "--no-html", "--html", str(tmp / "r.html")],
        "--no-html: given with --html",
        "give one of them",
    ),
    "peak rate beyond any deployment": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(tmp, sc, lambda d: d.update(load={"peak_rate": 1e300})),
        ],
        "load.peak_rate: ",
        "less than or equal to 1000000",
    ),
    # item 8 of the issue: an achieved share of a peak cannot exceed it
    "hardware bandwidth share above 1": (
        lambda tmp, sc: ["--scenario", str(sc), "--hardware", _hardware_share(tmp, 1.5)],
        "hw.yaml: mbu: ",
        "at most 1.0",
    ),
    # issue 30, item 4: user files read safely (these hung for minutes or raised a traceback)
    "alias bomb in a scenario": (
        lambda tmp, sc: ["--scenario", _write(tmp / "bomb.yaml", ALIAS_BOMB)],
        "bomb.yaml: its aliases expand to more than 100,000 values",
    ),
    "alias bomb in --space": (
        lambda tmp, sc: ["--scenario", str(sc), "--space", _write(tmp / "bomb.yaml", ALIAS_BOMB)],
        "bomb.yaml: its aliases expand to more than 100,000 values",
    ),
    "alias bomb in --runner-config": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--runner",
            "vllm",
            "--runner-config",
            _write(tmp / "bomb.yaml", ALIAS_BOMB),
        ],
        "bomb.yaml: its aliases expand to more than 100,000 values",
    ),
    "self-containing alias in a scenario": (
        lambda tmp, sc: ["--scenario", _write(tmp / "self.yaml", "workload: &a [*a]\n")],
        "self.yaml: a YAML alias refers to a node that contains it",
    ),
    "20,000 nested lists in --space": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--space",
            _write(tmp / "deep.yaml", "[" * 20000 + "]" * 20000),
        ],
        "deep.yaml: nested too deeply; at most 100 levels",
    ),
    # issue 30, item 3: wrong exits and tracebacks of the third battery
    "export to a folder name": (
        lambda tmp, sc: ["--scenario", str(sc), "--export", "newdir/"],
        "--export",
        "names a directory",
    ),
    "a fixed max_prefill_tokens below the longest prompt": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--space",
            _write(tmp / "space.yaml", "knobs:\n  max_prefill_tokens: {value: 64}\n"),
        ],
        "knobs.max_prefill_tokens: 64 is below the longest prompt",
    ),
    # issue 42: three doomed trials, then exit 3
    "a host tier with prefix caching fixed off": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--engine",
            "vllm",
            "--space",
            _write(
                tmp / "space.yaml",
                "knobs:\n  kv_host_gb: {value: 8}\n  prefix_caching: {value: false}\n",
            ),
        ],
        "knobs.kv_host_gb: every value needs prefix_caching",
    ),
    "a negative accuracy drop in a quality table": (
        lambda tmp, sc: [
            "--scenario",
            str(sc),
            "--quality",
            _quality_table(tmp, lambda entries: entries[-1].update(accuracy_drop=-2.0)),
        ],
        "accuracy_drop: Input should be greater than or equal to 0",
    ),
    "a lognormal sigma whose mean overflows": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(
                tmp,
                sc,
                lambda d: d["workload"].update(
                    input_tokens={
                        "kind": "lognormal",
                        "median": 300,
                        "sigma": 38,
                        "min": 1,
                        "max": 700,
                    }
                ),
            ),
        ],
        "workload.input_tokens.lognormal.sigma: Input should be less than or equal to 10",
    ),
    "a rate of 5e-324": (
        lambda tmp, sc: [
            "--scenario",
            _scenario_with(
                tmp, sc, lambda d: d["workload"].update(arrival={"kind": "poisson", "rate": 5e-324})
            ),
        ],
        "workload.arrival.poisson.rate: Input should be greater than or equal to 0.001",
    ),
}


def _assert_one_line(result: subprocess.CompletedProcess, *expected: str) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("autotune: error:"), lines[0]
    for part in expected:
        assert part in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_battery_case_exits_2_with_one_line_and_writes_nothing(
    case: str, tmp_path: Path, scenario_file: Path
):
    make_args, *expected = CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    args = make_args(tmp_path, scenario_file)
    before = {p: p.lstat() for p in tmp_path.iterdir()}
    _assert_one_line(run_autotune(*args, cwd=work, timeout=120), *expected)
    assert list(work.iterdir()) == [], "nothing may be written on bad input"
    after = {p: p.lstat() for p in tmp_path.iterdir()}
    assert sorted(after) == sorted(before), "nothing may be written beside the inputs either"
    for (
        path,
        info,
    ) in before.items():  # (a folder's time changes with the probe that checks it is writable)
        assert stat.S_ISDIR(info.st_mode) or (after[path].st_ino, after[path].st_mtime_ns) == (
            info.st_ino,
            info.st_mtime_ns,
        ), f"{path} was replaced"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def _tiny_openai_runner(tmp: Path, scenario: Path, model: Path) -> list[str]:
    """The openai runner against a server that is not there: it reaches the study, every trial
    fails. The scenario asks no quality (a running server's cannot be measured against bf16)."""
    config = _write(
        tmp / "runner.yaml",
        f"base_url: http://127.0.0.1:1\nserved_model: m\nmodel: {model}\n"
        "warmup_requests: 0\nrequest_timeout_s: 5\nready_timeout_s: 5\n",
    )
    return [
        "--scenario",
        _scenario_with(tmp, scenario, lambda d: d.pop("quality", None)),
        "--polish",
        "0",
        "--runner",
        "openai",
        "--runner-config",
        config,
    ]


def test_screen_hardware_unknown_names_screen_hardware(
    tmp_path: Path, scenario_file: Path, tiny_model: Path
):
    result = run_autotune(
        *_tiny_openai_runner(tmp_path, scenario_file, tiny_model),
        "--screen",
        "sim",
        "--screen-hardware",
        "no-such",
        cwd=tmp_path,
    )
    _assert_one_line(result, "--screen-hardware: unknown profile 'no-such'")
    assert not (tmp_path / "studies.db").exists()


def _without_torch(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The CLI in a Python where `import torch` fails, as on a host without PyTorch."""
    code = (
        "import sys; sys.modules['torch'] = None; sys.argv[0] = 'autotune'; "
        "from tuner.cli import main; main()"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_without_torch_the_gp_hint_shows_its_extra_and_transformers_stays_quiet(
    tmp_path: Path, scenario_file: Path, tiny_model: Path
):
    # 6: rich read "[gp]" as markup and printed `pip install 'autotune' for gp`.
    result = _without_torch(
        *_tiny_openai_runner(tmp_path, scenario_file, tiny_model),
        "--trials",
        "1",
        "--no-html",
        cwd=tmp_path,
    )
    assert result.returncode == 3, result.stderr  # the only trial failed: nothing to export
    assert "pip install 'autotune[gp]' for gp" in result.stderr
    # 9: loading the tokenizer without PyTorch printed transformers' advice on stderr.
    assert "PyTorch was not found" not in result.stderr + result.stdout


def test_a_model_folder_transformers_cannot_read_is_one_line_without_torch(
    tmp_path: Path, scenario_file: Path
):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "no-such-architecture"}')
    work = tmp_path / "work"
    work.mkdir()
    result = _without_torch("--scenario", str(scenario_file), "--model", str(model), cwd=work)
    _assert_one_line(result, "config.json: not a model config transformers can read")
    assert list(work.iterdir()) == []


def _plain_optuna_database(path: Path) -> None:
    study = optuna.create_study(
        storage=f"sqlite:///{path}", study_name="plain", directions=["minimize", "maximize"]
    )
    study.optimize(lambda trial: (trial.suggest_float("x", 0, 1), 1.0), n_trials=2)


def _tables(path: Path) -> set[str]:
    return {
        name
        for (name,) in sqlite3.connect(path).execute(
            "select name from sqlite_master where type = 'table'"
        )
    }


@pytest.mark.parametrize(
    "command",
    [
        ["report", "-o", "r.html"],
        ["pareto"],
        ["export", "--export", "e.yaml"],
        ["calibrate", "-o", "c.yaml"],
    ],
)
def test_commands_on_a_plain_optuna_database_refuse_it_and_change_nothing(
    command: list[str], tmp_path: Path
):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    db = tmp_path / "plain.db"
    _plain_optuna_database(db)
    tables, digest = _tables(db), hashlib.sha256(db.read_bytes()).hexdigest()
    result = run_autotune(*command, "--storage", f"sqlite:///{db}", cwd=tmp_path)
    line = _assert_one_line(result, "--study plain: not an autotune study")
    assert "--engine" not in line  # calibrate blamed a flag that was not given
    assert _tables(db) == tables and not any(t.startswith("autotune_") for t in _tables(db))
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.db"]


def test_history_on_a_plain_optuna_database_lists_nothing_and_creates_no_table(tmp_path: Path):
    db = tmp_path / "plain.db"
    _plain_optuna_database(db)
    tables = _tables(db)
    result = run_autotune("history", "--storage", f"sqlite:///{db}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert _tables(db) == tables


def test_a_database_without_optuna_tables_is_refused_untouched(tmp_path: Path):
    db = tmp_path / "other.db"
    sqlite3.connect(db).execute("create table notes (text varchar)").connection.commit()
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    result = run_autotune("pareto", "--storage", f"sqlite:///{db}", cwd=tmp_path)
    _assert_one_line(result, "--storage: ", "holds no Optuna studies")
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest


# Two processes held at a gate until both have imported everything, then let go together: the
# window in which both find the new database's schema missing (4 of 7 runs outside, every run here).
@pytest.mark.parametrize("round_", range(3))
def test_two_first_runs_on_a_new_database_both_complete(
    round_: int, tmp_path: Path, scenario_file: Path
):
    db = tmp_path / "new.db"
    worker = round_ == 2  # `worker` shares one total; the plain command adds its own trials
    commands = [
        ["worker"] * worker
        + [
            "--scenario",
            str(scenario_file),
            "--trials",
            "4" if worker else "2",
            "--storage",
            f"sqlite:///{db}",
            "--export",
            str(tmp_path / f"best{i}.yaml"),
            "--no-html",
        ]
        + ([] if worker else ["--polish", "0"])  # plain runs only: a worker does not polish
        for i in range(2)
    ]
    for result in started_together(commands, tmp_path):
        assert result.returncode in (0, 3), (
            result.stderr
        )  # 3: no feasible config in so few trials, not an error
    study = optuna.load_study(
        study_name="small-cs.sim.mindie.qwen2-7b.ascend-910b2", storage=f"sqlite:///{db}"
    )
    assert len(study.trials) == 4


def test_two_first_workers_on_a_new_postgresql_schema_both_complete(
    tmp_path: Path, scenario_file: Path
):
    """The same race on PostgreSQL (pg_type's unique index there), in a schema of its own."""
    with postgres_schema("race") as url:
        commands = [
            [
                "worker",
                "--scenario",
                str(scenario_file),
                "--trials",
                "4",
                "--storage",
                url,
                "--export",
                str(tmp_path / f"best{i}.yaml"),
                "--no-html",
            ]
            for i in range(2)
        ]
        for result in started_together(commands, tmp_path):
            assert result.returncode in (0, 3), result.stderr
        assert (
            len(
                optuna.load_study(
                    study_name="small-cs.sim.mindie.qwen2-7b.ascend-910b2", storage=url
                ).trials
            )
            == 4
        )
