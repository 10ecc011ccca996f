"""The capacity search and early rejection as pure logic, against fake sessions.

A fake session serves a rate well (every request fast) up to a known capacity and badly above
it, the way the search's contract assumes an engine does; the expected capacity is stated from
that threshold, not from the search's code. Early rejection's rule is checked against brute
force: every way the unfinished requests can still end, scored with numpy's own p99.
"""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from pydantic import ValidationError

from objectives.scenario import Scenario, load_scenario
from runners.load.capacity import evaluate
from runners.load.measurement import Fault, Measurement, load_certainly_fails

BOUND_MS = 500.0


def scenario_at(nominal: float, closed: bool = False, requests: int = 100, **load) -> Scenario:
    data = load_scenario("customer-service").model_dump(mode="json")
    data["workload"]["num_requests"] = requests
    data["workload"]["arrival"] = (
        {"kind": "closed", "concurrency": int(nominal)}
        if closed
        else {"kind": "poisson", "rate": nominal}
    )
    data["sla"] = {"ttft_p99_ms": BOUND_MS}
    data["load"] = load
    data.pop("quality", None)
    return Scenario.model_validate(data)


def fake_load(n: int, ttft_s: float, failed: int = 0) -> Measurement:
    """n requests sent one per 10 ms, each answered after ttft_s; the last `failed` fail."""
    send = np.arange(n) * 0.01
    ok = np.arange(n) < n - failed
    first = np.where(ok, send + ttft_s, np.nan)
    return Measurement(
        send, first, np.where(ok, first + 0.5, np.nan), np.full(n, 100), np.full(n, 10), ok
    )


class FakeSession:
    """Fast up to `capacity`; above it every request is 4x over the TTFT bound. Requests start
    failing (an overloaded server's 503s) from `failing_from`. With stop_early a missed step
    ends after a few requests, as a real engine's load does."""

    def __init__(self, capacity: float, failing_from: float = math.inf):
        self.capacity, self.failing_from = capacity, failing_from
        self.calls: list[tuple[float, bool]] = []
        self.windows: list[int] = []  # each load's requests
        self.extra: dict = {}

    def measure(self, workload, sla=None, stop_early=False) -> Measurement:
        arrival = workload.arrival
        rate = float(getattr(arrival, "rate", None) or arrival.concurrency)
        self.calls.append((rate, stop_early))
        n = workload.num_requests
        self.windows.append(n)
        failed = n // 10 if rate >= self.failing_from else 0
        slow = rate > self.capacity
        if stop_early and (slow or failed):
            m = fake_load(3, 4 * BOUND_MS / 1000 if slow else 0.01, failed=1 if failed else 0)
            m.fault = Fault("sla-violated", "certainly broken")
            return m
        return fake_load(n, 4 * BOUND_MS / 1000 if slow else 0.01, failed)


class FakeRunner:
    def __init__(self, session: FakeSession):
        self.fake = session

    def session(self, config, workload):
        from contextlib import nullcontext

        return nullcontext(self.fake)


def search(session: FakeSession, scenario: Scenario, hint: float | None = None) -> dict:
    evaluation = evaluate(FakeRunner(session), {}, scenario, capacity_hint=hint)
    assert evaluation.fault is None, evaluation.fault
    return evaluation.metrics


def test_nominal_step_runs_whole_and_the_others_stop_early():
    session = FakeSession(capacity=10.0)
    search(session, scenario_at(4.0))
    assert session.calls[0] == (4.0, False)
    assert len(session.calls) > 2 and all(stop for _, stop in session.calls[1:])

    session = FakeSession(capacity=10.0)
    search(session, scenario_at(4.0, early_rejection=False))
    assert not any(stop for _, stop in session.calls)


