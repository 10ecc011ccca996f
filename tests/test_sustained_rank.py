"""What the pick rule ranks is what a config sustains, not the window it was read on: an open
loop's capacity throughput is its rate times the workload's mean output length (runners.load
.capacity.sustained_tokens_per_s), the same for every config of the same capacity whatever the
window that decided it, so the TTFT tie-break decides between them."""

from __future__ import annotations

import pytest

from objectives.scenario import Load, load_scenario
from objectives.scoring import pick_best
from runners.load.capacity import evaluate
from runners.sim.runner import DEFAULTS, SimRunner

# Two configs the simulator gives the same capacity on customer-service at the default
# precision (their windows differ: the first settles on the scenario's, the second is longer).
CONFIG = DEFAULTS | dict(
    batch_size=128, select_batch="decode-first", quantization="w8a8", max_prefill_batch_size=32
)


def _capacity(requests: int) -> dict:
    base = load_scenario("customer-service")
    workload = base.workload.model_copy(update={"num_requests": requests})
    scenario = base.model_copy(update={"workload": workload, "load": Load()})
    return evaluate(SimRunner(), CONFIG, scenario).metrics


def test_equal_capacities_read_on_different_windows_tie_and_ttft_decides():
    short, long = _capacity(1000), _capacity(8000)
    assert short["capacity_rate"] == long["capacity_rate"]  # the same grid point
    assert short["capacity_horizon_requests"] < long["capacity_horizon_requests"]
    # Measured, the windows differ: their ramp and drain are different shares of them.
    measured = short["capacity_measured_output_tokens_per_s"]
    assert measured != long["capacity_measured_output_tokens_per_s"]
    # Ranked, they tie: customer-service's outputs are Normal(128, 32) clipped to 32..256, a
    # mean of 128 tokens (the clipping is symmetric about it).
    rate = short["capacity_rate"]
    assert short["capacity_output_tokens_per_s"] == long["capacity_output_tokens_per_s"]
    assert short["capacity_output_tokens_per_s"] == pytest.approx(rate * 128, rel=0.003)
    # so the pick rule's tie-break runs: the lower TTFT p99 is the pick, whichever window
    candidates = [
        ("short window, slower first token", 90.0, short["capacity_output_tokens_per_s"]),
        ("long window, faster first token", 60.0, long["capacity_output_tokens_per_s"]),
    ]
    assert pick_best(candidates, "max-throughput", 0.01) == "long window, faster first token"
    candidates[1] = ("long window, slower first token", 120.0, candidates[1][2])
    assert pick_best(candidates, "max-throughput", 0.01) == "short window, slower first token"


def test_a_closed_loop_keeps_its_measured_throughput():
    """A closed loop's rate is requests in flight, not per second: nothing to multiply."""
    base = load_scenario("content-generation")
    workload = base.workload.model_copy(update={"num_requests": 200})
    scenario = base.model_copy(update={"workload": workload})
    metrics = evaluate(SimRunner(), CONFIG | {"batch_size": 64}, scenario).metrics
    measured = metrics["capacity_measured_output_tokens_per_s"]
    assert metrics["capacity_output_tokens_per_s"] == measured > 0
