"""End to end: a real short study into a temporary SQLite file, then the tables and the YAML."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import optuna
import yaml

from objectives.scoring import is_feasible
from search_spaces.knobs import render
from tests.conftest import run_autotune, small_scenario
from tuner.export import load_export

STUDY = "small-cs.sim.mindie.qwen2-7b.ascend-910b2"


def test_study_writes_db_front_and_export(tmp_path: Path, scenario_file: Path):
    db = tmp_path / "s.db"
    result = run_autotune(
        "--scenario",
        str(scenario_file),
        "--polish",
        "0",
        "--trials",
        "8",
        "--storage",
        f"sqlite:///{db}",
        "--export",
        "out.yaml",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "Pareto front" in result.stdout
    assert "trial 8/8" in result.stderr

    study = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{db}")
    trials = study.trials
    assert len(trials) == 8
    done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    for t in done:
        for key in (
            "ttft_p50_ms",
            "ttft_p90_ms",
            "ttft_p99_ms",
            "tpot_p50_ms",
            "tpot_p99_ms",
            "output_tokens_per_s",
            "total_tokens_per_s",
            "requests_per_s",
            "goodput_rps",
            "success_rate",
            "peak_kv_usage",
            "ttft_samples",
            "tpot_samples",
        ):
            assert key in t.user_attrs, key
        # The nominal load runs whole, in windows of the scenario's 200 requests that double
        # until one settles (runners.load.capacity); a window's first tenth is warm-up, no sample.
        sent = t.user_attrs["requests_sent"]
        assert sent == 200 * 2 ** (t.user_attrs["windows"] - 1)
        assert t.user_attrs["ttft_samples"] == sent - sent // 10
        assert t.values[0] == t.user_attrs["ttft_p99_ms"]
        # Capacity mode (the presets' default): throughput is what the config sustains within the
        # SLA.
        assert t.values[1] == t.user_attrs["capacity_output_tokens_per_s"]
        steps = t.user_attrs["capacity_steps"]
        assert steps[0]["rate"] == 6.0 and steps[0]["ttft_p99_ms"] == t.user_attrs["ttft_p99_ms"]
        good = [s["rate"] for s in steps if s["meets_sla"]]
        assert t.user_attrs["capacity_rate"] == (max(good) if good else None)
        if good:
            bad = [s["rate"] for s in steps if not s["meets_sla"] and s["rate"] > max(good)]
            assert not bad or min(bad) <= max(good) * 1.05 + 1e-9  # bisected to the 5% precision
        named = t.user_attrs["sla_constraints"]
        assert {"ttft_p99", "success_rate"} <= set(named)
        assert named["ttft_p99"] == t.user_attrs["ttft_p99_ms"] / 500 - 1
        assert (
            named["success_rate"] == 1.0 - t.user_attrs["success_rate"]
        )  # unset: every request must succeed
        assert t.user_attrs["status"] == (
            "feasible" if is_feasible(t.constraints) else "violates-sla"
        )
    for t in trials:
        if t.state == optuna.trial.TrialState.FAIL:
            assert t.user_attrs["fault"]

    con = sqlite3.connect(db)
    snapshots = con.execute(
        "select id, trials_total, trials_feasible, best_trial from autotune_pareto_snapshots"
    ).fetchall()
    assert len(snapshots) == 1
    snap_id, total, feasible, best = snapshots[0]
    assert total == 8
    assert feasible == sum(1 for t in done if is_feasible(t.constraints))
    members = con.execute(
        "select trial_number, ttft_p99_ms, output_tokens_per_s from autotune_pareto_members "
        "where snapshot_id = ?",
        (snap_id,),
    ).fetchall()
    feasible_trials = [t for t in done if is_feasible(t.constraints)]
    # The front: every member is feasible and no feasible trial dominates it.
    for number, ttft, tput in members:
        assert any(t.number == number for t in feasible_trials)
        assert not any(
            t.values[0] <= ttft
            and t.values[1] >= tput
            and (t.values[0], t.values[1]) != (ttft, tput)
            for t in feasible_trials
        )

    exported = load_export(tmp_path / "out.yaml")
    assert exported.trial == best
    chosen = study.trials[best]
    assert exported.knobs == chosen.user_attrs["knobs"]
    sampled = {**study.user_attrs["fixed_knobs"], **chosen.params}
    # MindIE's bound: a sampled prefill batch above the batch size runs as the batch size.
    assert exported.knobs == sampled | {
        "max_prefill_batch_size": min(sampled["max_prefill_batch_size"], sampled["batch_size"])
    }
    assert exported.metrics["ttft_p99_ms"] == chosen.user_attrs["ttft_p99_ms"]
    # the capacity the hold held (its worst draw's figures: tuner.answer), else the search's
    hold = exported.hold
    if hold is not None and hold["held_rate"] is not None:
        held = next(load for load in hold["loads"] if load["rate"] == hold["held_rate"])
        assert exported.capacity["rate"] == hold["held_rate"]
        assert exported.capacity["requests_per_s"] == held["served_rps"]
    else:
        assert exported.capacity["requests_per_s"] == chosen.user_attrs["capacity_rps"]
    if exported.capacity["rate"] == chosen.user_attrs["capacity_rate"]:  # not lowered
        assert exported.capacity["output_tokens_per_s"] == chosen.values[1] > 0
    assert (
        exported.native["mindie"]["config_json"]["BackendConfig"]["ScheduleConfig"]["maxBatchSize"]
        == chosen.params["batch_size"]
    )
    mindie = exported.native["mindie"]["config_json"]["BackendConfig"]
    assert mindie["ScheduleConfig"] == render("mindie", exported.knobs)["config"]["ScheduleConfig"]
    # MindIE is started with its sequence and input limits sized to the scenario's longest request.
    workload = small_scenario().workload
    # Its system prompt searches MindIE's prefix-cache plugin, named in ModelConfig: the
    # plugin's type turns it on, an empty string off (MindIE-LLM's prefix_cache.md).
    plugin = '{"plugin_type":"prefix_cache"}' if exported.knobs["prefix_caching"] else ""
    assert mindie["ModelDeployConfig"] == {
        "maxSeqLen": workload.input_tokens.bounds[1] + workload.output_tokens.bounds[1],
        "maxInputTokenLen": workload.input_tokens.bounds[1],
        "ModelConfig": [{"plugin_params": plugin}],
    }
    assert (
        exported.study == STUDY and exported.runner == "sim" and exported.hardware == "ascend-910b2"
    )
    assert exported.sla["ttft_p99_ms"] == 500

    # Same study name again: resumes and adds trials, and a second snapshot is kept.
    again = run_autotune(
        "--scenario",
        str(scenario_file),
        "--polish",
        "0",
        "--trials",
        "3",
        "--storage",
        f"sqlite:///{db}",
        "--export",
        "out.yaml",
        "--sampler",
        "random",
        cwd=tmp_path,
    )
    assert again.returncode == 0, again.stderr
    assert len(optuna.load_study(study_name=STUDY, storage=f"sqlite:///{db}").trials) == 11
    assert con.execute("select count(*) from autotune_pareto_snapshots").fetchone()[0] == 2

    shown = run_autotune("pareto", "--json", "--storage", f"sqlite:///{db}", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    front = json.loads(shown.stdout)
    assert front["trials_total"] == 11
    assert all(row["ttft_p99_ms"] <= 500 for row in front["front"])

    one = front["front"][0]["trial"]
    exported_one = run_autotune(
        "export",
        "--trial",
        str(one),
        "--export",
        "one.yaml",
        "--storage",
        f"sqlite:///{db}",
        cwd=tmp_path,
    )
    assert exported_one.returncode == 0, exported_one.stderr
    assert load_export(tmp_path / "one.yaml").trial == one


def test_baseline_is_rerun_as_first_trial(tmp_path: Path, scenario_file: Path):
    db = f"sqlite:///{tmp_path / 'b.db'}"
    (tmp_path / "good.yaml").write_text(
        "knobs:\n  batch_size: {value: 128}\n  quantization: {value: w8a8}\n"
    )
    first = run_autotune(
        "--scenario",
        str(scenario_file),
        "--polish",
        "0",
        "--trials",
        "4",
        "--storage",
        db,
        "--study",
        "a",
        "--space",
        "good.yaml",
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr
    baseline = load_export(tmp_path / "best-config.yaml")
    second = run_autotune(
        "--scenario",
        str(scenario_file),
        "--polish",
        "0",
        "--trials",
        "2",
        "--storage",
        db,
        "--study",
        "b",
        "--baseline",
        "best-config.yaml",
        "--export",
        "b.yaml",
        cwd=tmp_path,
    )
    assert second.returncode == 0, second.stderr
    trial0 = optuna.load_study(study_name="b", storage=db).trials[0]
    assert {k: baseline.knobs[k] for k in trial0.params} == trial0.params
    # The simulator is deterministic: the re-run measures exactly what the original did.
    assert trial0.user_attrs["ttft_p99_ms"] == baseline.metrics["ttft_p99_ms"]


def test_default_run_uses_studies_db_in_cwd(tmp_path: Path, scenario_file: Path):
    result = run_autotune("--scenario", str(scenario_file), "--trials", "3", cwd=tmp_path)
    assert result.returncode in (0, 3), result.stderr
    assert (tmp_path / "studies.db").is_file()
    if result.returncode == 0:
        assert yaml.safe_load((tmp_path / "best-config.yaml").read_text())["scenario"] == "small-cs"


def test_scenarios_lists_presets(tmp_path: Path):
    result = run_autotune("scenarios", cwd=tmp_path)
    assert result.returncode == 0
    for name in (
        "customer-service",
        "realtime-chat",
        "code-completion",
        "content-generation",
        "document-summary",
        "code-generation",
        "customer-service-burst",
        "multi-turn-chat",
    ):
        assert name in result.stdout


def test_a_trial_keeps_the_knobs_it_ran_with_across_runs(tmp_path: Path, scenario_file: Path):
    """Each run may hold other knobs fixed: a trial's export uses the knobs it ran with."""
    (tmp_path / "fixed.yaml").write_text(
        "knobs:\n  quantization: {value: w8a8}\n  kv_compression: {value: 0.5}\n"
    )
    db = f"sqlite:///{tmp_path / 'k.db'}"
    first = run_autotune(
        "--scenario",
        str(scenario_file),
        "--polish",
        "0",
        "--trials",
        "2",
        "--storage",
        db,
        "--study",
        "k",
        "--space",
        "fixed.yaml",
        cwd=tmp_path,
    )
    assert first.returncode in (0, 3), first.stderr
    second = run_autotune(
        "--scenario",
        str(scenario_file),
        "--polish",
        "0",
        "--trials",
        "2",
        "--storage",
        db,
        "--study",
        "k",
        "--sampler",
        "random",
        "--seed",
        "3",
        cwd=tmp_path,
    )
    assert second.returncode in (0, 3), second.stderr
    study = optuna.load_study(study_name="k", storage=db)
    assert "quantization" in study.trials[2].params  # sampled in the second run
    exported = run_autotune(
        "export",
        "--trial",
        "0",
        "--export",
        "t0.yaml",
        "--storage",
        db,
        "--study",
        "k",
        cwd=tmp_path,
    )
    assert exported.returncode == 0, (
        exported.stderr
    )  # w8a8 on 64 GB always runs: trial 0 is COMPLETE
    knobs = load_export(tmp_path / "t0.yaml").knobs
    assert knobs["quantization"] == "w8a8" and knobs["kv_compression"] == 0.5
