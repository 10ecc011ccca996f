"""Sustained capacity (issue 28, item 1): a load meets its rate only if the engine delivers
what it is offered. Hand-built measurements for the delivered rate; a planted engine whose
first tokens come at once while its completions fall behind (prefill-first: TTFT flat, the
running batch growing), which a short load's percentiles hide; and the simulator's customer-
service export held under a load 16 times longer than the one that measured it."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from objectives.scenario import SLA, Load, Scenario, Workload, load_scenario
from objectives.scoring import constraint_values, is_feasible, sustain_tolerance
from runners.load.capacity import evaluate
from runners.load.measurement import Measurement, delivered, summarize, warmup_requests
from runners.load.workload import make_requests
from runners.sim.runner import DEFAULTS, SimRunner


def _measurement(send: np.ndarray, finish: np.ndarray, first: np.ndarray | None = None):
    n = send.size
    first = send + 0.01 if first is None else first
    m = Measurement(send, first, finish, np.full(n, 100), np.full(n, 10), np.full(n, True))
    m.warmup = warmup_requests(n)
    return m


def test_a_server_that_keeps_up_delivers_what_it_is_offered():
    """10 req/s, each request done 2 s after it was sent: the backlog holds at 20."""
    send = np.arange(1000) / 10.0
    offered, served = delivered(_measurement(send, send + 2.0))
    assert offered == pytest.approx(10.0)
    assert served == pytest.approx(10.0, rel=1e-3)


def test_what_was_served_leaves_the_drain_out():
    """10 req/s for 100 s, each request done 5 s after it was sent: the engine served 10 req/s
    throughout; over the whole window (the last 5 s only draining) it reads 1,000 / 104.9 s.
    The front's and the export's "served", and the fleet sized on it, take the former."""
    send = np.arange(1000) / 10.0
    metrics = summarize(_measurement(send, send + 5.0), SLA(ttft_p99_ms=500))
    assert metrics["requests_per_s"] == pytest.approx(1000 / 104.9, rel=1e-3)
    assert metrics["served_rps"] == pytest.approx(10.0, rel=1e-3)


def test_a_server_that_falls_behind_delivers_its_own_rate():
    """10 req/s offered to a FIFO server that finishes one request every 0.125 s (8 req/s):
    the backlog grows by 2 requests a second, so 8 of the 10 are delivered."""
    send = np.arange(1000) / 10.0
    finish = np.maximum.accumulate(np.arange(1, 1001) * 0.125)
    _, served = delivered(_measurement(send, finish))
    assert served == pytest.approx(8.0, rel=0.01)
    assert summarize(_measurement(send, finish), SLA(ttft_p99_ms=500))[
        "delivered_share"
    ] == pytest.approx(0.8, rel=0.01)


def test_a_failed_request_leaves_the_backlog():
    """Every other request fails: the success rate judges that; the backlog of the successful
    ones holds, so they are delivered as offered (5 req/s of them)."""
    send = np.arange(1000) / 10.0
    m = _measurement(send, send + 1.0)
    m.ok = np.arange(1000) % 2 == 0
    m.finish_s = np.where(m.ok, m.finish_s, np.nan)
    offered, served = delivered(m)
    assert offered == pytest.approx(5.0, rel=0.01) and served == pytest.approx(5.0, rel=0.01)


def test_the_engine_filling_up_is_left_out():
    """The first half of the measured window is the engine filling up (latency rising to 20 s),
    the second is steady: delivered as offered."""
    send = np.arange(2000) / 10.0
    latency = np.minimum(send, 60.0) / 3  # 0 -> 20 s over the first 60 s, then flat
    assert delivered(_measurement(send, send + latency))[1] == pytest.approx(10.0, rel=1e-3)


def test_a_session_turn_waiting_for_a_late_answer_is_backlog():
    """Turns due at 10 req/s that the client can only send as answers come, at 8 req/s
    (each sent later than the last): the sends alone show a server that keeps up (done 1 s
    after each); counted from when each turn was due, the backlog grows by 2 a second, so 8
    of the 10 are delivered."""
    due = np.arange(1000) / 10.0
    send = due * 1.25
    m = _measurement(send, send + 1.0)
    offered, served = delivered(m)
    assert offered == pytest.approx(8.0, rel=0.01) and served / offered == pytest.approx(1.0)
    m.due_s = due
    offered, served = delivered(m)
    assert offered == pytest.approx(10.0) and served == pytest.approx(8.0, rel=0.01)


def test_too_short_a_half_is_not_judged():
    send = np.arange(40) / 10.0
    assert delivered(_measurement(send, send + 1.0)) is None
    metrics = summarize(_measurement(send, send + 1.0), SLA(ttft_p99_ms=500))
    assert metrics["delivered_share"] is None
    assert constraint_values(metrics, SLA(ttft_p99_ms=500))["sustained"] == 0.0


def test_sustained_is_an_slo_of_every_sla_and_its_tolerance_narrows_with_the_window():
    """Planted FIFO servers under 10 req/s of Poisson arrivals, their first tokens at once (so
    TTFT alone meets the SLA everywhere): one that keeps up passes a short and a long window;
    one 2% short passes over 4,000 requests (the window's own arrival noise is as large) but
    must fail over 16,000; one 15% short fails both. A window too short to judge passes it."""
    sla = SLA(ttft_p99_ms=500)

    def sustained_met(served_rps: float, requests: int) -> bool:
        workload = _scenario(10.0, requests).workload
        metrics = summarize(_PrefillFirstEngine(served_rps).measure(workload), sla)
        constraints = constraint_values(metrics, sla)
        assert constraints["ttft_p99"] <= 0
        return constraints["sustained"] <= 0

    assert sustained_met(20.0, 4_400) and sustained_met(20.0, 17_600)
    assert sustained_met(9.8, 4_400) and not sustained_met(9.8, 17_600)
    assert not sustained_met(8.5, 4_400) and not sustained_met(8.5, 17_600)
    unjudged = {"ttft_p99_ms": 100.0, "success_rate": 1.0}  # no delivered_share
    assert is_feasible(constraint_values(unjudged, sla))


class _PrefillFirstEngine:
    """A planted engine: every first token 20 ms after its request is sent, but completions
    leave one at a time, at most `served_rps` per second, FIFO (a prefill-first engine whose
    running batch grows while its TTFT stays flat)."""

    name = "planted"

    def __init__(self, served_rps: float):
        self.served_rps = served_rps
        self.extra: dict[str, Any] = {}

    @contextmanager
    def session(self, config: dict[str, Any], workload: Workload):
        yield self

    def measure(self, workload: Workload, sla: SLA | None = None, stop_early: bool = False):
        requests = make_requests(workload)
        assert requests.arrival_s is not None
        send = requests.arrival_s
        gap = 1.0 / self.served_rps
        finish = np.empty_like(send)
        free = 0.0
        for i, t in enumerate(send):  # a FIFO server of `served_rps`
            free = max(free, t + 0.02) + gap
            finish[i] = free
        m = Measurement(
            send,
            send + 0.02,
            finish,
            requests.input_tokens,
            requests.output_tokens,
            np.full(send.size, True),
        )
        m.warmup = warmup_requests(send.size)
        return m


def _scenario(rate: float, requests: int) -> Scenario:
    workload = Workload.model_validate(
        {
            "arrival": {"kind": "poisson", "rate": rate},
            "num_requests": requests,
            "input_tokens": {"kind": "fixed", "value": 100},
            "output_tokens": {"kind": "fixed", "value": 1},
            "seed": 0,
        }
    )
    return Scenario(
        name="planted",
        workload=workload,
        sla=SLA(ttft_p99_ms=500),
        load=Load(mode="capacity", precision=0.05),
    )


def test_a_planted_overload_that_a_short_load_hides_is_no_capacity():
    """Served at most 8 req/s: the TTFT is a flat 20 ms at any rate, so only the delivered rate
    tells that 16 req/s is beyond it. The capacity must lie within the search's precision
    (5%) of 8 req/s, and never above the rate of which 8 is the tolerated share (the old rule
    found 16: every step but the ceiling met the SLA)."""
    metrics = evaluate(_PrefillFirstEngine(8.0), {}, _scenario(4.0, 1000)).metrics
    steps = metrics["capacity_steps"]
    judged = next(s for s in steps if s["rate"] == metrics["capacity_rate"] and s["meets_sla"])
    slack = sustain_tolerance(judged["horizon_requests"] - judged["warmup_requests"])
    assert metrics["capacity_rate"] <= 8.0 / (1 - slack)
    assert metrics["capacity_rate"] >= 8.0 / 1.05
    assert all("delivered_rps" in step and "offered_rps" in step for step in steps)
    missed = [step for step in steps if not step["meets_sla"]]
    assert missed
    for step in missed:  # each missed on what it delivered, judged on its own window
        measured = step["horizon_requests"] - step["warmup_requests"]
        assert step["delivered_share"] < 1 - sustain_tolerance(measured)


def test_the_nominal_rate_is_a_miss_when_it_is_not_sustained():
    """At 12 req/s nominal against 8 served, the trial's own SLA check fails."""
    metrics = evaluate(_PrefillFirstEngine(8.0), {}, _scenario(12.0, 1000)).metrics
    assert metrics["delivered_share"] < 0.8
    assert not is_feasible(constraint_values(metrics, SLA(ttft_p99_ms=500)))


def test_the_customer_service_capacity_holds_sixteen_times_longer():
    """The config issue 28 found exported at 1.6x what it sustains (batch 2052 prefill-first,
    w8a8 / KV 0.5): held at the capacity now found, over 16x the preset's requests, it meets
    the SLA; and it delivers what it is offered."""
    scenario = load_scenario("customer-service")
    config = DEFAULTS | {
        "batch_size": 2052,
        "select_batch": "prefill-first",
        "max_prefill_tokens": 14848,
        "quantization": "w8a8",
        "kv_compression": 0.5,
        "max_prefill_batch_size": 5,
    }
    runner = SimRunner()
    rate = evaluate(runner, config, scenario).metrics["capacity_rate"]
    assert rate is not None
    held = held_sixteen_times_longer(runner, config, scenario, rate)
    assert is_feasible(constraint_values(held, scenario.sla)), held


def held_sixteen_times_longer(runner, config: dict, scenario: Scenario, rate: float) -> dict:
    """The metrics of a fixed load at `rate` over 16 times the scenario's requests."""
    long = scenario.at_rate(rate).model_copy(
        update={"num_requests": 16 * scenario.workload.num_requests}
    )
    with runner.session(config, long) as session:
        return summarize(session.measure(long, scenario.sla), scenario.sla)
