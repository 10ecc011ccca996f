"""The ranges a study searches: the capacity search's default floor, a runner's ceiling from what
memory holds, and the message when the best config sits on a range's end (pure logic)."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from optuna.distributions import IntDistribution

from objectives.scenario import Scenario, load_scenario
from runners.sim.runner import SimRunner
from search_spaces.edges import range_edges
from search_spaces.space import KnobRange, SearchSpace
from tests.conftest import run_autotune
from tuner.prepare import keep_earlier_batch_range

STUDY = "small-cs.sim.mindie.qwen2-7b.ascend-910b2"


def test_default_floor_is_a_sixteenth_of_the_nominal_rate():
    """customer-service's nominal 6 req/s: the search may go down to 0.375 req/s, so the seed
    article's batch 8-16 configs (1.3-3 req/s) get a capacity instead of none."""
    scenario = load_scenario("customer-service")
    low, high = scenario.rate_bounds
    assert low == pytest.approx(6 / 16)
    assert high == pytest.approx(6 * 64)


def test_closed_loop_floor_is_a_whole_request_in_flight():
    data = load_scenario("customer-service").model_dump()
    data["workload"]["arrival"] = {"kind": "closed", "concurrency": 40}
    assert Scenario.model_validate(data).rate_bounds[0] == 2  # 40 / 16 = 2.5, whole: 2
    data["workload"]["arrival"] = {"kind": "closed", "concurrency": 8}
    assert Scenario.model_validate(data).rate_bounds[0] == 1  # never below one in flight


def test_a_set_min_rate_is_kept():
    data = load_scenario("customer-service").model_dump()
    data["load"] = {"min_rate": 3.0}
    assert Scenario.model_validate(data).rate_bounds[0] == 3.0


def test_best_on_the_top_of_the_batch_range_says_how_to_widen_it():
    space = SearchSpace.load("mindie")  # batch_size 1..256, log
    edges = range_edges(space, {"batch_size": 256, "max_prefill_tokens": 4096})
    assert [(edge.knob, edge.side) for edge in edges] == [("batch_size", "high")]
    message = edges[0].message()
    assert "batch_size = 256 sits on the high end of its range 1..256" in message
    assert "{batch_size: {low: 1, high: 512, log: true}}" in message


def test_a_linear_range_widens_on_its_step():
    space = SearchSpace.load("mindie")  # max_prefill_tokens 1024..16384 step 512
    (edge,) = range_edges(space, {"batch_size": 64, "max_prefill_tokens": 1024})
    assert edge.side == "low"
    assert "{max_prefill_tokens: {low: 512, high: 16384, step: 512}}" in edge.message()


def test_an_end_at_the_knobs_own_limit_is_not_reported():
    space = SearchSpace.load("mindie")  # max_prefill_batch_size 1..64: 1 is the least it can be
    assert range_edges(space, {"batch_size": 64, "max_prefill_batch_size": 1}) == []


def test_a_ceiling_from_memory_replaces_the_presets_and_cannot_be_widened():
    space = SearchSpace.load("mindie").with_ceiling("batch_size", 1024, "KV cache: 1024 requests")
    assert space.ranges["batch_size"].high == 1024
    assert any("raised from 256 to 1024" in note for note in space.notes)
    (edge,) = range_edges(space, {"batch_size": 1024})
    assert edge.widened is None
    assert "cannot move: KV cache: 1024 requests" in edge.message()