def test_a_miss_at_the_nominal_rate_is_measured_and_halving_finds_the_capacity_below():
    """A real-style session stops missed steps early; the nominal step still runs whole, so the
    trial keeps its TTFT and SLA check, and the search halves down to min_rate."""
    session = FakeSession(capacity=2.5)
    metrics = search(session, scenario_at(16.0, min_rate=0.5))
    assert (
        metrics["ttft_p99_ms"] > BOUND_MS and metrics["requests_sent"] == 100
    )  # whole, over the bound
    rates = [rate for rate, _ in session.calls]
    assert rates[:4] == [16.0, 8.0, 4.0, 2.0]
    assert 2.5 / 1.05 <= metrics["capacity_rate"] <= 2.5


def test_failed_requests_under_load_are_a_miss_the_search_bisects_on():
    """503s from 12 req/s on: the step misses its success rate; the search narrows to just below
    12 instead of ending (the old search stopped at the first failed request)."""
    session = FakeSession(capacity=100.0, failing_from=12.0)
    metrics = search(session, scenario_at(4.0, precision=0.02))
    assert "capacity_note" not in metrics
    assert 12.0 / 1.02 <= metrics["capacity_rate"] < 12.0
    failing = [s for s in metrics["capacity_steps"] if s["rate"] >= 12.0]
    assert failing and not any(s["meets_sla"] for s in failing)


@pytest.mark.parametrize("capacity", [0.3, 2.2, 3.9, 4.0, 9.7, 10.4, 31.0, 127.0])
@pytest.mark.parametrize("hint", [None, 0.2, 2.0, 4.1, 9.5, 10.0, 40.0, 200.0])
def test_a_search_from_a_hint_ends_where_the_search_from_the_nominal_rate_does(capacity, hint):
    """The search's answer is a bracket [highest rate that met, lowest that missed] within the
    precision, on the points it bisects: 4 req/s times 2**(k/16) at 5%. Started from any hint,
    near or far, above or below the nominal rate, it ends on the same bracket."""
    plain = search(FakeSession(capacity), scenario_at(4.0, min_rate=0.25, max_rate=256))
    hinted = search(FakeSession(capacity), scenario_at(4.0, min_rate=0.25, max_rate=256), hint)
    assert hinted["capacity_bracket"] == pytest.approx(plain["capacity_bracket"], rel=1e-9)
    met, missed = plain["capacity_bracket"]
    assert met <= capacity < missed <= met * 1.05
    k = 16 * math.log2(met / 4.0)  # on the grid: a whole number of 16ths of a doubling
    assert k == pytest.approx(round(k), abs=1e-9)


@pytest.mark.parametrize(("min_rate", "max_rate"), [(0.3, 24.0), (1.0, 6.0), (None, None)])
@pytest.mark.parametrize("capacity", [0.31, 0.9, 5.0, 5.9, 23.0, 50.0, 70.0])
@pytest.mark.parametrize("hint", [0.35, 3.0, 5.5, 8.7, 20.0, 60.0])
def test_a_hinted_search_ends_as_the_plain_one_past_bounds_off_the_grid(
    min_rate, max_rate, capacity, hint
):
    """Bounds that are no whole doubling of the nominal rate (6 and 24 req/s above 4; 0.3 and
    1 below it) take the plain search off its grid at the ends: it measures the bound, then
    bisects up to it. Hinted, near a bound or past it, the search ends on the same bracket."""
    bounds = {"min_rate": min_rate, "max_rate": max_rate} if min_rate else {}
    plain = search(FakeSession(capacity), scenario_at(4.0, **bounds))
    hinted = search(FakeSession(capacity), scenario_at(4.0, **bounds), hint)
    for ends in zip(hinted["capacity_bracket"], plain["capacity_bracket"], strict=True):
        # an end is None where every step met to the ceiling or missed to the floor
        assert ends[0] == ends[1] if None in ends else ends[0] == pytest.approx(ends[1])


