"""The contract every runner must pass (like Optuna's testing/pytest_storages.py).

A runner's test module subclasses RunnerContract and provides the three fixtures below, all
class-scoped: a real engine starts once per run(), so the good config is measured once per class.
"""

from __future__ import annotations

import numpy as np
import pytest

from objectives.scenario import Workload
from runners.measurement import Measurement, summarize
from runners.workload import make_requests
from search_spaces.knobs import ENGINES
from tests.conftest import small_scenario


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
    def measured(cls, runner, good_config, workload) -> Measurement:
        return runner.run(good_config, workload)

    def test_identity_names_everything(self, runner):
        identity = runner.identity()
        assert set(identity) >= {"runner", "engine", "model", "hardware"}
        assert all(isinstance(v, str) and v for v in identity.values())
        assert runner.engine in ENGINES

    def test_measurement_has_one_record_per_request(self, measured, workload):
        m = measured
        assert isinstance(m, Measurement) and m.fault is None, m.fault
        n = workload.num_requests
        for column in (m.send_s, m.first_token_s, m.finish_s, m.input_tokens, m.output_tokens, m.ok):
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

    def test_metrics_consistent_with_records(self, measured, workload):
        scenario = small_scenario(requests=workload.num_requests)
        m = measured
        metrics = summarize(m, scenario.sla)
        assert metrics["ttft_samples"] == int(m.ok.sum())
        assert metrics["output_tokens_per_s"] * metrics["duration_s"] == pytest.approx(m.output_tokens[m.ok].sum())
        assert metrics["ttft_p50_ms"] <= metrics["ttft_p90_ms"] <= metrics["ttft_p99_ms"]
        assert 0 <= metrics["goodput_rps"] <= metrics["requests_per_s"]
        assert metrics["p99_low_samples"] == (metrics["ttft_samples"] < 100)

    def test_impossible_config_is_a_fault_not_an_exception(self, runner, impossible_config, workload):
        reasons = runner.violations(impossible_config, workload)
        m = runner.run(impossible_config, workload)
        assert m.fault is not None and m.fault.message
        assert reasons or m.fault.kind != "infeasible"
