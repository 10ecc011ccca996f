"""A trace's replay (runners.load.trace_replay, runners.load.prefix_chains): a longer load
replays the window again, a fresh draw starts it elsewhere, shared prompt blocks become prefix
cache keys the simulator hits, and a capacity on a trace is a multiple of its rate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from objectives.scenario import Scenario, Workload
from runners.load.prefix_chains import NO_KEY, chain_keys, session_blocks
from runners.load.trace_replay import replay_order
from runners.load.workload import make_requests


def _mooncake(path: Path, rows: list[tuple[float, int, int, list[int]]]) -> Path:
    path.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": ids})
            + "\n"
            for t, i, o, ids in rows
        )
    )
    return path


def test_replay_order_repeats_the_window_and_a_seed_starts_it_elsewhere():
    order, copy = replay_order(4, 10, 0)
    assert order.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert copy.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    starts = {int(replay_order(100, 1, seed)[0][0]) for seed in range(1, 6)}
    assert len(starts) == 5  # five seeds, five starting points


def test_a_longer_load_replays_the_window_after_its_span(tmp_path):
    path = _mooncake(
        tmp_path / "m.jsonl", [(0, 100, 5, [0]), (1000, 100, 5, [1]), (3000, 100, 5, [2])]
    )
    workload = Workload.model_validate({"trace": {"file": str(path), "format": "mooncake"}})
    longer = make_requests(workload.model_copy(update={"num_requests": 6}))
    # span: 3 s and one mean gap (1.5 s); the second replay starts there
    assert longer.arrival_s.tolist() == pytest.approx([0, 1, 3, 4.5, 5.5, 7.5])
    # each replay's prompts are text of their own: no block id repeats across replays
    assert len({int(b[0]) for b in longer.blocks}) == 6


def test_chain_keys_share_the_longest_common_start():
    # b starts with a's two blocks and c with b's four: a's key is [0,1], b's and c's [0..3]
    blocks = [np.array(ids) for ids in ([0, 1], [0, 1, 2, 3], [0, 1, 2, 3, 4], [9])]
    inputs = np.array([2 * 512, 4 * 512, 5 * 512, 300])
    chains = chain_keys(blocks, inputs, 512)
    a, b, c, d = chains.key.tolist()
    assert b == c and a != b and d == NO_KEY
    assert chains.tokens[a] == 2 * 512 and chains.tokens[b] == 4 * 512
    assert chains.ancestor[b] == a and chains.ancestor[a] == NO_KEY
    # a shorter prompt through a block holds only its part of it
    short = chain_keys(blocks[:2], np.array([2 * 512, 3 * 512 + 100]), 512)
    assert short.tokens[short.key[0]] == 2 * 512


def test_a_conversations_turns_share_its_history():
    session = np.array([0, 1, 0])
    inputs = np.array([40, 20, 40 + 10 + 16])  # turn 2 of session 0: its history and 16 new
    outputs = np.array([10, 5, 8])
    blocks = session_blocks(session, inputs, outputs, 16)
    # history: 50 tokens, 3 whole blocks of 16
    assert blocks[2][:3].tolist() == blocks[0][:3].tolist()
    assert not set(blocks[1].tolist()) & set(blocks[0].tolist())


def test_the_simulator_hits_the_blocks_a_trace_shares(tmp_path):
    """Requests far apart in time (each alone on the engine, 128-token KV blocks): a prompt
    that starts with an earlier one's blocks computes only the rest; one that is an earlier
    prompt whole still computes its last block (as vLLM's block cache leaves it); one that
    shares nothing computes all of it, and with caching off every prompt is computed whole."""
    from runners.sim.engine import Simulation
    from runners.sim.prefix_cache import PrefixCache
    from runners.sim.runner import DEFAULTS, SimRunner

    rows = [
        (0, 4096, 4, list(range(8))),  # its 8 blocks of 512 tokens
        (20_000, 8192, 4, list(range(16))),  # starts with the first's 8
        (40_000, 8192, 4, list(range(100, 116))),  # shares nothing
        (60_000, 8192, 4, list(range(16))),  # the second's prompt again
        (80_000, 12288, 4, list(range(24))),  # starts with the second's 16 (a key on a key)
        (100_000, 12288, 4, list(range(24))),  # the fifth's prompt again
    ]
    path = _mooncake(tmp_path / "m.jsonl", rows)
    workload = Workload.model_validate({"trace": {"file": str(path), "format": "mooncake"}})
    runner = SimRunner()
    assert runner.hardware.kv_block_tokens == 128
    knobs = {"batch_size": 8, "max_prefill_tokens": 8192, "quantization": "w8a8"}
    config = DEFAULTS | knobs | {"prefix_caching": True}
    cost = runner._cost(config)
    blocks = cost.kv_capacity_tokens(config["max_prefill_tokens"]) // 128
    computed = {}
    for caching in (True, False):
        requests = make_requests(workload)
        cache = None
        if caching:
            cache = PrefixCache(0, 128)
            cache.chain(requests.prefix_sizes.tolist(), requests.prefix_ancestor.tolist())
        sim = Simulation(cost, runner._scheduler(config), requests, blocks, 128, None, cache)
        sim.trace = []
        m = sim.run()
        assert m.ok.all()
        computed[caching] = [s.prefill_tokens for s in sim.trace if s.kind == "prefill"]
    assert computed[False] == [4096, 8192, 8192, 8192, 12288, 12288]
    assert computed[True] == [4096, 8192 - 4096, 8192, 128, 12288 - 8192, 128]


def test_capacity_on_a_trace_is_a_multiple_of_its_rate(tmp_path):
    """Every step of the search replays the same window, scaled in time: the capacity's
    window is the whole trace, and the export states the multiple."""
    from runners.load.capacity import evaluate
    from runners.sim.runner import DEFAULTS, SimRunner

    rng = np.random.default_rng(3)
    times = np.cumsum(rng.exponential(0.5, 300))
    path = tmp_path / "a.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(
            f"2023-11-16 18:{int(t // 60):02d}:{t % 60:010.7f},{int(rng.integers(100, 800))},"
            f"{int(rng.integers(20, 200))}\n"
            for t in times
        )
    )
    data = {
        "name": "t",
        "workload": {"trace": {"file": str(path), "format": "azure"}},
        "sla": {"ttft_p99_ms": 500, "tpot_p99_ms": 80},
    }
    scenario = Scenario.model_validate(data)
    knobs = {"batch_size": 32, "max_prefill_tokens": 4096, "quantization": "w8a8"}
    result = evaluate(SimRunner(), DEFAULTS | knobs, scenario)
    m = result.metrics
    assert m["capacity_rate"] is not None and m["capacity_rate"] > scenario.nominal_rate
    assert m["capacity_horizon_requests"] == 300  # the whole window, at every rate
    multiple = scenario.workload.multiple_of(m["capacity_rate"])
    assert multiple == pytest.approx(m["capacity_rate"] / scenario.nominal_rate)
    for step in m["capacity_steps"]:  # as written: one window, never extended
        assert step["windows"] == 1, step
        if step["meets_sla"]:
            assert step["horizon_requests"] == 300, step
