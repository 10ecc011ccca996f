"""The contract every runner must pass (like Optuna's testing/pytest_storages.py).

A runner's test module subclasses RunnerContract and provides the three fixtures below, all
class-scoped: a real engine starts once per run(), so the good config is measured once per class.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from objectives.scenario import SLA, Load, Scenario, Workload
from runners.load.capacity import evaluate
from runners.load.measurement import Measurement, summarize
from runners.load.workload import Requests, make_requests
from search_spaces.knobs import ENGINES
from tests.conftest import small_scenario


def judged_window(attrs: dict, workload: Workload) -> Requests:
    """The planned requests of a trial's nominal load as judged: the scenario's, with twice as
    many per window after the first until one settled (runners.load.capacity)."""
    sent = workload.num_requests * 2 ** (attrs["windows"] - 1)
    assert attrs["requests_sent"] == sent
    return make_requests(workload.model_copy(update={"num_requests": sent}))


# The client's first send may come this late on 2 busy cores (its connection is opened first).
FIRST_SEND_LAG_S = 0.5


def assert_throughput_within_the_load(attrs: dict, planned) -> None:
    """A trial's nominal-rate throughput against facts summarize does not make: the planned
    tokens cannot all be out before the last planned arrival, counted from the first request's
    send (which a busy event loop may send up to FIRST_SEND_LAG_S late: a measured duration
    is from the first send), and they were all out within the time the runner spent driving
    loads (its own clock around every load, warm-up included)."""
    shortest_s = np.ptp(planned.arrival_s) - FIRST_SEND_LAG_S
    assert shortest_s > 0, "a load long enough to bound its throughput"
    for key, tokens in (
        ("output_tokens_per_s", planned.output_tokens.sum()),
        ("total_tokens_per_s", planned.output_tokens.sum() + planned.input_tokens.sum()),
    ):
        assert tokens / attrs["runner_load_s"] <= attrs[key] <= tokens / shortest_s, key


class RunnerContract:
    @pytest.fixture(scope="class")
    @classmethod
    def runner(cls):
        raise NotImplementedError

    @pytest.fixture(scope="class")
    @classmethod
    def good_config(cls) -> dict:
        raise NotImplementedError

    @pytest.fixture(scope="class")
    @classmethod
    def impossible_config(cls) -> dict:
        """A config the runner cannot serve (too little memory, a bad flag, ...)."""
        raise NotImplementedError

    @pytest.fixture(scope="class")
    @classmethod
    def workload(cls) -> Workload:
        return small_scenario(requests=60).workload

    @pytest.fixture(scope="class")
    @classmethod
    def timed_run(cls, runner, good_config, workload) -> tuple[Measurement, float]:
        """The good config measured once, and the wall seconds the test saw the run take."""
        started = time.monotonic()
        measurement = runner.run(good_config, workload)
        return measurement, time.monotonic() - started

    @pytest.fixture(scope="class")
    @classmethod
    def measured(cls, timed_run) -> Measurement:
        return timed_run[0]

    def test_identity_names_everything(self, runner):
        identity = runner.identity()
        assert set(identity) >= {"runner", "engine", "model", "hardware"}
        assert all(isinstance(v, str) and v for v in identity.values())
        assert runner.engine in ENGINES

    def test_measurement_has_one_record_per_request(self, measured, workload):
        m = measured
        assert isinstance(m, Measurement) and m.fault is None, m.fault
        n = workload.num_requests
        for column in (
            m.send_s,
            m.first_token_s,
            m.finish_s,
            m.input_tokens,
            m.output_tokens,
            m.ok,
        ):
            assert column.shape == (n,)
        assert m.ok.all()

    def test_records_are_ordered_in_time_and_exact_in_tokens(self, measured, workload):
        m = measured
        ok = m.ok
        assert np.all(m.send_s[ok] <= m.first_token_s[ok])
        assert np.all(m.first_token_s[ok] <= m.finish_s[ok])
        planned = make_requests(workload)
        assert np.array_equal(m.input_tokens, planned.input_tokens)
        assert np.array_equal(m.output_tokens[ok], planned.output_tokens[ok])

    def test_metrics_agree_with_the_planned_load(self, timed_run, runner, workload):
        """Checked against the workload the runner was asked to serve and the test's own clock,
        not against summarize's formulas."""
        measured, wall_s = timed_run
        scenario = small_scenario(requests=workload.num_requests)
        planned = make_requests(workload)
        metrics = summarize(measured, scenario.sla)
        # Every request is served; the first tenth (rounded down) warm up the engine and are no
        # percentile samples (runners.load.measurement).
        warmup = len(planned) // 10
        assert metrics["requests_sent"] == metrics["requests_ok"] == len(planned)
        assert metrics["warmup_requests"] == warmup
        assert metrics["ttft_samples"] == len(planned) - warmup
        assert metrics["success_rate"] == 1.0
        tokens = int(planned.output_tokens.sum())
        if planned.arrival_s is not None:
            # Open loop: the output cannot all be delivered before the last request is sent. The
            # span is the one the sends took (on a busy machine the first was sent 7 ms late,
            # and the planned span then exceeded the run by more than the last answer took).
            span = float(np.ptp(measured.send_s))
            assert metrics["output_tokens_per_s"] <= tokens / span
            assert metrics["requests_per_s"] <= len(planned) / span
        if runner.name != "sim":  # a simulated clock has no relation to the wall clock
            # Everything was delivered within the run the test timed (engine start included).
            assert metrics["output_tokens_per_s"] >= tokens / wall_s
        multi = int((planned.output_tokens[warmup:] > 1).sum())
        assert metrics["tpot_samples"] == multi and metrics["tpot_p50_ms"] > 0
        assert 0 < metrics["ttft_p50_ms"] <= metrics["ttft_p99_ms"] < metrics["e2el_p99_ms"]
        assert metrics["p99_low_samples"] == (len(planned) - warmup < 100)

    def test_sessions_are_served_turn_after_turn(self, runner, good_config, workload):
        """Three-turn conversations: every turn is served, each sent only after its session's
        previous answer came (and its user thought) and not before its planned time,
        carrying that history: its prompt is longer than its own new tokens by at least the
        previous prompt."""
        data = workload.model_dump(mode="json")
        data["num_requests"] = 24
        data["sessions"] = {
            "turns": {"kind": "fixed", "value": 3},
            "think_time_s": 0.05,
            "first_token_wait_ms": 20.0,
            "read_ms_per_token": 1.0,
        }
        sessions = Workload.model_validate(data)
        planned = make_requests(sessions)
        plan = planned.sessions
        assert plan is not None
        m = runner.run(good_config, sessions)
        assert m.fault is None and m.ok.all() and m.sent == len(planned), m.fault
        assert m.planned_index is not None
        assert sorted(m.planned_index.tolist()) == list(range(len(planned)))
        assert (np.diff(m.send_s) >= 0).all()  # records in send order
        row = np.empty(len(planned), np.int64)
        row[m.planned_index] = np.arange(m.sent)
        later = np.flatnonzero(plan.previous >= 0)
        assert later.size >= 12
        previous = row[plan.previous[later]]
        assert (m.send_s[row[later]] >= m.finish_s[previous] + plan.think_s[later] - 1e-6).all()
        assert planned.arrival_s is not None and m.due_s is not None
        assert (m.send_s >= m.due_s - 0.005).all()  # an event loop may wake a hair early
        # and no later than its plan or its think time after the answer, whichever is later
        # (a busy event loop may take a while to wake)
        due = np.maximum(m.due_s[row[later]], m.finish_s[previous] + plan.think_s[later])
        assert (m.send_s[row[later]] <= due + 1.0).all()
        recorded = m.input_tokens[row[later]]
        assert (recorded >= m.input_tokens[previous] + plan.new_tokens[later]).all()

    def test_impossible_config_is_a_fault_not_an_exception(
        self, runner, impossible_config, workload
    ):
        reasons = runner.violations(impossible_config, workload)
        m = runner.run(impossible_config, workload)
        assert m.fault is not None and m.fault.message
        assert reasons or m.fault.kind != "infeasible"

    def test_capacity_search_steps_share_one_session(self, runner, good_config, workload):
        """One engine start per trial: every step of the search runs against the same session."""
        scenario = Scenario(
            name="capacity-contract",
            workload=workload,
            sla=SLA(ttft_p99_ms=3000),
            load=Load(max_rate=workload.arrival.rate * 4, precision=0.5, max_trial_s=600),
        )
        opened = []
        session = runner.session

        def counted(config, load):
            opened.append(config)
            return session(config, load)

        runner.session = counted
        try:
            result = evaluate(runner, good_config, scenario)
        finally:
            del runner.session
        assert result.fault is None, result.fault
        assert len(opened) == 1
        steps = result.metrics["capacity_steps"]
        assert len(steps) >= 2 and steps[0]["rate"] == workload.arrival.rate
        assert steps[1]["rate"] == 2 * workload.arrival.rate or not steps[0]["meets_sla"]
        assert all(step["ttft_samples"] for step in steps if step["meets_sla"])
        good = [step["rate"] for step in steps if step["meets_sla"]]
        assert result.metrics["capacity_rate"] == (max(good) if good else None)
