"""The simulator's figures measured: `profile-hardware` on this CPU with real PyTorch, and
`calibrate`'s fit. Calibration on real engine trials is in test_runner_vllm.py."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import optuna
import pytest

from objectives.scenario import Scenario
from objectives.userfile import InputError
from runners.load.capacity import evaluate
from runners.load.measurement import Measurement
from runners.sim.calibration import (
    FREE,
    Observation,
    error_summary,
    error_table,
    fit,
    loss,
    with_figures,
)
from runners.sim.profiles import load_hardware, load_model
from runners.sim.profiling import fit_matmul_peaks, fit_roofline, import_torch
from runners.sim.runner import SimRunner
from tests.conftest import calibrate_summary, run_autotune, small_scenario

ENGINE_FIGURES = ("memory_fraction", "runtime_reserve_gb", "prefill_step_overhead_ms")


def test_roofline_fit_recovers_a_known_peak_and_half_point():
    params, bandwidth, peak, half = 10_000_000, 50e9, 2e12, 96.0
    rows = [
        (n, max(2 * params * n * (n + half) / (n * peak), params * 2 / bandwidth))
        for n in (1, 4, 16, 64, 256, 1024, 4096)
    ]
    fitted_peak, fitted_half = fit_roofline(rows, params, 2.0, bandwidth)
    assert fitted_peak == pytest.approx(peak, rel=0.05)
    assert fitted_half == pytest.approx(half, rel=0.15)


def _numpy_copy_bytes_per_s(size: int = 256 * 2**20) -> float:
    """Read plus write bytes per second of a large numpy copy: an independent measure of this
    machine's memory bandwidth (median of several copies, after a warm-up)."""
    source, target = np.ones(size, dtype=np.uint8), np.empty(size, dtype=np.uint8)
    np.copyto(target, source)
    times = []
    for _ in range(7):
        started = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - started)
    return 2 * size / float(np.median(times))


def test_profile_hardware_measures_this_cpu(tiny_model: Path, tmp_path: Path):
    """Real PyTorch microbenchmarks at the tiny model's shapes. Physical check: the profiled
    memory bandwidth (torch's device copy) is within 4x of a numpy copy of the same size the
    test times itself (the two may use different thread counts: at most the 2 cores here);
    a unit slip (bytes for GB, per ms for per s) would be 1000x off."""
    done = run_autotune(
        "profile-hardware",
        "--device",
        "cpu",
        "--model",
        str(tiny_model),
        "-o",
        "cpu.yaml",
        cwd=tmp_path,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    assert "matmuls" in done.stdout  # progress is printed
    profile = load_hardware(str(tmp_path / "cpu.yaml"))
    assert profile.name == "cpu" and "torch" in profile.description
    for key, figure in profile:
        if hasattr(figure, "source"):
            assert figure.source == ("assumed" if key in ENGINE_FIGURES else "measured"), key
    numpy_bandwidth = _numpy_copy_bytes_per_s()
    profiled = profile.bandwidth_tbs.value * 1e12
    assert numpy_bandwidth / 4 <= profiled <= numpy_bandwidth * 4, (
        profiled / 1e9,
        numpy_bandwidth / 1e9,
    )
    assert 0 < profile.mbu.value <= 1.0 and profile.mfu.value == 1.0
    # int8 went through the same fit as bf16 (where this CPU has an int8 kernel)
    assert profile.int8_tops.source == "assumed" or "as bf16_tflops" in profile.int8_tops.note
    # no link between devices was measured, so none is claimed (the base's NVLink was copied):
    # a chip budget on this profile, with no --space, is refused naming kv_link
    assert profile.kv_link is None
    budget = run_autotune(
        "--scenario", "customer-service", "--hardware", "cpu.yaml", "--chips", "2",
        "--trials", "1", cwd=tmp_path,
    )  # fmt: skip
    assert budget.returncode == 2 and "--hardware: cpu states no kv_link figures" in budget.stderr


def test_int8_and_bf16_peaks_are_fitted_the_same_way():
    """Timings made by the cost model's own roofline with a known launch cost: int8 exactly twice
    as fast as bf16 at every size (int8's short inputs padded to 32 rows, as torch._int_mm needs).
    Fitted alike, the peaks keep that 2x; the largest int8 throughput achieved with launches
    included (the old way) reads 1.53x here."""
    params, bandwidth, peak, half, launch = 200_000, 20e9, 1e12, 256.0, 200e-6

    def seconds(rows: int, peak_flops: float, bytes_per_param: float) -> float:
        return (
            max(
                2 * params * rows * (rows + half) / (rows * peak_flops),
                params * bytes_per_param / bandwidth,
            )
            + launch
        )

    bf16 = [(n, seconds(n, peak, 2.0)) for n in (1, 4, 16, 64, 256, 1024, 4096)]
    int8 = [
        (max(n, 32), seconds(max(n, 32), 2 * peak, 1.0)) for n in (1, 4, 16, 64, 256, 1024, 4096)
    ]
    bf16_peak, bf16_half, int8_peak = fit_matmul_peaks(bf16, int8, launch, params, bandwidth)
    assert bf16_peak == pytest.approx(peak, rel=0.05) and bf16_half == pytest.approx(half, rel=0.15)
    assert int8_peak / bf16_peak == pytest.approx(2.0, rel=0.05)
    best_achieved = max(2 * params * n / s for n, s in int8)
    assert abs(best_achieved / bf16_peak - 2.0) > 0.2  # what the old way reported differs


def test_profile_hardware_without_torch_says_what_to_install(monkeypatch):
    monkeypatch.setitem(
        sys.modules, "torch", None
    )  # what `import torch` meets where it is not installed
    with pytest.raises(InputError, match=r"needs PyTorch: pip install 'autotune\[profile\]'"):
        import_torch("cpu")


def _scenario(requests: int = 60) -> Scenario:
    return Scenario.model_validate(
        {
            "name": "calib",
            "sla": {"ttft_p99_ms": 2000},
            "workload": {
                "num_requests": requests,
                "seed": 1,
                "arrival": {"kind": "poisson", "rate": 4.0},
                "input_tokens": {"kind": "uniform", "low": 200, "high": 800},
                "output_tokens": {"kind": "uniform", "low": 32, "high": 128},
            },
            "load": {"mode": "capacity", "max_rate": 64},
        }
    )


def _simulated_observations(truth, scenario: Scenario) -> list[Observation]:
    """Every whole step on the scenario's horizon of capacity searches of four vLLM configs,
    simulated with `truth`."""
    observations = []
    for number, batch in enumerate((4, 16, 64, 32)):
        config = {
            "batch_size": batch,
            "select_batch": "decode-first",
            "max_prefill_tokens": 2048,
            "quantization": "bf16",
            "kv_compression": 1.0,
        }
        evaluation = evaluate(SimRunner("vllm", "qwen2-7b", truth), config, scenario)
        for step in evaluation.metrics["capacity_steps"]:
            # The calibration replays the scenario's horizon: a step extended to settle
            # (runners.load.capacity) was measured on more requests.
            if "fault" not in step and step["windows"] == 1:
                measured = {
                    k: step[k]
                    for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "output_tokens_per_s")
                }
                observations.append(Observation(number, config, step["rate"], measured))
    return observations


