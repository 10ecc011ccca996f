"""The capacity search on a real llama-server: a config that misses the SLA at the nominal rate
is a COMPLETE trial with its constraint values (what the samplers learn from), and its search
goes on below the nominal rate, stopping those steps early."""

from __future__ import annotations

import optuna
import pytest
import yaml

from testing.engines import engine_scenario, llama_settings
from tests.conftest import run_autotune


def test_a_miss_at_the_nominal_rate_is_complete_with_its_constraints(
    llama_server, tiny_model, tmp_path, gguf_cache
):
    data = engine_scenario(requests=12, rate=4.0, ttft_ms=0.5).model_dump(
        mode="json"
    )  # no CPU answers in 0.5 ms
    data["load"] = {"min_rate": 1.0}
    (tmp_path / "scenario.yaml").write_text(yaml.safe_dump(data))
    (tmp_path / "runner.yaml").write_text(
        yaml.safe_dump(llama_settings(llama_server, tiny_model, tmp_path / "logs", gguf_cache))
    )
    (tmp_path / "space.yaml").write_text(
        yaml.safe_dump(
            {
                "knobs": {
                    "batch_size": {"choices": [1, 4]},
                    "max_prefill_tokens": {"value": 256},
                    "quantization": {"value": "bf16"},
                    "kv_compression": {"value": 1.0},
                }
            }
        )
    )
    db = tmp_path / "studies.db"
    done = run_autotune(
        "--scenario",
        "scenario.yaml",
        "--polish",
        "0",
        "--runner",
        "llamacpp",
        "--runner-config",
        "runner.yaml",
        "--space",
        "space.yaml",
        "--sampler",
        "grid",
        "--trials",
        "2",
        "--storage",
        f"sqlite:///{db}",
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 3, done.stderr  # the study ran; no config met the SLA
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{db}")
    trials = study.trials
    assert not study.best_trials  # Optuna itself reads the constraints: no feasible trial
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2, [
        t.user_attrs.get("fault") for t in trials
    ]
    for trial in trials:
        attrs = trial.user_attrs
        assert attrs["status"] == "violates-sla"
        assert attrs["requests_sent"] == 12  # the nominal load ran whole
        assert attrs["sla_constraints"]["ttft_p99"] == pytest.approx(attrs["ttft_p99_ms"] / 0.5 - 1)
        assert attrs["sla_constraints"]["ttft_p99"] > 0
        steps = attrs["capacity_steps"]
        assert [s["rate"] for s in steps] == [4.0, 2.0, 1.0]  # halved down to min_rate
        assert all(s["fault"].startswith("sla-violated") for s in steps[1:])  # stopped early
        assert (
            attrs["capacity_rate"] is None and "lowest rate searched (1)" in attrs["capacity_note"]
        )
