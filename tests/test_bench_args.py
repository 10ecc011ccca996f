"""bench/bench_search.py refuses bad arguments in one line naming the flag, exit 2, before it
draws or runs anything (the battery found tracebacks and a run that never ended)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_search.py"

CASES = {
    "negative random scenarios": (["--random-scenarios", "-1"], "--random-scenarios"),
    "random scenarios for ever": (["--random-scenarios", "99999999999"], "--random-scenarios"),
    "no requests per random scenario": (["--random-requests", "0"], "--random-requests"),
    "negative seed": (["--seed", "-1"], "--seed"),
    "no seeds": (["--seeds", "0"], "--seeds"),
    "unknown sampler": (["--samplers", "bogus"], "--samplers: unknown bogus"),
    "the product without its seeds": (["--samplers", "product"], "--product-seeds"),
    "missing scenario file": (["--scenarios", "missing.yaml"], "--scenarios: missing.yaml"),
    "cache dir onto a file": (["--cache-dir", "a-file"], "--cache-dir: a-file is a file"),
    "scenarios saved onto a file": (["--save-scenarios", "a-file"], "--save-scenarios: a-file"),
    "a scenario that does not load": (["--scenarios", "bad.yaml"], "bad.yaml: malformed YAML"),
    "the curve onto a folder": (["--curve", "."], "--curve: . is not a file"),
    "the curve into no folder": (["--curve", "missing/curve.png"], "--curve: missing/curve.png"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bench_search_refuses_bad_arguments(case: str, tmp_path: Path):
    args, expected = CASES[case]
    (tmp_path / "a-file").write_text("")
    (tmp_path / "bad.yaml").write_text("name: [\n")
    done = subprocess.run(
        [sys.executable, str(BENCH), *args], cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("bench_search.py: error: ") and expected in last, last
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "bad.yaml"]
