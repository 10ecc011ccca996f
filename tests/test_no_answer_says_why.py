"""A run that finds nothing says why, trial by trial; a baseline that a fixed knob would change
is refused before the study (it was silently replaced by the fixed config). Real simulated
studies through the command line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import run_autotune

FIXED = {
    "select_batch": "prefill-first",
    "max_prefill_tokens": 8192,
    "quantization": "bf16",
    "kv_compression": 1.0,
    "prefix_caching": False,
}


def _space(tmp_path: Path, **knobs) -> str:
    path = tmp_path / "space.yaml"
    values = FIXED | knobs
    path.write_text(yaml.safe_dump({"knobs": {k: {"value": v} for k, v in values.items()}}))
    return str(path)


# A fixed config that gets nothing, and the line that says why. Two sequences at a time cannot
# keep 500 ms TTFT at 6 req/s, nor at 1/16 of it with a 100 ms TPOT bound on bf16 weights.
NOTHING = {
    "cannot run": (
        {"batch_size": 2, "max_prefill_batch_size": 4},
        "trial 0 could not run: max_prefill_batch_size 4 > batch_size 2",
    ),
    "misses at every rate": (
        {"batch_size": 2, "max_prefill_batch_size": 2},
        "trial 0 missed the SLA: misses the SLA even at the lowest rate searched",
    ),
}


@pytest.mark.parametrize("case", sorted(NOTHING))
def test_a_fixed_config_that_gets_nothing_says_why(case: str, tmp_path: Path, scenario_file: Path):
    knobs, said = NOTHING[case]
    done = run_autotune(
        "--scenario", str(scenario_file), "--space", _space(tmp_path, **knobs), "--no-html",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert said in done.stdout


def test_a_baseline_a_fixed_knob_would_change_is_refused(tmp_path: Path, scenario_file: Path):
    first = run_autotune(
        "--scenario", str(scenario_file), "--trials", "3", "--polish", "0", "--no-html",
        "--export", "base.yaml", cwd=tmp_path,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    batch = yaml.safe_load((tmp_path / "base.yaml").read_text())["knobs"]["batch_size"]
    fixed = 3 if batch != 3 else 5
    done = run_autotune(
        "--scenario", str(scenario_file), "--space", _space(tmp_path, batch_size=fixed),
        "--baseline", "base.yaml", "--study", "other", "--no-html", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2
    line = done.stderr.strip()
    assert line.startswith(f"autotune: error: --baseline: base.yaml runs batch_size {batch}")
    assert f"fixes at {fixed}" in line