def test_calibration_fits_the_overheads_that_made_the_measurements():
    """Measurements made by the simulator with known figures, then a fit from the preset's:
    the loads it was fitted to and a config it never saw are both predicted far better."""
    base = load_hardware("h100")
    truth = with_figures(
        base,
        {
            "decode_step_overhead_ms": 12.0,
            "prefill_step_overhead_ms": 40.0,
            "per_sequence_overhead_ms": 0.3,
            "mfu": 0.35,
            "mbu": 0.5,
        },
        "truth",
    )
    model = load_model("qwen2-7b")
    scenario = _scenario()
    observations = _simulated_observations(truth, scenario)
    train = [o for o in observations if o.trial != 3]
    held_out = [o for o in observations if o.trial == 3]
    assert len(train) >= 6 and held_out

    make_runner = lambda profile: SimRunner("vllm", model, profile)  # noqa: E731
    calibrated, before, after, kept_start = fit(
        train, scenario, base, make_runner, iterations=150, note="test", seed=0
    )
    assert after < before / 4 and not kept_start
    assert set(FREE) <= {key for key, figure in calibrated if getattr(figure, "note", "") == "test"}
    assert {getattr(calibrated, key).source for key in FREE} == {
        "calibrated"
    }  # fitted, not measured
    raw = error_summary(error_table(held_out, scenario, make_runner(base)))
    cal = error_summary(error_table(held_out, scenario, make_runner(calibrated)))
    for metric, (median, _, _) in cal.items():
        assert median < raw[metric][0] / 2, (metric, median, raw[metric][0])
        # A p99 of 32 loads hangs on its slowest requests: it is the one allowed to stay further
        # off.
        assert metric == "ttft_p99_ms" or median < 25.0, (metric, median)


