"""Trace workloads (objectives.trace): each format's reader on files the test writes and on the
shared public traces, the window, the rate multiple, the context policy, and bad traces refused
in one line with exit status 2 and nothing written."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from objectives.scenario import Scenario, Workload
from objectives.trace import Trace
from objectives.trace_formats import TraceError, read_window
from tests.conftest import run_autotune

ROOT = Path(__file__).resolve().parents[1]
AZURE = ROOT / "objectives" / "presets" / "traces" / "azure-conv-2023-11-16.csv.gz"
MOONCAKE = ROOT / "tests" / "data" / "mooncake-fast25-synthetic.jsonl.gz"
AZURE_CSV = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _azure(path: Path, rows: list[tuple[str, int, int]]) -> Path:
    path.write_text(AZURE_CSV + "".join(f"{t},{i},{o}\n" for t, i, o in rows))
    return path


def _mooncake(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _trace(path: Path, fmt: str, **fields) -> Trace:
    return Trace.model_validate({"file": str(path), "format": fmt, **fields})


def test_azure_rows_read_as_seconds_from_the_first(tmp_path):
    path = _azure(
        tmp_path / "a.csv",
        [
            ("2023-11-16 18:15:46.0000000", 100, 10),
            ("2023-11-16 18:15:46.5000000", 200, 20),
            ("2023-11-16 18:15:48.0000000", 300, 30),
        ],
    )
    window = read_window(_trace(path, "azure"))
    assert window.arrival_s.tolist() == pytest.approx([0.0, 0.5, 2.0])
    assert window.input_tokens.tolist() == [100, 200, 300]
    assert window.output_tokens.tolist() == [10, 20, 30]
    # 3 requests over their 2 s plus one mean gap (1 s): 1 req/s
    assert window.rate == pytest.approx(1.0)


def test_mooncake_milliseconds_and_blocks_gzip_too(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 250, "input_length": 1500, "output_length": 6, "hash_ids": [0, 1, 2]},
    ]
    plain = _mooncake(tmp_path / "m.jsonl", rows)
    zipped = tmp_path / "m.jsonl.gz"
    zipped.write_bytes(gzip.compress(plain.read_bytes()))
    for path in (plain, zipped):
        window = read_window(_trace(path, "mooncake"))
        assert window.arrival_s.tolist() == pytest.approx([0.0, 0.25])
        assert [b.tolist() for b in window.blocks] == [[0, 1], [0, 1, 2]]
        assert window.block_tokens == 512


def test_burstgpt_leaves_out_failed_requests(tmp_path):
    path = tmp_path / "b.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,100,50,150,Conversation log\n"
        "6,ChatGPT,120,0,120,Conversation log\n"
        "9,GPT-4,80,40,120,API log\n"
    )
    window = read_window(_trace(path, "burstgpt"))
    assert window.input_tokens.tolist() == [100, 80]
    assert window.arrival_s.tolist() == pytest.approx([0.0, 4.0])


def test_a_services_own_log_by_named_columns(tmp_path):
    path = tmp_path / "own.jsonl"
    rows = [
        {"t_ms": 1000, "prompt": 64, "completion": 8, "conv": "a"},
        {"t_ms": 1500, "prompt": 32, "completion": 4, "conv": "b"},
        {"t_ms": 3000, "prompt": 128, "completion": 8, "conv": "a"},
    ]
    _mooncake(path, rows)
    columns = {"arrival": "t_ms", "input_tokens": "prompt", "output_tokens": "completion"}
    trace = _trace(path, "jsonl", time_unit="ms", columns=columns | {"session": "conv"})
    window = read_window(trace)
    assert window.arrival_s.tolist() == pytest.approx([0.0, 0.5, 2.0])
    assert window.session.tolist() == [0, 1, 0]  # a's turns are one conversation


def test_windows_by_time_and_by_count(tmp_path):
    rows = [(f"2023-11-16 18:00:{s:02d}.0000000", 10 + s, 5) for s in range(0, 60, 2)]
    path = _azure(tmp_path / "a.csv", rows)
    by_time = read_window(_trace(path, "azure", start_s=10, duration_s=20))
    assert by_time.input_tokens.tolist() == list(range(20, 40, 2))  # 10 s to before 30 s
    by_count = read_window(_trace(path, "azure", start_s=10, requests=3))
    assert by_count.input_tokens.tolist() == [20, 22, 24]
    assert by_count.arrival_s[0] == 0.0


def test_rate_multiple_scales_the_arrival_times(tmp_path):
    from runners.load.workload import make_requests

    rows = [(f"2023-11-16 18:00:{s:02d}.0000000", 100, 10) for s in (0, 1, 3, 6, 10)]
    path = _azure(tmp_path / "a.csv", rows)
    data = {"trace": {"file": str(path), "format": "azure", "rate_multiple": 2.0}}
    workload = Workload.model_validate(data)
    assert workload.multiple_of(workload.arrival.rate) == pytest.approx(2.0)
    # twice the rate: every gap halved
    assert make_requests(workload).arrival_s.tolist() == pytest.approx([0, 0.5, 1.5, 3.0, 5.0])
    assert workload.num_requests == 5
    assert workload.input_tokens.kind == "trace" and workload.input_tokens.mean == 100


def test_the_shared_traces_read_as_their_readme_states():
    azure = read_window(_trace(AZURE, "azure"))
    assert len(azure) == 19366
    assert np.median(azure.input_tokens) == 1020 and azure.input_tokens.max() == 14050
    assert azure.rate == pytest.approx(5.53, abs=0.01)
    mooncake = read_window(_trace(MOONCAKE, "mooncake"))
    assert len(mooncake) == 3993
    assert mooncake.input_tokens.max() == 191378
    seen: set[int] = set()
    repeated = total = 0
    for ids in mooncake.blocks:
        repeated += sum(int(b) in seen for b in ids)
        total += ids.size
        seen.update(ids.tolist())
    assert repeated / total == pytest.approx(0.64, abs=0.01)


def test_context_policy_refuses_clips_or_drops(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 100, "output_length": 10, "hash_ids": [0]},
        {"timestamp": 10, "input_length": 5000, "output_length": 10, "hash_ids": [1]},
        {"timestamp": 20, "input_length": 200, "output_length": 10, "hash_ids": [2]},
    ]
    path = _mooncake(tmp_path / "m.jsonl", rows)
    with pytest.raises(TraceError, match=r"1 of 3 requests .* 1000 tokens \(the longest: 5010\)"):
        read_window(_trace(path, "mooncake", context_tokens=1000))
    clipped = read_window(_trace(path, "mooncake", context_tokens=1000, over_context="clip"))
    assert clipped.input_tokens.tolist() == [100, 990, 200] and clipped.over_context == 1
    dropped = read_window(_trace(path, "mooncake", context_tokens=1000, over_context="drop"))
    assert dropped.input_tokens.tolist() == [100, 200] and dropped.over_context == 1


def _bad_traces(tmp: Path) -> dict[str, tuple[dict, str]]:
    """Each bad trace (its scenario's trace block) and what its error must say."""
    good = _azure(
        tmp / "good.csv", [("2023-11-16 18:00:00", 10, 5), ("2023-11-16 18:00:01", 10, 5)]
    )
    cases = {
        "unknown format": ({"file": str(good), "format": "sharegpt"}, "format"),
        "missing column": (
            {"file": str(tmp / "cols.csv"), "format": "azure"},
            "no column GeneratedTokens",
        ),
        "non-numeric time": ({"file": str(tmp / "nan.csv"), "format": "azure"}, "line 2"),
        "negative time": ({"file": str(tmp / "neg.jsonl"), "format": "mooncake"}, "0 or more"),
        "decreasing time": ({"file": str(tmp / "back.csv"), "format": "azure"}, "back in time"),
        "zero length": ({"file": str(tmp / "zero.csv"), "format": "azure"}, "at least 1"),
        "negative length": ({"file": str(tmp / "minus.csv"), "format": "azure"}, "at least 1"),
        "empty window": (
            {"file": str(good), "format": "azure", "start_s": 100},
            "holds no request",
        ),
        "window past the end": (
            {"file": str(good), "format": "azure", "requests": 10},
            "past the trace's end",
        ),
        "zero multiple": ({"file": str(good), "format": "azure", "rate_multiple": 0}, "greater"),
        "negative multiple": (
            {"file": str(good), "format": "azure", "rate_multiple": -1},
            "greater",
        ),
        "directory": ({"file": str(tmp), "format": "azure"}, "is a directory"),
        "fifo": ({"file": str(tmp / "pipe"), "format": "azure"}, "not a regular file"),
        "missing file": ({"file": str(tmp / "none.csv"), "format": "azure"}, "not found"),
        "truncated gzip": ({"file": str(tmp / "cut.csv.gz"), "format": "azure"}, "truncated"),
        "columns missing": ({"file": str(good), "format": "csv"}, "needs columns"),
    }
    (tmp / "cols.csv").write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:00:00,10\n")
    _azure(tmp / "nan.csv", [("soon", 10, 5)])
    _mooncake(
        tmp / "neg.jsonl",
        [{"timestamp": -5, "input_length": 5, "output_length": 5, "hash_ids": [0]}],
    )
    _azure(tmp / "back.csv", [("2023-11-16 18:00:05", 10, 5), ("2023-11-16 18:00:01", 10, 5)])
    _azure(tmp / "zero.csv", [("2023-11-16 18:00:00", 0, 5)])
    _azure(tmp / "minus.csv", [("2023-11-16 18:00:00", 10, -3)])
    os.mkfifo(tmp / "pipe")
    whole = gzip.compress((AZURE_CSV + "2023-11-16 18:00:00,10,5\n" * 2000).encode())
    (tmp / "cut.csv.gz").write_bytes(whole[: len(whole) // 2])
    return cases


def test_bad_traces_refused_in_one_line_exit_2_nothing_written(tmp_path):
    data = yaml.safe_load(
        (Path(__file__).parents[1] / "objectives/presets/customer-service.yaml").read_text()
    )
    cases = _bad_traces(tmp_path)
    failures = []
    for name, (trace, expected) in cases.items():
        work = tmp_path / name.replace(" ", "-")
        work.mkdir()
        scenario = {k: v for k, v in data.items() if k not in ("workload", "load")}
        scenario["workload"] = {"trace": trace}
        (work / "s.yaml").write_text(yaml.safe_dump(scenario))
        result = run_autotune("--scenario", "s.yaml", "--trials", "2", cwd=work, timeout=120)
        lines = result.stderr.strip().splitlines()
        written = sorted(p.name for p in work.iterdir() if p.name != "s.yaml")
        if result.returncode != 2 or len(lines) != 1 or expected not in lines[0] or written:
            failures.append((name, result.returncode, lines[-3:], written))
        elif "workload" not in lines[0]:
            failures.append((name, "no field named", lines[0]))
    assert not failures, failures


def test_a_trace_with_a_drawn_field_is_refused(tmp_path):
    path = _azure(
        tmp_path / "a.csv", [("2023-11-16 18:00:00", 10, 5), ("2023-11-16 18:00:01", 10, 5)]
    )
    data = {
        "trace": {"file": str(path), "format": "azure"},
        "sessions": {"turns": {"kind": "fixed", "value": 2}},
    }
    with pytest.raises(ValueError, match=r"drop workload\.sessions"):
        Workload.model_validate(data)
    data = {
        "trace": {"file": str(path), "format": "azure"},
        "arrival": {"kind": "poisson", "rate": 1.0},
    }
    with pytest.raises(ValueError, match=r"drop workload\.arrival"):
        Workload.model_validate(data)


def test_a_changed_trace_is_refused_against_its_record(tmp_path):
    path = _azure(
        tmp_path / "a.csv", [("2023-11-16 18:00:00", 10, 5), ("2023-11-16 18:00:01", 10, 5)]
    )
    recorded = Workload.model_validate({"trace": {"file": str(path), "format": "azure"}})
    _azure(path, [("2023-11-16 18:00:00", 20, 5), ("2023-11-16 18:00:01", 10, 5)])
    with pytest.raises(ValueError, match="changed since the scenario recorded it"):
        Workload.model_validate(recorded.model_dump())


def test_a_relative_trace_path_starts_at_the_scenario_file(tmp_path):
    from objectives.scenario import load_scenario

    folder = tmp_path / "elsewhere"
    folder.mkdir()
    _azure(folder / "t.csv", [("2023-11-16 18:00:00", 10, 5), ("2023-11-16 18:00:01", 10, 5)])
    data = {
        "name": "rel",
        "workload": {"trace": {"file": "t.csv", "format": "azure"}},
        "sla": {"ttft_p99_ms": 500},
    }
    (folder / "s.yaml").write_text(yaml.safe_dump(data))
    scenario = load_scenario(str(folder / "s.yaml"))
    assert isinstance(scenario, Scenario)
    assert Path(scenario.workload.trace.file) == folder / "t.csv"
