"""Runs of decode steps (runners.sim.decode_run) change no result: the simulator taking its
decode steps in runs gives every request the very same send, first-token and finish times, and
the same counters, as taking them one run() pass at a time, which is how the engine was written
and checked (tests/test_sim_physics.py and the rest run on it). Cases cover each step policy,
the prefix cache and its host tier, sessions, swap and recompute preemption, a closed loop and
early rejection: every branch a run has to leave by."""

from __future__ import annotations

import numpy as np
import pytest

from objectives.scenario import Closed, Scenario
from runners.sim.costs import CostModel
from runners.sim.profiles import QWEN2_7B, load_hardware
from runners.sim.runner import SimRunner, _SimSession
from tests.conftest import small_scenario
from tests.test_prefix_cache import host_profile

BASE = {"max_prefill_tokens": 8192, "quantization": "bf16", "kv_compression": 1.0}
CASES = {
    "mindie prefill-first": ("mindie", "customer-service", {"select_batch": "prefill-first"}),
    "mindie select-batch": ("mindie", "customer-service", {"select_batch": "decode-first"}),
    "vllm chunked": ("vllm", "code-completion", {"select_batch": "decode-first"}),
    "vllm whole prompts": ("vllm", "code-completion", {"select_batch": "prefill-first"}),
    "llama-server slots": ("llamacpp", "document-summary", {"batch_size": 16}),
    "sessions with swaps": ("mindie", "multi-turn-chat", {"swap_preemptions": 4}),
    "sessions on a host tier": (
        "vllm",
        "multi-turn-chat",
        {"kv_host_gb": 16.0, "quantization": "w8a8"},
    ),
}


def measure(engine: str, scenario: Scenario, knobs: dict, runs: bool, hardware=None):
    runner = SimRunner(engine=engine, hardware=hardware or load_hardware("ascend-910b2"))
    config = runner._defaults() | BASE | {"batch_size": 96, "prefix_caching": True} | knobs
    sim = _SimSession(runner, config).simulation(scenario.workload, scenario.sla, True)
    sim.decode_runs = runs
    return sim, sim.run()


def assert_same(engine: str, scenario: Scenario, knobs: dict, hardware=None) -> dict:
    (stepped, one), (run, other) = (
        measure(engine, scenario, knobs, runs, hardware) for runs in (False, True)
    )
    for name in ("send_s", "first_token_s", "finish_s", "output_tokens", "ok"):
        np.testing.assert_array_equal(getattr(one, name), getattr(other, name), err_msg=name)
    assert one.extra == other.extra and one.peak_kv_usage == other.peak_kv_usage
    assert (one.fault and one.fault.message) == (other.fault and other.fault.message)
    assert stepped.now == run.now
    return one.extra


@pytest.mark.parametrize("case", CASES)
def test_decode_runs_change_no_request_near_capacity(case):
    """Near capacity and past it (arrivals every step or two, queues, preemptions)."""
    engine, name, knobs = CASES[case]
    for rate_factor in (1.0, 4.0):
        scenario = small_scenario(name, 300)
        scenario = scenario.model_copy(
            update={"workload": scenario.at_rate(scenario.nominal_rate * rate_factor)}
        )
        assert_same(engine, scenario, knobs, host_profile(50) if "kv_host_gb" in knobs else None)


def test_decode_runs_change_nothing_when_memory_runs_out():
    """A 16 GB chip: blocks run out mid-run and requests are preempted (recomputed, or
    swapped), which a run has to leave by exactly where a step would."""
    scenario = small_scenario("content-generation", 200)
    for engine, knobs in (("mindie", {"swap_preemptions": 4}), ("vllm", {})):
        knobs |= {"batch_size": 400, "quantization": "w8a8"}
        extra = assert_same(engine, scenario, knobs, host_profile(50))
        assert extra["preemptions"] > 100  # the case this test is for


def test_decode_runs_change_nothing_in_a_closed_loop():
    scenario = small_scenario("customer-service", 300)
    closed = scenario.workload.model_copy(update={"arrival": Closed(kind="closed", concurrency=40)})
    scenario = scenario.model_copy(update={"workload": closed})
    for engine, knobs in (("mindie", {"select_batch": "decode-first"}), ("vllm", {})):
        assert_same(engine, scenario, knobs)


def test_a_decode_step_costs_what_a_step_of_no_prefill_costs():
    """CostModel.decode_seconds against its general form, to the bit, over batches and
    contexts of every size the search reaches."""
    rng = np.random.default_rng(0)
    for quantization in ("bf16", "w8a8", "w4a16"):
        cost = CostModel(QWEN2_7B, load_hardware("ascend-910b2"), quantization, 0.5)
        for seqs, context in zip(
            rng.integers(1, 5000, 300), rng.integers(1, 10**7, 300), strict=True
        ):
            seqs, context = int(seqs), int(context)
            assert cost.decode_seconds(seqs, context) == cost.step_seconds(
                0, 0, 0, 0, seqs, context
            )
