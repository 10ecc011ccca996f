"""What an engine refuses, the simulator refuses too; and what a trial's engine was started
with is what its export holds. The real engines' side is in test_runner_vllm.py (vLLM started
anyway on a refused config exits with its own error) and test_runner_llamacpp.py (llama-server
started from an export serves the longest request on every slot)."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import yaml

from runners.sim.runner import SimRunner
from testing.engines import engine_scenario
from tests.conftest import run_autotune
from tuner.export import load_export

# engine_scenario(): prompts of 32-96 tokens, answers of 8-24: a request holds at most 120 tokens.
LONGEST_PROMPT, LONGEST_REQUEST = 96, 120
# vLLM 0.32's SchedulerConfig.verify_max_model_len raises on both of these
# (vllm/config/scheduler.py).
VLLM_REFUSES = {
    "prefill-first with a step budget below the longest request": (
        {"batch_size": 8, "select_batch": "prefill-first", "max_prefill_tokens": 100},
        "longest request",
    ),
    "a step budget below the batch size": (
        {"batch_size": 128, "select_batch": "decode-first", "max_prefill_tokens": 100},
        "batch_size (128)",
    ),
}


def test_engine_scenario_lengths_are_what_the_tests_here_assume():
    workload = engine_scenario().workload
    assert (workload.longest_prompt, workload.longest_request) == (LONGEST_PROMPT, LONGEST_REQUEST)


@pytest.mark.parametrize("case", sorted(VLLM_REFUSES))
def test_simulated_vllm_refuses_what_vllm_refuses(case: str):
    knobs, reason = VLLM_REFUSES[case]
    config = knobs | {"quantization": "bf16", "kv_compression": 1.0}
    workload = engine_scenario().workload
    runner = SimRunner("vllm", "qwen2-7b", "h100")
    m = runner.run(config, workload)
    assert m.fault is not None and m.fault.kind == "infeasible" and reason in m.fault.message, (
        m.fault
    )
    # The same budget with chunked prefill and a batch that fits it runs.
    fine = config | {"select_batch": "decode-first", "batch_size": 8}
    assert runner.violations(fine, workload) == [] and runner.run(fine, workload).fault is None


def test_simulated_llamacpp_refuses_a_precision_with_no_gguf_type():
    """llama.cpp's GGUF types here: BF16, F16, Q8_0, Q4_0; there is none for int8 weights with
    16-bit activations (w8a16)."""
    config = {
        "batch_size": 4,
        "max_prefill_tokens": 256,
        "quantization": "w8a16",
        "kv_compression": 1.0,
    }
    m = SimRunner("llamacpp", "qwen2-7b", "h100").run(config, engine_scenario().workload)
    assert (
        m.fault is not None
        and m.fault.kind == "infeasible"
        and "no GGUF type for w8a16" in m.fault.message
    )


def _scenario_file(tmp_path: Path) -> Path:
    data = engine_scenario().model_dump(mode="json")
    data["load"] = {"mode": "fixed"}
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_sim_vllm_study_records_a_config_vllm_refuses_as_infeasible(tmp_path: Path):
    (tmp_path / "space.yaml").write_text(
        yaml.safe_dump(
            {
                "knobs": {
                    "select_batch": {"value": "prefill-first"},
                    "max_prefill_tokens": {"value": 100},
                    "batch_size": {"value": 8},
                }
            }
        )
    )
    done = run_autotune(
        "--scenario",
        str(_scenario_file(tmp_path)),
        "--engine",
        "vllm",
        "--hardware",
        "h100",
        "--space",
        "space.yaml",
        "--trials",
        "1",
        "--storage",
        "sqlite:///s.db",
        "--study",
        "s",
        cwd=tmp_path,
    )
    assert done.returncode == 3, done.stderr  # nothing ran, so nothing could meet the SLA
    (trial,) = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 's.db'}").trials
    assert (
        trial.state == optuna.trial.TrialState.FAIL and trial.user_attrs["status"] == "infeasible"
    )
    assert (
        "without chunked prefill vLLM needs max_prefill_tokens (100)" in trial.user_attrs["fault"]
    )
    assert not (tmp_path / "best-config.yaml").exists()


def test_export_holds_the_arguments_the_engine_is_started_with(tmp_path: Path):
    """A simulated llama.cpp study's export: the knobs' flags, and what the runner adds to them:
    a context of every slot's longest request (llama-server splits -c over its -np slots), flash
    attention (a q8_0 V cache needs it) and --no-repack for quantized weights. The vLLM form of
    the same config has --max-model-len for the longest request; MindIE's config.json its
    sequence and input limits."""
    (tmp_path / "space.yaml").write_text(
        yaml.safe_dump(
            {
                "knobs": {
                    "batch_size": {"value": 6},
                    "max_prefill_tokens": {"value": 256},
                    "quantization": {"value": "w8a8"},
                    "kv_compression": {"value": 0.5},
                }
            }
        )
    )
    done = run_autotune(
        "--scenario",
        str(_scenario_file(tmp_path)),
        "--engine",
        "llamacpp",
        "--hardware",
        "h100",
        "--space",
        "space.yaml",
        "--trials",
        "1",
        "--storage",
        "sqlite:///s.db",
        "--study",
        "s",
        "--no-html",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    exported = load_export(tmp_path / "best-config.yaml")
    args = exported.native["llamacpp"]["server_args"]
    trial = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 's.db'}").trials[0]
    assert args == trial.user_attrs["engine_args"]  # what the trial recorded at its start

    def value(flag: str, form: list[str]) -> str:
        return form[form.index(flag) + 1]

    assert value("-c", args) == str(6 * LONGEST_REQUEST) and value("-np", args) == "6"
    assert value("-fa", args) == "on" and value("-ctk", args) == value("-ctv", args) == "q8_0"
    assert value("-b", args) == value("-ub", args) == "256" and "--no-repack" in args
    assert exported.native["llamacpp"]["gguf_type"] == "Q8_0"
    assert not {"--host", "--port", "-m", "--alias"} & set(args)  # the deployer's own
    assert value("--max-model-len", exported.native["vllm"]["serve_args"]) == str(LONGEST_REQUEST)
    assert exported.native["mindie"]["config_json"]["BackendConfig"]["ModelDeployConfig"] == {
        "maxSeqLen": LONGEST_REQUEST,
        "maxInputTokenLen": LONGEST_PROMPT,
    }
    assert "engine_args" not in exported.metrics


def test_export_says_why_an_engine_cannot_run_the_config():
    """A MindIE trial's knobs rendered for vLLM: prefill-first with a budget below the longest
    request is a config vLLM refuses, and llama.cpp has no w8a16 GGUF: both say so."""
    from tuner.export import native_forms

    knobs = {
        "batch_size": 8,
        "select_batch": "prefill-first",
        "max_prefill_tokens": 100,
        "quantization": "w8a16",
        "kv_compression": 1.0,
    }
    forms = native_forms(knobs, engine_scenario().workload, "mindie", None)
    assert "longest request" in forms["vllm"]["not_expressible"]
    assert "no GGUF type for w8a16" in forms["llamacpp"]["not_expressible"]
    assert (
        forms["mindie"]["config_json"]["BackendConfig"]["ScheduleConfig"]["maxPrefillTokens"] == 100
    )
