"""Multi-turn sessions (issue 29): a turn's prompt carries its session's history, turns go out
in order a think time after the previous answer, and the simulator keeps a session's history
in its prefix cache between turns (evicted, or offloaded to the host tier, when memory binds)."""

from __future__ import annotations

import numpy as np
import pytest

from objectives.scenario import Scenario, load_scenario
from objectives.scoring import constraint_values, is_feasible
from runners.load.capacity import evaluate
from runners.load.measurement import summarize
from runners.load.workload import make_requests
from runners.sim.engine import Simulation
from runners.sim.prefix_cache import PrefixCache
from runners.sim.runner import DEFAULTS, SimRunner
from tests.test_prefix_cache import KNOBS, host_profile, ttft_s
from tests.test_sustained import held_sixteen_times_longer


def chat(turns, think_s=0.0, arrival=None, requests=12, inputs=300, outputs=100) -> Scenario:
    data = load_scenario("customer-service").model_dump(mode="json")
    data["workload"] |= {
        "num_requests": requests,
        "arrival": arrival or {"kind": "closed", "concurrency": 1},
        "input_tokens": {"kind": "fixed", "value": inputs},
        "output_tokens": {"kind": "fixed", "value": outputs},
        "sessions": {"turns": turns, "think_time_s": think_s},
        "shared_prefix": None,  # conversations without a system prompt: their history is shared
    }
    return Scenario.model_validate(data)


FIXED_3 = {"kind": "fixed", "value": 3}


def test_a_turn_carries_every_earlier_prompt_and_answer_of_its_session():
    """Three turns of 300 new tokens and 100-token answers: 300, then 300 + 100 + 300 = 700,
    then 700 + 100 + 300 = 1,100; 12 requests are 4 sessions."""
    requests = make_requests(chat(FIXED_3).workload)
    plan = requests.sessions
    assert plan is not None and plan.count == 4
    by_turn = {0: 300, 1: 700, 2: 1100}
    for request in range(len(requests)):
        turn = 0
        previous = int(plan.previous[request])
        while previous >= 0:
            turn += 1
            assert plan.session[previous] == plan.session[request]
            previous = int(plan.previous[previous])
        assert requests.input_tokens[request] == by_turn[turn]
        assert plan.new_tokens[request] == 300


def test_the_last_session_is_cut_to_the_requests_asked_for():
    requests = make_requests(chat(FIXED_3, requests=10).workload)
    plan = requests.sessions
    assert plan is not None and len(requests) == 10 and plan.count == 4  # 3 + 3 + 3 + 1
    assert sorted(np.bincount(plan.session).tolist()) == [1, 3, 3, 3]


def fresh_starts(requests) -> np.ndarray:
    """When the sessions that start in the test start (the others were in progress: their first
    turn in the test carries a history)."""
    plan = requests.sessions
    firsts = plan.firsts[requests.input_tokens[plan.firsts] == plan.new_tokens[plan.firsts]]
    return requests.arrival_s[firsts]


def test_turns_come_at_the_rate_from_the_tests_start_to_its_end():
    """Little's law: 2 req/s of 4-turn sessions is a session every 2 s. With users thinking
    30 s, a session lasts about 90 s: sessions in progress when the test starts bring their
    turns from its first second, and sessions keep starting to its end (the last ones cut), so
    the first 300 turns and the last 300 come at 2/s too (were sessions started only at 0 and
    played out, the first 90 s would bring first turns at 0.5/s, then more, and the last 90 s
    ever fewer turns)."""
    arrival = {"kind": "poisson", "rate": 2.0}
    requests = make_requests(
        chat({"kind": "fixed", "value": 4}, 30.0, arrival, requests=4000).workload
    )
    plan = requests.sessions
    assert plan is not None and requests.arrival_s is not None
    starts = fresh_starts(requests)
    assert (starts.size - 1) / (starts[-1] - starts[0]) == pytest.approx(0.5, rel=0.05)
    planned = requests.arrival_s
    assert planned[0] >= 0 and (np.diff(planned) >= 0).all()  # in planned order
    for part in (planned, planned[:300], planned[-300:]):
        assert (part.size - 1) / (part[-1] - part[0]) == pytest.approx(2.0, rel=0.2)
    assert len(requests) == 4000 and np.bincount(plan.session).min() >= 1
    in_progress = plan.count - starts.size
    assert in_progress > 30  # about 0.5/s x 90 s, less those with no turn left


