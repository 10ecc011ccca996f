"""`autotune scenario fit` (objectives.trace_fit, tuner.fit_command): a parametric scenario
fitted to a trace, how well it fits, what it cannot carry, and its capacity beside the trace's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from objectives.scenario import load_scenario
from objectives.trace import TraceWindow
from objectives.trace_fit import fit_window, lognormal_fit
from tests.conftest import run_autotune

AZURE = (
    Path(__file__).resolve().parents[1]
    / "objectives"
    / "presets"
    / "traces"
    / "azure-conv-2023-11-16.csv.gz"
)


def _window(arrival_s, inputs, outputs) -> TraceWindow:
    n = len(inputs)
    return TraceWindow(
        arrival_s=np.asarray(arrival_s, dtype=float),
        input_tokens=np.asarray(inputs),
        output_tokens=np.asarray(outputs),
        session=None,
        blocks=None,
        block_tokens=512,
        span_s=float(arrival_s[-1]) * n / (n - 1),
        over_context=0,
        sha256="0" * 64,
    )


def test_a_lognormal_sample_fits_itself_and_a_two_humped_one_does_not():
    rng = np.random.default_rng(0)
    drawn = np.clip(np.rint(rng.lognormal(np.log(500), 0.6, 20_000)), 10, 8000).astype(int)
    dist, ks = lognormal_fit(drawn)
    assert dist["median"] == pytest.approx(500, rel=0.03)
    assert dist["sigma"] == pytest.approx(0.6, rel=0.05)
    assert ks < 0.02
    humps = np.concatenate([np.full(10_000, 100), np.full(10_000, 4000)])
    assert lognormal_fit(humps)[1] > 0.2


def test_poisson_gaps_read_as_poisson_and_bursty_ones_as_gamma():
    rng = np.random.default_rng(1)
    n = 5000
    lengths = np.full(n, 100)
    poisson = np.cumsum(rng.exponential(0.2, n))
    assert (
        fit_window(_window(poisson - poisson[0], lengths, lengths)).workload["arrival"]["kind"]
        == "poisson"
    )
    bursty = np.cumsum(rng.gamma(0.25, 0.8, n))  # CV 2: burstiness 0.25
    arrival = fit_window(_window(bursty - bursty[0], lengths, lengths)).workload["arrival"]
    assert arrival["kind"] == "gamma"
    assert arrival["burstiness"] == pytest.approx(0.25, rel=0.1)
    assert arrival["rate"] == pytest.approx(5.0, rel=0.05)


def test_a_rate_that_swings_is_named_as_not_carried():
    quiet = np.arange(0, 600, 1.0)  # 1 req/s for 10 minutes, then 4 req/s
    busy = 600 + np.arange(0, 600, 0.25)
    arrival = np.concatenate([quiet, busy])
    lengths = np.full(arrival.size, 100)
    fit = fit_window(_window(arrival, lengths, lengths))
    assert any("swing" in feature for feature in fit.not_carried)


def test_fit_writes_a_scenario_and_checks_it_on_the_simulator(tmp_path):
    result = run_autotune(
        "scenario", "fit", str(AZURE), "--format", "azure", "-o", "fit.yaml",
        "--ttft-p99-ms", "1000", "--tpot-p99-ms", "100", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("input_tokens: lognormal median 1020") for line in lines)
    assert any("the rate's swing" in line for line in lines)
    check = next(line for line in lines if line.startswith("check ("))
    assert "req/s on the trace" in check and "on the fit" in check
    fitted = load_scenario(str(tmp_path / "fit.yaml"))
    assert fitted.workload.trace is None
    assert fitted.workload.arrival.rate == pytest.approx(5.53, abs=0.01)
    assert fitted.sla.tpot_p99_ms == 100


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--format", "csv", "--column", "arrival"], "--column: 'arrival' is not FIELD=NAME"),
        (["--format", "azure", "--ttft-p99-ms", "0"], "--ttft-p99-ms"),
        (["--format", "parquet"], "--format"),
    ],
)
def test_fit_refuses_bad_flags_in_one_line_and_writes_nothing(tmp_path, args, says):
    base = {"--ttft-p99-ms": "1000"}
    flags = list(args)
    if "--ttft-p99-ms" not in flags:
        flags += ["--ttft-p99-ms", base["--ttft-p99-ms"]]
    result = run_autotune("scenario", "fit", str(AZURE), "-o", "fit.yaml", *flags, cwd=tmp_path)
    assert result.returncode == 2
    assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "fit.yaml").exists()


def test_fit_refuses_a_bad_trace_naming_it(tmp_path):
    (tmp_path / "t.csv").write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:00:00,10\n")
    result = run_autotune(
        "scenario", "fit", "t.csv", "--format", "azure", "-o", "fit.yaml",
        "--ttft-p99-ms", "1000", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    assert "no column GeneratedTokens" in result.stderr
    assert not (tmp_path / "fit.yaml").exists()
