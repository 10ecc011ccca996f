"""Quality on a real llama.cpp (built by .ci/setup-engines): `llama-perplexity --kl-divergence`
on the tiny random Qwen2's BF16 / Q8_0 / Q4_0 GGUFs, beside a running llama-server, against
the BF16 reference with an f16 KV cache. Expectations: the reference against itself is KL ~0
with agreement 1; a coarser weight or cache type strays further (KL up, agreement down)."""

from __future__ import annotations

import pytest

from runners.quality import QualityUnavailable, load_eval_prompts
from runners.quality.llamacpp import PerplexityQuality
from testing.engines import engine_scenario
from tests.test_runner_llamacpp import make_runner

BASE = {"batch_size": 1, "max_prefill_tokens": 256}


@pytest.fixture(scope="module")
def runner(llama_server, tiny_model, tmp_path_factory, gguf_cache):
    tmp = tmp_path_factory.mktemp("llama-quality")
    return make_runner(
        llama_server, tiny_model, tmp, gguf_cache, quality_cache=str(tmp / "quality")
    )


def test_kl_and_agreement_order_precisions_and_kv_types(runner):
    prompts = load_eval_prompts(None)
    figures = {}
    for name, pair in {
        "reference": ("bf16", 1.0),
        "q8_0": ("w8a8", 1.0),
        "q4_0": ("w4a16", 1.0),
        "kv q8_0": ("bf16", 0.5),
    }.items():
        config = BASE | {"quantization": pair[0], "kv_compression": pair[1]}
        with runner.session(
            config, engine_scenario().workload
        ) as session:  # as a study: the trial's server is up
            assert getattr(session, "fault", None) is None, session.fault
            figures[name] = runner.measure_quality(config, session, prompts)
    reference, q8, q4, kv8 = (
        figures["reference"],
        figures["q8_0"],
        figures["q4_0"],
        figures["kv q8_0"],
    )
    assert reference.kl < 1e-4 and reference.top1_agreement == 1.0
    # llama-perplexity prints the mean KL to 6 decimals: the random model's near-uniform
    # distributions put Q8_0 (5e-6) and the q8_0 cache (1e-6) just above that resolution.
    assert q4.kl > q8.kl > reference.kl
    assert q4.top1_agreement < q8.top1_agreement < 1.0
    assert kv8.kl > reference.kl and kv8.top1_agreement < 1.0
    # A 4-bit cache (no kv_compression setting of the runner renders it): the tool directly.
    kv4, _ = PerplexityQuality(runner, runner.perplexity_cmd, 600).kl("bf16", "q4_0", prompts)
    assert kv4.mean_kld > kv8.kl and kv4.same_top < kv8.top1_agreement
    for figure in figures.values():
        assert figure.source == "measured" and "llama-perplexity --kl-divergence" in figure.note
        assert (
            figure.samples == q8.samples > 500
        )  # every pair scores the same positions of the same tokens


def test_missing_llama_perplexity_is_not_measured_and_says_how_to_get_it(
    llama_server, tiny_model, tmp_path, gguf_cache
):
    runner = make_runner(
        llama_server, tiny_model, tmp_path, gguf_cache, perplexity_cmd=str(tmp_path / "nope")
    )
    with pytest.raises(QualityUnavailable, match=r"perplexity_cmd: .*nope not found"):
        runner.measure_quality({"quantization": "w8a8"}, None, load_eval_prompts(None))