def test_a_later_turn_is_planned_after_the_previous_answer_at_the_slas_pace():
    """customer-service's SLA: a first token within 500 ms, then one per 100 ms. A user takes
    0.5 + 99 x 0.1 = 10.4 s over a 100-token answer, then thinks: that far apart are the plans
    of a session's consecutive turns; with answers of 20-200 tokens, each turn by the answer
    before it."""
    arrival = {"kind": "poisson", "rate": 2.0}
    requests = make_requests(chat(FIXED_3, 20.0, arrival, requests=200).workload)
    plan = requests.sessions
    assert plan is not None and requests.arrival_s is not None
    later = np.flatnonzero(plan.previous >= 0)
    gaps = requests.arrival_s[later] - requests.arrival_s[plan.previous[later]]
    np.testing.assert_allclose(gaps, 10.4 + plan.think_s[later])

    data = chat(FIXED_3, 20.0, arrival, requests=200).model_dump(mode="json")
    data["workload"]["output_tokens"] = {"kind": "uniform", "low": 20, "high": 200}
    requests = make_requests(Scenario.model_validate(data).workload)
    plan = requests.sessions
    assert plan is not None and requests.arrival_s is not None
    later = np.flatnonzero(plan.previous >= 0)
    answered = requests.output_tokens[plan.previous[later]]
    assert np.ptp(answered) > 100
    gaps = requests.arrival_s[later] - requests.arrival_s[plan.previous[later]]
    np.testing.assert_allclose(gaps, 0.5 + (answered - 1) * 0.1 + plan.think_s[later])


def test_the_users_pace_is_the_slas_unless_the_file_sets_it():
    paced = chat(FIXED_3).workload.sessions
    assert paced is not None
    assert (paced.first_token_wait_ms, paced.read_ms_per_token) == (500, 100)
    data = chat(FIXED_3).model_dump(mode="json")
    data["sla"]["tpot_p99_ms"] = None
    data["workload"]["sessions"] = {"turns": FIXED_3, "read_ms_per_token": None}
    default = Scenario.model_validate(data).workload.sessions
    assert default is not None  # no TPOT bound: the middle of the seed's 30-100 ms/token
    assert (default.first_token_wait_ms, default.read_ms_per_token) == (500, 50)
    data["workload"]["sessions"] = {"turns": FIXED_3, "read_ms_per_token": 20.0}
    assert Scenario.model_validate(data).workload.sessions.read_ms_per_token == 20.0


def sim_load(scenario: Scenario, rate: float, requests: int):
    workload = scenario.at_rate(rate).model_copy(update={"num_requests": requests})
    m = SimRunner().run(DEFAULTS | {"prefix_caching": True}, workload)
    return m, summarize(m, scenario.sla)


def test_turns_go_out_as_planned_while_the_engine_keeps_the_users_pace():
    """multi-turn-chat at its nominal 4 req/s on the default config: every answer comes within
    the users' pace, so every turn is sent at its planned time and the load offers its rate."""
    m, metrics = sim_load(load_scenario("multi-turn-chat"), 4.0, 2000)
    assert m.ok.all() and m.due_s is not None
    np.testing.assert_allclose(m.send_s, m.due_s)
    assert metrics["offered_rps"] == pytest.approx(4.0, rel=0.05)
    assert metrics["delivered_share"] == pytest.approx(1.0, abs=0.05)