def test_a_right_hint_measures_the_two_rates_around_the_capacity_and_nothing_else():
    """Found from the nominal rate, 10 req/s takes 4, 8, 16 and four bisections; from a hint
    of the rate that met (9.51, as a neighbouring config's search would report it), only it
    and the next point up: the steps near capacity are the ones that run longest."""
    plain = FakeSession(10.0)
    met = search(plain, scenario_at(4.0))["capacity_rate"]
    hinted = FakeSession(10.0)
    metrics = search(hinted, scenario_at(4.0), hint=met)
    assert [rate for rate, _ in hinted.calls] == pytest.approx([4.0, met, met * 2 ** (1 / 16)])
    assert metrics["capacity_rate"] == pytest.approx(met)
    assert len(plain.calls) == 7


def test_a_hint_past_the_rate_bounds_or_for_a_closed_loop_is_not_used():
    """A hint outside [min_rate, max_rate] has no grid point to start from, and a closed loop's
    whole numbers are not that grid: each searches from the nominal rate, as with no hint."""
    for scenario, hint in [
        (scenario_at(4.0, max_rate=32), 64.0),
        (scenario_at(4.0, min_rate=1.0), 0.5),
        (scenario_at(8, closed=True), 20.0),
    ]:
        plain, hinted = FakeSession(9.0), FakeSession(9.0)
        search(plain, scenario)
        search(hinted, scenario, hint)
        assert hinted.calls == plain.calls


@pytest.mark.parametrize("bound", ["min_rate", "max_rate"])
def test_a_closed_loop_refuses_fractional_bounds(bound):
    value = 2.5 if bound == "min_rate" else 10.5
    with pytest.raises(ValidationError, match=f"load.{bound} .* whole number"):
        scenario_at(8, closed=True, **{bound: value})


def test_a_window_of_conversations_lasts_one_at_least():
    """Conversations of 3 turns with 10 s of thinking, paced by a 500 ms TTFT bound and no TPOT
    bound (50 ms a token): with 128-token answers one lasts 3 x (0.5 + 127 x 0.05) + 2 x 10 =
    40.55 s, so every load at rate r sends at least 40.55 r requests (100 would be half a
    conversation at 5 req/s)."""
    data = scenario_at(4.0).model_dump(mode="json")
    data["workload"]["output_tokens"] = {"kind": "fixed", "value": 128}
    data["workload"]["sessions"] = {"turns": {"kind": "fixed", "value": 3}, "think_time_s": 10.0}
    for field in ("first_token_wait_ms", "read_ms_per_token"):
        data["workload"]["sessions"].pop(field, None)
    session = FakeSession(capacity=10.0)
    search(session, Scenario.model_validate(data))
    assert len(session.calls) > 3
    for (rate, _), requests in zip(session.calls, session.windows, strict=True):
        assert requests >= math.ceil(40.55 * rate - 1e-6), (rate, requests)


def test_closed_loop_search_ends_on_whole_rates_within_its_bounds():
    """Many thresholds and bounds: the search always ends, measures each rate once, stays on
    whole numbers in [min_rate, max_rate], and finds the largest concurrency at or below the
    threshold (what "capacity" means for a closed loop)."""
    rng = random.Random(7)
    for _ in range(200):
        floor = rng.randint(1, 6)
        nominal = rng.randint(floor, 12)
        ceiling = rng.randint(nominal + 1, 40)
        threshold = rng.uniform(0.5, 45)
        session = FakeSession(capacity=threshold)
        metrics = search(
            session,
            scenario_at(
                nominal, closed=True, requests=50, min_rate=floor, max_rate=ceiling, precision=0.01
            ),
        )
        # One step per rate; a step may run more than one window (a 50-request load lasts
        # 0.5 s, the fake's latency: it is all the engine filling up, and runs again longer).
        rates = [step["rate"] for step in metrics["capacity_steps"]]
        assert len(rates) == len(set(rates)), rates
        assert all(r.is_integer() and floor <= r <= ceiling for r, _ in session.calls), rates
        expected = max((r for r in range(floor, ceiling + 1) if r <= threshold), default=None)
        assert metrics["capacity_rate"] == expected, (floor, nominal, ceiling, threshold, rates)