def test_a_users_range_is_lowered_to_the_ceiling_but_never_raised(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("knobs:\n  batch_size: {low: 1, high: 64, log: true}\n")
    space = SearchSpace.load("mindie", path)
    assert space.with_ceiling("batch_size", 1024, "memory").ranges["batch_size"].high == 64
    assert space.with_ceiling("batch_size", 32, "memory").ranges["batch_size"].high == 32


def test_near_the_end_counts_as_on_it():
    """A sampler rarely lands exactly on 256; 249 is within 1% of the log range 1..256, 200 is
    4.5% below its top, 181 (256 / sqrt 2) is 6% below: only the first two sit on it."""
    space = SearchSpace.load("mindie")
    assert [e.knob for e in range_edges(space, {"batch_size": 249})] == ["batch_size"]
    assert [e.knob for e in range_edges(space, {"batch_size": 200})] == ["batch_size"]
    assert range_edges(space, {"batch_size": 181}) == []


# Qwen2-7B's KV cache per token at bf16: K and V x 28 layers x 4 KV heads x 128 dims x 2 bytes
# (../shared/reference: the model's shape).
QWEN2_7B_KV_BYTES_PER_TOKEN = 2 * 28 * 4 * 128 * 2


def _ceiling(hardware: str, scenario_name: str, space: SearchSpace | None = None):
    scenario = load_scenario(scenario_name)
    space = space or SearchSpace.load("mindie").fit_workload(scenario.workload)
    return SimRunner(hardware=hardware).batch_ceiling(space, scenario.workload)


def test_the_simulators_batch_ceiling_is_what_memory_holds():
    """customer-service's typical request holds 512 + 128 = 640 tokens. The ceiling must fit
    the 910B2's 64 GB (at the frugalest KV: w4a16 weights, half the KV kept) and go well past
    the preset's 256, which the issue found the best configs pressed against."""
    ceiling, why = _ceiling("ascend-910b2", "customer-service")
    assert ceiling > 256
    assert ceiling * 640 * QWEN2_7B_KV_BYTES_PER_TOKEN * 0.5 < 64e9
    assert "640 tokens" in why and "ascend-910b2" in why


def test_less_memory_or_longer_requests_lower_the_ceiling():
    big, _ = _ceiling("ascend-910b2", "customer-service")
    assert _ceiling("ascend-910b4", "customer-service")[0] < big  # 32 GB instead of 64
    assert _ceiling("ascend-910b2", "document-summary")[0] < big  # 2k-token prompts
    assert _ceiling("h200", "customer-service")[0] > big  # 141 GB


def test_bf16_only_holds_fewer_requests_than_a_space_with_4_bit_weights():
    scenario = load_scenario("customer-service")
    space = SearchSpace.load("mindie").fit_workload(scenario.workload)
    bf16 = space.restrict("quantization", ["bf16"], "test").restrict(
        "kv_compression", [1.0], "test"
    )
    assert (
        _ceiling("ascend-910b2", "customer-service", bf16)[0]
        < _ceiling("ascend-910b2", "customer-service", space)[0]
    )


FIXED_BATCH_8 = """knobs:
  batch_size: {value: 8}
  select_batch: {value: prefill-first}
  max_prefill_tokens: {value: 8192}
  quantization: {value: w8a8}
  kv_compression: {value: 1.0}
  max_prefill_batch_size: {value: 8}
  prefix_caching: {value: false}
"""


def test_a_fixed_config_too_slow_for_the_nominal_rate_still_gets_its_capacity(
    tmp_path: Path, scenario_file: Path
):
    """The seed article's batch 8 on customer-service serves well under the nominal 6 req/s:
    one trial (every knob fixed), exit 3 (nothing meets the SLA), and its capacity printed."""
    (tmp_path / "fixed.yaml").write_text(FIXED_BATCH_8)
    db = tmp_path / "s.db"
    result = run_autotune(
        *("--scenario", str(scenario_file), "--space", "fixed.yaml"),
        *("--storage", f"sqlite:///{db}"),
        cwd=tmp_path,
    )
    assert result.returncode == 3, result.stderr
    assert "one trial measures the config" in result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("closest: trial 0 serves"))
    served = float(line.split("serves ")[1].split(" req/s")[0])
    assert 6 / 16 <= served < 6  # found below the nominal rate, above the search's floor
    assert "misses ttft_p99" in line
    study = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{db}")
    assert len(study.trials) == 1


def test_a_best_config_on_the_end_of_a_narrow_batch_range_says_so(
    tmp_path: Path, scenario_file: Path
):
    """Batch sizes 16..64 (the grid walks 16, 32, 48, 64): more slots serve customer-service's
    traffic better here, so the best config presses against 64, and the run says how to widen
    the range."""
    space = FIXED_BATCH_8.replace(
        "\n  batch_size: {value: 8}", "\n  batch_size: {low: 16, high: 64, step: 16}"
    )
    (tmp_path / "narrow.yaml").write_text(space)
    result = run_autotune(
        *("--scenario", str(scenario_file), "--space", "narrow.yaml"),
        *("--sampler", "grid", "--trials", "4", "--storage", f"sqlite:///{tmp_path / 's.db'}"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "batch_size = 64 sits on the high end of its range 16..64" in result.stdout
    # Half the width again (48 / 2 = 24) above 64 is 88; on the range's step of 16: 80.
    assert "{batch_size: {low: 16, high: 80, step: 16}}" in result.stdout


def test_a_ceiling_stays_on_a_stepped_range(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("knobs:\n  batch_size: {low: 16, high: 4096, step: 16}\n")
    space = SearchSpace.load("mindie", path).with_ceiling("batch_size", 2200, "memory")
    assert space.ranges["batch_size"].high == 2192  # 16 + 136 x 16: the last step below 2200


def test_a_narrow_range_widens_by_at_least_one_step():
    """Half of 1..2's width is 0.5: the suggestion still moves the end by one whole batch."""
    space = SearchSpace("mindie", {"batch_size": KnobRange(low=1, high=2)})
    (edge,) = range_edges(space, {"batch_size": 2})
    assert "{batch_size: {low: 1, high: 3}}" in edge.message()


def test_the_prefill_floor_never_widens_below_the_longest_prompt():
    """customer-service's longest prompt is 768 tokens: the preset's 1024 cannot go to 512."""
    scenario = load_scenario("customer-service")
    space = SearchSpace.load("mindie").fit_workload(scenario.workload)
    (edge,) = range_edges(space, {"max_prefill_tokens": 1024})
    assert edge.widened is None
    assert "the longest prompt is 768 tokens" in edge.message()


def test_a_resumed_study_keeps_the_batch_range_its_trials_were_sampled_in():
    """A study from before the ceiling came from memory sampled batch_size in 1..256: resumed,
    it keeps 1..256, or multivariate TPE and GP would drop batch_size from their joint model."""
    study = optuna.create_study()
    study.add_trial(
        optuna.trial.create_trial(
            params={"batch_size": 64},
            distributions={"batch_size": IntDistribution(1, 256, log=True)},
            value=1.0,
        )
    )
    space = SearchSpace.load("mindie").with_ceiling("batch_size", 2200, "memory")
    kept = keep_earlier_batch_range(study, space)
    assert kept.ranges["batch_size"].high == 256
    assert any("kept at 1..256" in note for note in kept.notes)
    assert keep_earlier_batch_range(optuna.create_study(), space) is space  # a new study
