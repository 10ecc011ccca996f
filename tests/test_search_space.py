from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from objectives.userfile import InputError
from search_spaces.knobs import KNOBS, render
from search_spaces.space import SearchSpace
from tests.conftest import small_scenario


def test_presets_load_and_vllm_drops_mindie_only_knobs(tmp_path: Path):
    mindie = SearchSpace.load("mindie")
    assert set(mindie.ranges) >= {
        "batch_size",
        "select_batch",
        "max_prefill_tokens",
        "quantization",
        "kv_compression",
    }
    space_file = tmp_path / "s.yaml"
    space_file.write_text("knobs:\n  max_prefill_batch_size: {low: 1, high: 8}\n")
    vllm = SearchSpace.load("vllm", space_file)
    assert "max_prefill_batch_size" not in vllm.ranges
    assert any("max_prefill_batch_size" in note for note in vllm.notes)


def test_user_file_narrows_and_fixes(tmp_path: Path):
    space_file = tmp_path / "s.yaml"
    space_file.write_text(
        "knobs:\n  batch_size: {low: 8, high: 16}\n  quantization: {value: w8a8}\n"
    )
    space = SearchSpace.load("mindie", space_file)
    study = optuna.create_study(
        directions=["minimize", "maximize"], sampler=optuna.samplers.RandomSampler(seed=1)
    )
    for _ in range(20):
        config = space.suggest(study.ask())
        assert 8 <= config["batch_size"] <= 16 and config["quantization"] == "w8a8"
        assert config["max_prefill_batch_size"] <= config["batch_size"]


def test_fit_workload_raises_prefill_floor():
    sc = small_scenario("document-summary")
    space = SearchSpace.load("mindie").fit_workload(sc.workload)
    assert space.ranges["max_prefill_tokens"].low == 3072
    assert space.violations({"max_prefill_tokens": 2048}, sc.workload)


def test_grid_is_finite_and_inside_ranges():
    grid = SearchSpace.load("mindie").grid()
    assert grid["batch_size"][0] == 1 and grid["batch_size"][-1] == 256
    assert grid["kv_compression"] == [1.0, 0.5]  # MindIE's two KV states, nothing in between
    assert all(1024 <= v <= 16384 and (v - 1024) % 512 == 0 for v in grid["max_prefill_tokens"])


def test_rendering_to_engines():
    config = {
        "batch_size": 16,
        "select_batch": "decode-first",
        "max_prefill_tokens": 4096,
        "quantization": "w8a8",
        "kv_compression": 0.5,
        "max_prefill_batch_size": 4,
    }
    mindie = render("mindie", config)
    assert mindie["config"]["ScheduleConfig"] == {
        "maxBatchSize": 16,
        "supportSelectBatch": True,
        "maxPrefillTokens": 4096,
        "maxPrefillBatchSize": 4,
    }
    assert mindie["weights"] == "w8a8"
    assert mindie["env"] == {"ATB_LLM_RAZOR_ATTENTION_ENABLE": "1"} and "kv_ratio" not in mindie
    assert "env" not in render("mindie", config | {"kv_compression": 1.0})
    with pytest.raises(ValueError):
        render("mindie", {"kv_compression": 0.75})
    args = render("vllm", config)["args"]
    assert args[args.index("--max-num-seqs") + 1] == "16"
    assert args[args.index("--max-num-batched-tokens") + 1] == "4096"
    assert "--enable-chunked-prefill" in args and args[args.index("--kv-cache-dtype") + 1] == "fp8"
    with pytest.raises(ValueError):
        render("vllm", {"kv_compression": 0.7})
    assert all(k.render for k in KNOBS.values())


def test_reversed_range_is_rejected(tmp_path: Path):
    space_file = tmp_path / "s.yaml"
    space_file.write_text("knobs:\n  max_prefill_tokens: {low: 4096, high: 1024}\n")
    with pytest.raises(InputError, match="reversed"):
        SearchSpace.load("mindie", space_file)


def test_prefill_batch_runs_within_the_batch_size_in_a_static_space():
    """Sampled in its full range (a static space multivariate TPE can model), run as at most
    the batch size (MindIE's maxPrefillBatchSize <= maxBatchSize)."""
    space = SearchSpace.load("mindie")
    study = optuna.create_study(
        directions=["minimize", "maximize"], sampler=optuna.samplers.RandomSampler(seed=1)
    )
    clamped, proposals = 0, []
    for _ in range(40):
        trial = study.ask()
        config = space.suggest(trial)
        assert (
            trial.distributions["max_prefill_batch_size"].high == 64
        )  # never narrowed by the batch size
        assert config["max_prefill_batch_size"] == min(
            trial.params["max_prefill_batch_size"], config["batch_size"]
        )
        clamped += trial.params["max_prefill_batch_size"] > config["batch_size"]
        proposals.append((trial.params["batch_size"], trial.params["max_prefill_batch_size"]))
        assert not space.violations(config, small_scenario().workload)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
    assert clamped > 0
    # The sampler's proposals reach both ends of 1..64 whatever the batch size: even with a
    # small batch a large prefill batch is proposed (then run as the batch size).
    prefill = [p for _, p in proposals]
    assert min(prefill) <= 2 and max(prefill) >= 32
    assert any(batch < 8 and p >= 32 for batch, p in proposals)