def futures_all_fail(
    planned: int, late_ok: int, late_in_flight: int, failed: int, min_success: float
) -> bool:
    """Brute force: every way the in-flight late requests end (late success or failure), the rest
    succeeding fast and the late ones barely over the bound (the kindest case); the load fails
    if numpy's p99 of successes or the success rate misses."""
    fast = planned - late_ok - late_in_flight - failed
    for outcome in itertools.product((True, False), repeat=late_in_flight):
        late = late_ok + sum(outcome)
        failures = failed + late_in_flight - sum(outcome)
        ttft = np.array([1.0001] * late + [0.0] * fast)
        p99_missed = ttft.size > 0 and np.percentile(ttft, 99) > 1.0
        if not p99_missed and ttft.size and (planned - failures) / planned >= min_success:
            return False
    return True


def test_early_rejection_matches_brute_force_over_every_future():
    for planned in (1, 5, 20, 100, 150):
        for min_success in (1.0, 0.98, 0.9):
            for late_ok, late_in_flight, failed in itertools.product(range(4), range(5), range(5)):
                if late_ok + late_in_flight + failed > planned:
                    continue
                expected = futures_all_fail(planned, late_ok, late_in_flight, failed, min_success)
                got = load_certainly_fails(planned, late_ok, late_in_flight, failed, min_success)
                assert got == expected, (planned, min_success, late_ok, late_in_flight, failed)


def test_requests_late_then_failed_do_not_reject_a_load_that_passes():
    """The outside review's repro: SLA p99 200 ms with 98% success; two requests were late and
    then failed. The p99 over the 98 successes holds and 98% succeeded: the load passes, so
    early rejection must not stop it (the old rule counted the two as late)."""
    assert not load_certainly_fails(
        100, late_ok=0, late_in_flight=0, failed=2, min_success_rate=0.98
    )
    # Without a success-rate SLO every request must succeed: one failure settles it.
    assert load_certainly_fails(100, late_ok=0, late_in_flight=0, failed=1, min_success_rate=1.0)


PRUNE_HINT, PRUNE_BELOW = 10.0, 8.5
# The grid point at or below 8.5 on 4 req/s * 2**(k/16): k = floor(16 * log2(8.5 / 4)) = 17.
PRUNE_POINT = 4.0 * 2 ** (17 / 16)  # 8.36


@pytest.mark.parametrize("capacity", [0.3, 2.2, 3.9, 6.5, 8.3, 8.4, 9.7, 10.4, 31.0])
def test_a_search_is_pruned_exactly_where_the_capacity_lies_below_the_prune_rate(capacity):
    """Pruning may end a search only where the config cannot reach the rate it had to: with a
    hint of 10 req/s and prune_below 8.5, a capacity under the grid point 8.36 is pruned after
    the nominal step, the hint's grid point and 8.36 (below the nominal rate: after the
    nominal step alone), and says where it missed; any other ends on the plain search's
    bracket."""
    scenario = scenario_at(4.0, min_rate=0.25, max_rate=256)
    plain = search(FakeSession(capacity), scenario)
    session = FakeSession(capacity)
    evaluation = evaluate(
        FakeRunner(session), {}, scenario, capacity_hint=PRUNE_HINT, prune_below=PRUNE_BELOW
    )
    assert evaluation.fault is None
    rates = [rate for rate, _ in session.calls]
    if capacity < PRUNE_POINT:
        assert evaluation.pruned is not None and "capacity lies below" in evaluation.pruned
        assert "capacity_rate" not in evaluation.metrics
        if capacity < 4.0:
            assert rates == [4.0]
            assert evaluation.metrics["capacity_below"] == 4.0
        else:
            assert rates == pytest.approx([4.0, 4.0 * 2 ** (21 / 16), PRUNE_POINT])
            assert evaluation.metrics["capacity_below"] == pytest.approx(PRUNE_POINT)
    else:
        assert evaluation.pruned is None
        assert evaluation.metrics["capacity_bracket"] == pytest.approx(plain["capacity_bracket"])