def test_turns_behind_their_plan_leave_the_load_unsustained():
    """At 30 req/s the default config answers slower than its users' pace: turns wait for late
    answers, so the engine is sent far less than the plan offers (a short load of turns sent
    as answers came met such a rate: the claim that failed to hold, issue 29). The turns
    waiting are backlog: the load is not sustained."""
    scenario = load_scenario("multi-turn-chat")
    m, metrics = sim_load(scenario, 30.0, 4000)
    assert m.due_s is not None and (m.send_s > m.due_s + 1.0).mean() > 0.3
    assert metrics["offered_rps"] < 0.8 * 30
    assert metrics["delivered_share"] < 0.8
    assert constraint_values(metrics, scenario.sla)["sustained"] > 0


def test_a_session_capacity_holds_sixteen_times_longer():
    """multi-turn-chat's default export (batch 544 decode-first, w8a8 / KV 0.5, prefix cache;
    before turns were paced it claimed 45 req/s and a 16x load of it served 18): over 16x the
    preset's requests at the capacity found the engine serves at least 90% of that rate, and
    at 95% of it every SLO holds (the export's hold steps down by the search's precision, 5%).
    The search's windows last a conversation at least: the turn rate of conversations that
    start at random drifts over a conversation's length, and on half-conversation windows
    the study's claim was 10% above what 16x its requests held."""
    scenario = load_scenario("multi-turn-chat")
    config = DEFAULTS | {
        "batch_size": 544,
        "select_batch": "decode-first",
        "max_prefill_tokens": 7680,
        "quantization": "w8a8",
        "kv_compression": 0.5,
        "max_prefill_batch_size": 7,
        "prefix_caching": True,
        "swap_preemptions": 7,
    }
    runner = SimRunner()
    rate = evaluate(runner, config, scenario).metrics["capacity_rate"]
    assert rate is not None and rate > 4.0
    for share in (1.0, 0.95):
        held = held_sixteen_times_longer(runner, config, scenario, rate * share)
        assert held["delivered_rps"] >= 0.9 * rate * share, held
    assert is_feasible(constraint_values(held, scenario.sla)), held


def test_a_session_in_progress_brings_its_history_into_the_test():
    """Its first turn in the test carries the earlier turns' prompts and answers (drawn, never
    sent): 300 new and 100 answered tokens a turn, so 400 a turn before it."""
    arrival = {"kind": "poisson", "rate": 2.0}
    requests = make_requests(chat(FIXED_3, 20.0, arrival, requests=200).workload)
    plan = requests.sessions
    assert plan is not None
    carried = requests.input_tokens[plan.firsts] - plan.new_tokens[plan.firsts]
    assert set(carried.tolist()) <= {0, 400, 800} and carried.max() > 0


def simulate(scenario: Scenario, caching: bool, runner: SimRunner | None = None, **config):
    runner = runner or SimRunner()
    config = DEFAULTS | KNOBS | {"prefix_caching": caching} | config
    cost = runner._cost(config)
    block = runner.hardware.kv_block_tokens
    blocks = cost.kv_capacity_tokens(config["max_prefill_tokens"]) // block
    requests = make_requests(scenario.workload)
    cache = PrefixCache(0, block) if caching else None
    sim = Simulation(cost, runner._scheduler(config), requests, blocks, block, None, cache)
    sim.trace = []
    return sim, sim.run()


@pytest.mark.parametrize("caching", [True, False])
def test_a_later_turn_computes_only_what_its_cached_history_lacks(caching):
    """One user, one 3-turn session, 128-token blocks: turn 1 computes its 300 tokens and
    leaves a context of 400, 3 whole blocks (384 tokens); turn 2's 700-token prompt computes
    700 - 384 = 316 and leaves 800, 6 blocks (768); turn 3's 1,100 compute 332. Without
    caching each prompt is computed whole."""
    sim, m = simulate(chat(FIXED_3, requests=3), caching)
    prefills = [step.prefill_tokens for step in sim.trace if step.kind == "prefill"]
    assert prefills == ([300, 316, 332] if caching else [300, 700, 1100])
    assert m.ok.all() and m.sent == 3