def test_calibration_loss_has_no_flat_region():
    """A profile 5x off and one 50x off are both far off, but the fit must still tell which is
    nearer (an error cap made them equal, and the fit wandered between them)."""

    def rows(ratio: float) -> list[dict]:
        return [{"metric": "tpot_p50_ms", "simulated": 10.0 * ratio, "measured": 10.0}]

    losses = [loss(rows(ratio)) for ratio in (1.0, 1.05, 1.5, 5.0, 50.0, 500.0)]
    assert losses == sorted(losses) and len(set(losses)) == len(losses)
    assert loss(rows(1 / 5)) == pytest.approx(loss(rows(5.0)))  # over and under weigh alike


class _FakeEngineRunner:
    """A stand-in simulator (pure logic, no engine): every request's TTFT is
    request_latency_ms + decode_step_overhead_ms and its TPOT decode_step_overhead_ms."""

    def __init__(self, profile):
        self.ttft_s = (
            profile.request_latency_ms.value + profile.decode_step_overhead_ms.value
        ) / 1000
        self.tpot_s = profile.decode_step_overhead_ms.value / 1000

    @contextmanager
    def session(self, config, workload):
        yield self

    def measure(self, workload, sla=None, stop_early=False) -> Measurement:
        n, out = 5, 11
        send = np.arange(n, dtype=float)
        first = send + self.ttft_s
        return Measurement(
            send,
            first,
            first + (out - 1) * self.tpot_s,
            np.full(n, 10),
            np.full(n, out),
            np.ones(n, dtype=bool),
        )


def test_calibration_never_makes_a_fitted_metric_worse_than_its_start():
    """Measured TTFT 10 ms and TPOT 40 ms, which the stand-in cannot produce together (its TTFT
    is at least its TPOT). The start has TTFT right and TPOT 8x off; the lowest loss trades TTFT
    away for TPOT (TTFT about 2x off). The fit keeps the start instead, and says so."""
    start = with_figures(
        load_hardware("h100"),
        {"request_latency_ms": 5.0, "decode_step_overhead_ms": 5.0},
        "start",
        source="assumed",
    )
    observation = Observation(0, {}, 1.0, {"ttft_p50_ms": 10.0, "tpot_p50_ms": 40.0})
    result = fit(
        [observation], _scenario(), start, _FakeEngineRunner, iterations=40, note="fit", seed=0
    )
    assert result.kept_start and result.profile == start
    assert result.loss_after == result.loss_before
    # Unconstrained, a lower loss was there to take: TTFT 20 ms, TPOT 20 ms.
    traded = with_figures(
        start, {"request_latency_ms": 0.01, "decode_step_overhead_ms": 20.0}, "traded"
    )
    assert (
        loss(error_table([observation], _scenario(), _FakeEngineRunner(traded)))
        < result.loss_before
    )


def _store_trials(db: Path, observations: list[Observation], scenario: Scenario) -> str:
    """A study as a real-engine run leaves it: each trial's capacity steps (no engine needed)."""
    storage = f"sqlite:///{db}"
    study = optuna.create_study(
        storage=storage, study_name="real", directions=["minimize", "maximize"]
    )
    study.set_user_attr(
        "identity", {"runner": "vllm", "engine": "vllm", "model": "qwen2-7b", "hardware": "h100"}
    )
    study.set_user_attr("scenario", scenario.model_dump(mode="json"))
    for number in sorted({o.trial for o in observations}):
        mine = [o for o in observations if o.trial == number]
        steps = [{"rate": o.rate, "meets_sla": True, **o.measured} for o in mine]
        study.add_trial(
            optuna.trial.create_trial(
                values=[100.0, 10.0],
                user_attrs={"knobs": mine[0].config, "capacity_steps": steps, "status": "feasible"},
            )
        )
    return storage


