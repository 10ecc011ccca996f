"""A preset's quality SLO in each form a source supplies (`apply: supplied`): benchmark points
from a quality table, KL and top-1 agreement from a runner that measures them. A run applies the
forms its sources supply and says which; one that can supply none is refused before the study.
The expectations are stated from the sources each run has, not from the planning code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from objectives.scenario import Scenario, load_scenario, preset_names
from objectives.userfile import InputError
from search_spaces.space import SearchSpace
from tests.conftest import run_autotune
from tuner.prepare import _make_runner
from tuner.quality_plan import plan_quality

# A Llama-3-8B-shaped config: a model no shipped quality table covers.
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}


def _table_for(name: str) -> dict:
    entry = {"source": "assumed", "note": "a test's figure"}
    return {
        "models": [
            {
                "names": [name],
                "entries": [
                    {"quantization": "bf16", "accuracy_drop": 0.0} | entry,
                    {"quantization": "fp16", "accuracy_drop": 0.0} | entry,
                    {"quantization": "w8a16", "accuracy_drop": 0.5} | entry,
                    {"quantization": "w8a8", "accuracy_drop": 0.8} | entry,
                    {"quantization": "w4a16", "accuracy_drop": 3.0} | entry,
                    {"quantization": "bf16", "kv_compression": 0.5, "accuracy_drop": 0.3} | entry,
                ],
            }
        ]
    }


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "llama3-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B))
    return folder


def _plan(scenario: str | Path, runner_name: str = "sim", quality: Path | None = None, **options):
    chosen = load_scenario(str(scenario))
    runner = _make_runner(
        runner_name,
        engine="mindie",
        model=options.pop("model", None),
        hardware=None,
        engine_cmd=None,
        runner_config=options.pop("runner_config", None),
        chips=1,
    )
    space = runner.adapt(SearchSpace.load(runner.engine, None).fit_workload(chosen.workload, "s"))
    return plan_quality(chosen, f"--scenario {scenario}", runner, space, quality, None)


def test_every_preset_states_its_slo_in_each_form():
    for name in preset_names():
        slo = load_scenario(name).quality
        assert slo is not None and slo.apply == "supplied", name
        assert set(slo.bounds()) == {"accuracy_drop", "kl", "top1_agreement"}, name


def test_on_the_simulator_the_shipped_table_supplies_points_only():
    """Qwen2-7B on the simulator: the shipped table gives benchmark points and no KL or top-1,
    and the simulator measures nothing, so only the points apply, and the note says why."""
    plan = _plan("customer-service")
    assert plan.scenario.quality is not None
    assert plan.scenario.quality.bounds() == {"accuracy_drop": 2.0}
    (note,) = plan.notes
    assert "applies max_accuracy_drop 2" in note and "not max_kl, min_top1_agreement" in note


def test_another_model_runs_every_preset_on_the_simulator_given_a_table(tmp_path, llama_dir):
    table = tmp_path / "quality.yaml"
    table.write_text(yaml.safe_dump(_table_for("llama3-8b")))
    for name in preset_names():
        plan = _plan(name, quality=table, model=str(llama_dir))
        expected = load_scenario(name).quality.max_accuracy_drop
        assert plan.scenario.quality.bounds() == {"accuracy_drop": expected}, name


def test_a_run_that_can_supply_no_form_exits_2_before_the_study_naming_the_ways_out(
    tmp_path, llama_dir
):
    result = run_autotune(
        "--scenario", "customer-service", "--model", str(llama_dir), "--trials", "2",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1
    for way_out in ("--quality FILE", "--runner vllm or llamacpp", "`quality: none`"):
        assert way_out in message
    assert "llama3-8b" in message
    assert not (tmp_path / "studies.db").exists()


def test_quality_none_in_a_copied_preset_runs_unconstrained(tmp_path, llama_dir):
    data = load_scenario("customer-service").model_dump(mode="json")
    data["quality"] = "none"
    data["workload"]["num_requests"] = 200
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(data))
    assert Scenario.model_validate(data).quality is None
    result = run_autotune(
        "--scenario", "mine.yaml", "--model", str(llama_dir), "--trials", "2", "--polish", "0",
        "--no-html", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode in (0, 3), result.stderr  # it ran: no quality refusal
    assert "quality" not in result.stderr.split("study ")[0]


def test_a_scenario_of_your_own_keeps_every_bound_it_sets(tmp_path):
    """`apply: all` (the default): a bound no source supplies refuses the run, as before."""
    data = load_scenario("customer-service").model_dump(mode="json")
    data["quality"] = {"max_accuracy_drop": 2.0, "max_kl": 0.05}
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(InputError, match=r"quality\.max_kl: the sim runner measures no quality"):
        _plan(tmp_path / "mine.yaml")


def test_an_openai_server_already_running_measures_nothing_so_a_kl_bound_exits_2(
    tmp_path, tiny_model
):
    """The openai runner on `base_url` cannot start the reference config: a KL bound is refused
    before the study, not found unanswerable after it (every trial infeasible, exit 3)."""
    (tmp_path / "runner.yaml").write_text(
        yaml.safe_dump({"base_url": "http://127.0.0.1:9", "model": str(tiny_model)})
    )
    data = load_scenario("customer-service").model_dump(mode="json")
    data["quality"] = {"max_kl": 0.05}
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(InputError, match=r"max_kl: the openai runner cannot start the reference"):
        _plan(tmp_path / "mine.yaml", "openai", runner_config=tmp_path / "runner.yaml")
    # a preset on it, with no table for the tiny model: no form can be supplied
    with pytest.raises(InputError, match="can supply none of its figures"):
        _plan("customer-service", "openai", runner_config=tmp_path / "runner.yaml")


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_every_preset_runs_on_a_real_runner_with_the_tiny_model(
    engine, request, tiny_model, tmp_path, gguf_cache
):
    """On vllm-cpu and llama-server, which measure KL and top-1, every preset applies those two
    (no table covers the tiny model) and is planned unchanged."""
    from testing.engines import llama_settings, vllm_settings

    if engine == "vllm":
        settings = vllm_settings(request.getfixturevalue("vllm_python"), tiny_model, tmp_path)
    else:
        server = request.getfixturevalue("llama_server")
        settings = llama_settings(server, tiny_model, tmp_path, gguf_cache)
    (tmp_path / "runner.yaml").write_text(yaml.safe_dump(settings))
    for name in preset_names():
        plan = _plan(name, engine, runner_config=tmp_path / "runner.yaml")
        preset = load_scenario(name).quality
        assert plan.scenario.quality.bounds() == {
            "kl": preset.max_kl,
            "top1_agreement": preset.min_top1_agreement,
        }, name
        assert "measured by the runner" in plan.notes[0]
        assert plan.prompts, "a measuring runner reads the evaluation prompts"
