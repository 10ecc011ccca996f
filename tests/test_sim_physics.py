"""The simulator's physics and the scheduling rules it implements, checked on the simulator itself.

MindIE's select-batch rule the simulator implements is the one written down, from MindIE's
scheduler source, in ../shared/reference/engines.md ("What supportSelectBatch does"): with
requests waiting, prefill_cost = prefillTimeMsPerReq x running; decode_waste +=
decodeTimeMsPerReq x (maxBatchSize - running); decode while prefill_cost > decode_waste, else
prefill and reset decode_waste. The select-batch tests below check consequences of that rule
on the simulator; they are not measurements of a real MindIE."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from objectives.scenario import Closed, Fixed, Poisson
from runners.load.measurement import summarize
from runners.load.workload import make_requests
from runners.sim.costs import CostModel
from runners.sim.engine import Simulation
from runners.sim.profiles import QWEN2_7B, load_hardware
from runners.sim.runner import DEFAULTS, SimRunner
from tests.conftest import small_scenario

HW = load_hardware("ascend-910b2")


def config(**knobs):
    return DEFAULTS | {"max_prefill_tokens": 8192} | knobs


def simulate(runner: SimRunner, knobs: dict, workload, trace: bool = False):
    knobs = config(**knobs)
    cost = runner._cost(knobs)
    block = runner.hardware.kv_block_tokens
    sim = Simulation(
        cost,
        runner._scheduler(knobs),
        make_requests(workload),
        cost.kv_capacity_tokens(knobs["max_prefill_tokens"]) // block,
        block,
    )
    if trace:
        sim.trace = []
    return sim, sim.run()


def closed(scenario, concurrency: int, requests: int = 400):
    return scenario.workload.model_copy(
        update={"arrival": Closed(kind="closed", concurrency=concurrency), "num_requests": requests}
    )


def test_zero_load_ttft_is_one_prefill():
    sc = small_scenario(requests=1, input_tokens=Fixed(kind="fixed", value=700))
    runner = SimRunner()
    m = runner.run(config(), sc.workload)
    cost = CostModel(QWEN2_7B, HW, "bf16", 1.0)
    one_prefill = cost.step_seconds(700, 700 * 701 / 2, 0, 1, 0, 0)
    assert m.first_token_s[0] - m.send_s[0] == pytest.approx(one_prefill, rel=1e-12)


@pytest.mark.parametrize("quant", ["bf16", "w8a8", "w4a16"])
@pytest.mark.parametrize("batch", [4, 32, 128])
def test_throughput_never_exceeds_roofline(quant, batch):
    sc = small_scenario()
    wl = closed(sc, 256)
    m = SimRunner().run(config(batch_size=batch, quantization=quant), wl)
    tput = summarize(m, sc.sla)["output_tokens_per_s"]
    cost = CostModel(QWEN2_7B, HW, quant, 1.0)
    # Best case: every step decodes a full batch with no context at all.
    bound = batch / cost.step_seconds(0, 0, 0, 0, batch, 0)
    assert 0 < tput <= bound


def test_batch_size_raises_throughput_until_memory_binds():
    sc = small_scenario("document-summary", requests=300)
    wl = closed(sc, 512, requests=300)
    runner = SimRunner(hardware="ascend-310p3")  # 24 GB: the KV cache binds early
    results = {}
    for batch in (1, 2, 4, 8, 16, 32, 64, 256):
        m = runner.run(config(batch_size=batch, max_prefill_batch_size=min(batch, 50)), wl)
        results[batch] = (
            summarize(m, sc.sla)["output_tokens_per_s"],
            m.extra["max_running"],
            m.peak_kv_usage,
        )
    tputs = [results[b][0] for b in (1, 2, 4, 8, 16)]
    assert all(b > a for a, b in itertools.pairwise(tputs)), results
    # At 256 the memory, not the batch size, caps the running requests, and throughput stops rising.
    assert results[256][1] < 256 and results[256][2] > 0.95, results
    assert results[256][0] < results[64][0] * 1.05, results


@pytest.mark.parametrize("batch", [16, 32])
def test_decode_first_trades_ttft_for_throughput_under_load(batch):
    sc = small_scenario(requests=800)
    wl = closed(sc, 32, requests=800)
    runner = SimRunner()
    pf = summarize(
        runner.run(
            config(batch_size=batch, select_batch="prefill-first", max_prefill_batch_size=batch), wl
        ),
        sc.sla,
    )
    df = summarize(
        runner.run(
            config(batch_size=batch, select_batch="decode-first", max_prefill_batch_size=batch), wl
        ),
        sc.sla,
    )
    assert df["output_tokens_per_s"] > pf["output_tokens_per_s"]
    assert df["ttft_p50_ms"] > pf["ttft_p50_ms"]


def test_smaller_kv_ratio_admits_more_requests():
    sc = small_scenario("document-summary", requests=200)
    wl = closed(sc, 256, requests=200)
    runner = SimRunner(hardware="ascend-310p3")
    full = runner.run(config(batch_size=256, kv_compression=1.0), wl)
    half = runner.run(config(batch_size=256, kv_compression=0.5), wl)
    assert half.extra["max_running"] > full.extra["max_running"]


def test_preemption_recomputes_and_every_request_completes():
    sc = small_scenario("document-summary", requests=200)
    wl = closed(sc, 256, requests=200)
    m = SimRunner(hardware="ascend-310p3").run(config(batch_size=256), wl)
    assert m.extra["preemptions"] > 0
    assert (
        m.ok.all() and np.all(m.finish_s >= m.first_token_s) and np.all(m.first_token_s >= m.send_s)
    )
    assert np.array_equal(m.output_tokens, make_requests(wl).output_tokens)


def test_deterministic_for_a_seed():
    sc = small_scenario()
    a = SimRunner().run(config(), sc.workload)
    b = SimRunner().run(config(), sc.workload)
    c = SimRunner().run(config(), sc.workload.model_copy(update={"seed": 1}))
    assert np.array_equal(a.first_token_s, b.first_token_s) and np.array_equal(
        a.finish_s, b.finish_s
    )
    assert not np.array_equal(a.finish_s, c.finish_s)


@pytest.mark.parametrize("policy_mode", ["prefill-first", "decode-first"])
def test_batch_and_prefill_limits_hold(policy_mode):
    sc = small_scenario(requests=400)
    wl = closed(sc, 64, requests=400)
    knobs = dict(
        batch_size=12, select_batch=policy_mode, max_prefill_tokens=1536, max_prefill_batch_size=3
    )
    _, m = simulate(SimRunner(), knobs, wl)
    assert m.extra["max_running"] == 12
    assert m.extra["max_prefill_seqs"] <= 3
    assert m.extra["max_step_tokens"] <= 1536


def test_chunked_prefill_respects_token_budget_and_mixes_decodes():
    sc = small_scenario(requests=300)
    wl = closed(sc, 48, requests=300)
    sim, m = simulate(
        SimRunner(engine="vllm"),
        dict(batch_size=32, select_batch="decode-first", max_prefill_tokens=1024),
        wl,
        trace=True,
    )
    assert m.extra["max_step_tokens"] <= 1024
    assert m.extra["max_running"] <= 32
    mixed = [s for s in sim.trace if s[0] == "prefill" and s[3] > 0]
    assert mixed, "chunked prefill should put prefill chunks and decodes in one step"
    assert m.ok.all()


def test_select_batch_batches_prefills_that_prefill_first_runs_one_by_one():
    """The simulator's select-batch rule (engines.md, above) holds prefills back while the
    running requests' prefill cost outweighs the idle slots' waste, so under load several waiting
    requests share one prefill step, where prefill-first pauses the decoders for each."""
    sc = small_scenario(requests=300)
    wl = closed(sc, 40, requests=300)
    common = dict(batch_size=16, max_prefill_batch_size=16)
    pf, _ = simulate(SimRunner(), common | {"select_batch": "prefill-first"}, wl)
    df, _ = simulate(SimRunner(), common | {"select_batch": "decode-first"}, wl)
    per_step = {name: sim.stats["prefill_steps"] for name, sim in (("pf", pf), ("df", df))}
    assert per_step["df"] < per_step["pf"] * 0.6, per_step  # the same 300 prompts in fewer steps


def test_select_batch_without_decode_weight_waits_for_the_batch_to_drain():
    """decodeTimeMsPerReq = 0 in the rule (engines.md, above): decode_waste stays 0, so
    prefill_cost > decode_waste whenever anything runs, and a waiting request is prefilled only
    when nothing is decoding."""
    sc = small_scenario(requests=200)
    sim, m = simulate(
        SimRunner(),
        dict(
            batch_size=16,
            max_prefill_batch_size=16,
            select_batch="decode-first",
            decode_time_ms_per_req=0,
        ),
        closed(sc, 40, requests=200),
        trace=True,
    )
    prefills = [
        running for kind, _seqs, _tokens, running, _waiting in sim.trace if kind == "prefill"
    ]
    assert len(prefills) > 5 and set(prefills) == {0}
    assert m.ok.all()


def test_select_batch_without_prefill_weight_is_prefill_first():
    """prefillTimeMsPerReq = 0 in the rule (engines.md, above): prefill_cost is 0, never above
    decode_waste, so every step with requests waiting prefills, as prefill-first does."""
    sc = small_scenario(requests=300)
    wl = sc.workload.model_copy(update={"arrival": Poisson(kind="poisson", rate=5.0)})
    runner = SimRunner()
    a = runner.run(
        config(batch_size=16, select_batch="decode-first", prefill_time_ms_per_req=0), wl
    )
    b = runner.run(config(batch_size=16, select_batch="prefill-first"), wl)
    assert np.array_equal(a.first_token_s, b.first_token_s)


def test_preempted_request_longer_than_the_prefill_budget_does_not_stall():
    """A preempted request recomputes prompt + generated tokens, which can exceed
    max_prefill_tokens; it must still run (alone) instead of blocking the queue for ever."""
    sc = small_scenario(
        requests=200,
        input_tokens=Fixed(kind="fixed", value=3072),
        output_tokens=Fixed(kind="fixed", value=1024),
    )
    runner = SimRunner(hardware="ascend-310p3")
    m = runner.run(
        config(
            batch_size=256,
            max_prefill_tokens=3072,
            max_prefill_batch_size=50,
            select_batch="prefill-first",
        ),
        closed(sc, 256, requests=200),
    )
    assert m.fault is None and m.extra["preemptions"] > 0
    assert m.ok.all() and np.array_equal(m.output_tokens, np.full(200, 1024))


def test_quantized_weights_make_bandwidth_bound_decode_faster():
    """Decode at small and medium batch streams the weights: fewer weight bytes, faster steps."""
    times = {
        q: CostModel(QWEN2_7B, HW, q, 1.0).step_seconds(0, 0, 0, 0, 64, 64 * 600)
        for q in ("bf16", "w8a8", "w4a16")
    }
    assert times["w4a16"] < times["w8a8"] < times["bf16"], times