def test_calibrate_prints_held_out_error_beside_the_fitted_error(tmp_path: Path):
    """`calibrate` on four trials measured by the simulator with known overheads, from the h100
    preset: it fits on two trials and scores the other two, and prints both. Configs the fit
    never saw come out far nearer than the preset had them (the figures that made them are
    within the fit's reach)."""
    truth = with_figures(
        load_hardware("h100"),
        {
            "decode_step_overhead_ms": 12.0,
            "prefill_step_overhead_ms": 40.0,
            "per_sequence_overhead_ms": 0.3,
            "mfu": 0.35,
            "mbu": 0.5,
        },
        "truth",
    )
    scenario = _scenario()
    observations = _simulated_observations(truth, scenario)
    storage = _store_trials(tmp_path / "studies.db", observations, scenario)
    done = run_autotune(
        "calibrate",
        "--storage",
        storage,
        "--iterations",
        "60",
        "-o",
        "fitted.yaml",
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "held out: " in done.stdout and "scored by a fit on the other" in done.stdout
    summary = calibrate_summary(done.stdout)
    for metric in ("ttft_p50_ms", "tpot_p50_ms", "output_tokens_per_s"):
        before, after, held_before, held_after = summary[metric]
        assert after <= before, summary  # never worse than the start on a fitted metric
        assert held_after < held_before / 2, summary
    fitted = load_hardware(str(tmp_path / "fitted.yaml"))
    assert (
        fitted.decode_step_overhead_ms.source == "calibrated"
        and fitted.bandwidth_tbs.source == "assumed"
    )


def _study(db: Path, runner: str, hardware: str = "cpu-box", trials: bool = True) -> str:
    """A study record as the tuner leaves it (no engine needed to refuse calibrating it)."""
    study = optuna.create_study(
        storage=f"sqlite:///{db}", study_name="s", directions=["minimize", "maximize"]
    )
    study.set_user_attr(
        "identity", {"runner": runner, "engine": "vllm", "model": "qwen2-7b", "hardware": hardware}
    )
    study.set_user_attr("scenario", _scenario().model_dump(mode="json"))
    if trials:
        study.add_trial(
            optuna.trial.create_trial(values=[100.0, 10.0], user_attrs={"status": "feasible"})
        )
    return f"sqlite:///{db}"


BAD_CALIBRATIONS = {
    "a simulated study": (dict(runner="sim"), [], "its trials are simulated"),
    "no measured load": (
        dict(runner="vllm", hardware="h100"),
        [],
        "no real trial with a whole measured load",
    ),
    "no profile to start from": (
        dict(runner="vllm"),
        [],
        "--hardware: give the profile to start from",
    ),
    "an engine the simulator cannot model": (
        dict(runner="vllm", hardware="h100"),
        ["--engine", "tgi"],
        "--engine: the simulator has no scheduler model for 'tgi'",
    ),
    "output over the study": (
        dict(runner="vllm", hardware="h100"),
        ["-o", "studies.db"],
        "is the --storage file",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CALIBRATIONS))
def test_calibrate_refuses_with_one_line(case: str, tmp_path: Path):
    study_args, extra, expected = BAD_CALIBRATIONS[case]
    storage = _study(tmp_path / "studies.db", **study_args)
    before = sorted(tmp_path.iterdir())
    args = ["calibrate", "--storage", storage, "--iterations", "2", *extra]
    if "-o" not in extra:
        args += ["-o", "calibrated.yaml"]
    done = run_autotune(*args, cwd=tmp_path, timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], done.stderr
    assert sorted(tmp_path.iterdir()) == before, "nothing may be written"


def test_llamacpp_scheduler_has_no_select_batch_switch():
    """llama-server's slots mix decode and prompt tokens in one batch: the select-batch mode
    must not change what the simulator predicts for it (it does for vLLM)."""
    scenario = _scenario(40)
    results = {}
    for engine in ("llamacpp", "vllm"):
        for mode in ("prefill-first", "decode-first"):
            # A step of 1024 tokens: vLLM refuses prefill-first below the longest request (928
            # here); 32 slots leave decodes running beside the prompts, where the modes part.
            config = {
                "batch_size": 32,
                "select_batch": mode,
                "max_prefill_tokens": 1024,
                "quantization": "bf16",
                "kv_compression": 1.0,
            }
            m = SimRunner(engine, "qwen2-7b", "h100").run(
                config, scenario.at_rate(12.0), scenario.sla
            )
            results[engine, mode] = float(np.percentile(m.first_token_s - m.send_s, 99))
    assert results["llamacpp", "prefill-first"] == results["llamacpp", "decode-first"]
    assert results["vllm", "prefill-first"] != results["vllm", "decode-first"]


def test_a_fixed_load_is_replayed_on_the_window_it_judged():
    """A fixed-mode trial whose load was extended (unsettled at num_requests) judged 4,000
    requests; calibration replays that window, not the scenario's 200, as it does a capacity
    step's."""
    from tuner.observations import study_observations

    scenario = small_scenario(requests=200).model_dump(mode="json")
    scenario["load"] = {"mode": "fixed"}
    study = optuna.create_study(directions=["minimize", "maximize"])
    study.set_user_attr("scenario", scenario)
    knobs = {"batch_size": 16, "quantization": "bf16", "kv_compression": 1.0}
    metrics = {"ttft_p50_ms": 40.0, "ttft_p99_ms": 90.0, "tpot_p50_ms": 20.0}
    study.add_trial(
        optuna.trial.create_trial(
            values=[90.0, 500.0],
            user_attrs={"knobs": knobs, "horizon_requests": 4000, "output_tokens_per_s": 500.0}
            | metrics,
        )
    )
    (observation,) = study_observations(study)
    assert observation.requests == 4000 and observation.rate == 6.0
    assert observation.config == knobs
