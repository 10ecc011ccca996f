"""The simulator's figures measured: `profile-hardware` on this CPU with real PyTorch, and
`calibrate`'s fit. Calibration on real engine trials is in test_runner_vllm.py."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import optuna
import pytest

from objectives.scenario import Scenario
from objectives.userfile import InputError
from runners.capacity import evaluate
from runners.sim.calibration import FREE, Observation, error_summary, error_table, fit, with_figures
from runners.sim.profiles import load_hardware, load_model
from runners.sim.profiling import fit_roofline, import_torch
from runners.sim.runner import SimRunner
from tests.conftest import run_autotune

ENGINE_FIGURES = ("memory_fraction", "runtime_reserve_gb", "prefill_step_overhead_ms")


def test_roofline_fit_recovers_a_known_peak_and_half_point():
    params, bandwidth, peak, half = 10_000_000, 50e9, 2e12, 96.0
    rows = [(n, max(2 * params * n * (n + half) / (n * peak), params * 2 / bandwidth)) for n in (1, 4, 16, 64, 256, 1024, 4096)]
    fitted_peak, fitted_half = fit_roofline(rows, params, 2.0, bandwidth)
    assert fitted_peak == pytest.approx(peak, rel=0.05)
    assert fitted_half == pytest.approx(half, rel=0.15)


def test_profile_hardware_measures_this_cpu(tiny_model: Path, tmp_path: Path):
    """Real PyTorch microbenchmarks at the tiny model's shapes; the profile drives the simulator."""
    done = run_autotune("profile-hardware", "--device", "cpu", "--model", str(tiny_model), "-o", "cpu.yaml",
                        cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "matmuls" in done.stdout  # progress is printed
    profile = load_hardware(str(tmp_path / "cpu.yaml"))
    assert profile.name == "cpu" and "torch" in profile.description
    for key, figure in profile:
        if hasattr(figure, "source"):
            assert figure.source == ("assumed" if key in ENGINE_FIGURES else "measured"), key
    assert profile.memory_gb.value > 0.1 and 0 < profile.mbu.value <= 1.0
    # A one-token decode step of the tiny model costs its fixed overheads plus reading its weights:
    # a figure in the wrong unit (seconds for ms, bytes for GB) would be 1000x off. The weights'
    # share depends on the CPU's measured one-token matmul efficiency (mbu): under 5x the overheads
    # on the machine this was written on, 23x on one that measured mbu 0.011, hence 100x.
    scenario = Scenario.model_validate({"name": "t", "sla": {"ttft_p99_ms": 5000}, "load": {"mode": "fixed"},
        "workload": {"num_requests": 20, "arrival": {"kind": "closed", "concurrency": 1},
                     "input_tokens": {"kind": "fixed", "value": 64}, "output_tokens": {"kind": "fixed", "value": 32}}})
    m = SimRunner("vllm", str(tiny_model), profile).run(
        {"batch_size": 4, "select_batch": "decode-first", "max_prefill_tokens": 512, "quantization": "bf16",
         "kv_compression": 1.0}, scenario.workload, scenario.sla)
    assert m.fault is None and m.ok.all()
    tpot = np.median((m.finish_s - m.first_token_s) / (m.output_tokens - 1))
    floor = (profile.decode_step_overhead_ms.value + profile.per_sequence_overhead_ms.value) / 1000
    assert floor <= tpot < 100 * floor


def test_profile_hardware_without_torch_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # what `import torch` meets where it is not installed
    with pytest.raises(InputError, match=r"needs PyTorch: pip install 'autotune\[profile\]'"):
        import_torch("cpu")


def _scenario(requests: int = 60) -> Scenario:
    return Scenario.model_validate({
        "name": "calib", "sla": {"ttft_p99_ms": 2000},
        "workload": {"num_requests": requests, "seed": 1, "arrival": {"kind": "poisson", "rate": 4.0},
                     "input_tokens": {"kind": "uniform", "low": 200, "high": 800},
                     "output_tokens": {"kind": "uniform", "low": 32, "high": 128}},
        "load": {"mode": "capacity", "max_rate": 64}})


def test_calibration_fits_the_overheads_that_made_the_measurements():
    """Measurements made by the simulator with known figures, then a fit from the preset's:
    the loads it was fitted to and a config it never saw are both predicted far better."""
    base = load_hardware("h100")
    truth = with_figures(base, {"decode_step_overhead_ms": 12.0, "prefill_step_overhead_ms": 40.0,
                                "per_sequence_overhead_ms": 0.3, "mfu": 0.35, "mbu": 0.5}, "truth")
    model = load_model("qwen2-7b")
    scenario = _scenario()
    observations = []
    for number, batch in enumerate((4, 16, 64, 32)):
        config = {"batch_size": batch, "select_batch": "decode-first", "max_prefill_tokens": 2048,
                  "quantization": "bf16", "kv_compression": 1.0}
        evaluation = evaluate(SimRunner("vllm", model, truth), config, scenario)
        for step in evaluation.metrics["capacity_steps"]:
            if "fault" not in step:
                measured = {k: step[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "output_tokens_per_s")}
                observations.append(Observation(number, config, step["rate"], measured))
    train = [o for o in observations if o.trial != 3]
    held_out = [o for o in observations if o.trial == 3]
    assert len(train) >= 6 and held_out

    make_runner = lambda profile: SimRunner("vllm", model, profile)  # noqa: E731
    calibrated, before, after = fit(train, scenario, base, make_runner, iterations=150, note="test", seed=0)
    assert after < before / 4
    assert set(FREE) <= {key for key, figure in calibrated if getattr(figure, "note", "") == "test"}
    raw = error_summary(error_table(held_out, scenario, make_runner(base)))
    cal = error_summary(error_table(held_out, scenario, make_runner(calibrated)))
    for metric, (median, _, _) in cal.items():
        assert median < raw[metric][0] / 2, (metric, median, raw[metric][0])
        # A p99 of 32 loads hangs on its slowest requests: it is the one allowed to stay further off.
        assert metric == "ttft_p99_ms" or median < 25.0, (metric, median)


def _study(db: Path, runner: str, hardware: str = "cpu-box", trials: bool = True) -> str:
    """A study record as the tuner leaves it (no engine needed to refuse calibrating it)."""
    study = optuna.create_study(storage=f"sqlite:///{db}", study_name="s", directions=["minimize", "maximize"])
    study.set_user_attr("identity", {"runner": runner, "engine": "vllm", "model": "qwen2-7b", "hardware": hardware})
    study.set_user_attr("scenario", _scenario().model_dump(mode="json"))
    if trials:
        study.add_trial(optuna.trial.create_trial(values=[100.0, 10.0], user_attrs={"status": "feasible"}))
    return f"sqlite:///{db}"


BAD_CALIBRATIONS = {
    "a simulated study": (dict(runner="sim"), [], "its trials are simulated"),
    "no measured load": (dict(runner="vllm", hardware="h100"), [], "no real trial with a whole measured load"),
    "no profile to start from": (dict(runner="vllm"), [], "--hardware: give the profile to start from"),
    "an engine the simulator cannot model": (dict(runner="vllm", hardware="h100"), ["--engine", "tgi"],
                                             "--engine: the simulator has no scheduler model for 'tgi'"),
    "output over the study": (dict(runner="vllm", hardware="h100"), ["-o", "studies.db"], "is the --storage file"),
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
            config = {"batch_size": 8, "select_batch": mode, "max_prefill_tokens": 512, "quantization": "bf16",
                      "kv_compression": 1.0}
            m = SimRunner(engine, "qwen2-7b", "h100").run(config, scenario.at_rate(12.0), scenario.sla)
            results[engine, mode] = float(np.percentile(m.first_token_s - m.send_s, 99))
    assert results["llamacpp", "prefill-first"] == results["llamacpp", "decode-first"]
    assert results["vllm", "prefill-first"] != results["vllm", "decode-first"]