def test_each_turn_is_sent_a_think_time_after_the_previous_answer():
    scenario = chat({"kind": "uniform", "low": 1, "high": 5}, 2.0, requests=60)
    sim, m = simulate(scenario, True, batch_size=8)
    plan = make_requests(scenario.workload).sessions
    assert plan is not None and m.ok.all() and m.sent == 60
    later = np.flatnonzero(plan.previous >= 0)
    answered = np.array(sim.finish)[plan.previous[later]] + sim.latency_s
    sent = np.array(sim.send)[later]
    np.testing.assert_allclose(sent - answered, plan.think_s[later], atol=1e-9)
    assert (np.diff(m.send_s) >= 0).all()  # measured in send order


def test_caching_a_sessions_history_serves_its_turns_sooner():
    scenario = chat(
        {"kind": "uniform", "low": 2, "high": 6},
        2.0,
        {"kind": "poisson", "rate": 8.0},
        requests=600,
        inputs=200,
    )
    runner = SimRunner()
    runs = {
        caching: runner.run(KNOBS | {"prefix_caching": caching}, scenario.workload)
        for caching in (True, False)
    }
    p50 = {caching: float(np.median(ttft_s(m))) for caching, m in runs.items()}
    assert p50[True] < 0.7 * p50[False], p50
    assert runs[True].extra["prefix_hits"] == runs[True].extra["prefix_lookups"] > 300


@pytest.mark.parametrize("bandwidth_gbs", [25.0, 0.5])
def test_cold_session_histories_go_to_the_host_tier_and_come_back(bandwidth_gbs):
    """Long conversations (4-8 turns of 1,500 new tokens and 300-token answers) with users
    thinking 20 s, on 910B2 with 16 GB of device memory: the histories of sessions whose users
    are thinking fill the device and are evicted (the seed's cold requests). With 32 GB of host
    memory they are offloaded and reloaded: sooner than computing them again over PCIe 4.0,
    later over a 0.5 GB/s link."""
    scenario = chat(
        {"kind": "uniform", "low": 4, "high": 8},
        20.0,
        {"kind": "poisson", "rate": 1.5},
        requests=500,
        inputs=1500,
        outputs=300,
    )
    runner = SimRunner(engine="vllm", hardware=host_profile(bandwidth_gbs))
    config = KNOBS | {"batch_size": 32, "prefix_caching": True}
    without, with_host = (
        runner.run(config | {"kv_host_gb": gb}, scenario.workload) for gb in (0, 32)
    )
    assert without.extra["prefix_evictions"] > 50  # memory binds
    assert with_host.extra["prefix_reloads"] > 50
    mean = {
        name: float(np.mean(ttft_s(m))) for name, m in (("without", without), ("with", with_host))
    }
    print(bandwidth_gbs, mean, with_host.extra)
    if bandwidth_gbs >= 25:
        assert mean["with"] < mean["without"]
    else:
        assert mean["with"] > mean["without"]


def test_a_burst_of_new_sessions_is_measured_over_the_requests_it_overlaps():
    data = chat(
        {"kind": "fixed", "value": 4},
        3.0,
        {"kind": "poisson", "rate": 4.0},
        requests=800,
        inputs=200,
    ).model_dump(mode="json")
    data["workload"]["burst"] = {"after": 60, "requests": 40, "multiple": 4.0}
    data["sla"]["burst_ttft_p99_ms"] = 2000
    data["load"] = {"mode": "fixed"}
    scenario = Scenario.model_validate(data)
    requests = make_requests(scenario.workload)
    plan = requests.sessions
    assert plan is not None and requests.burst is not None and requests.arrival_s is not None
    starts = fresh_starts(requests)
    gaps = np.diff(starts)
    assert gaps[61:99].mean() < 0.5 * np.delete(gaps, np.s_[60:100]).mean()  # squeezed
    inside = requests.arrival_s[requests.burst]
    assert inside.min() == starts[60] and inside.max() == starts[99]
    m = SimRunner().run(KNOBS | {"prefix_caching": True}, scenario.workload)
    metrics = summarize(m, scenario.sla, scenario.workload.burst)
    assert metrics["burst_ttft_samples"] == int(requests.burst.sum())
    assert metrics["burst_recovered"] is True
