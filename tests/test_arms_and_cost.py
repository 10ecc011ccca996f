"""Comparisons searched on both sides (issue 28, item 3), ties collapsed in the front, and the
answer in money (item 7): a real study on the simulator through the command line."""

from __future__ import annotations

from pathlib import Path

import optuna
import yaml

from runners.quality import quality_pair
from tests.conftest import run_autotune
from tuner.one_chip import seed_co_located
from tuner.prepare import prepare
from tuner.study import MIN_ARM_TRIALS, ONE_CHIP_TRIALS, StudyRun
from tuner.trials import optimize


def _study(tmp_path: Path) -> optuna.Study:
    (name,) = optuna.get_all_study_names(f"sqlite:///{tmp_path / 'studies.db'}")
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 'studies.db'}")


def test_every_admitted_pair_is_searched_from_the_best_config(tmp_path: Path, scenario_file):
    """Six trials leave most precision and KV pairs unvisited; the arms' refinement measures
    each admitted pair with the best config's other knobs (a controlled trial) and polishes it,
    so the ladder's every admitted row stands on MIN_ARM_TRIALS trials or more."""
    result = run_autotune(
        "--scenario", str(scenario_file), "--trials", "66", "--polish", "60", "--no-html",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    study = _study(tmp_path)
    pairs = {quality_pair(t.params) for t in study.trials}
    excluded = {quality_pair(p) for p in study.user_attrs.get("quality_excluded", [])}
    admitted = {(q, kv) for q in ("bf16", "w8a16", "w8a8") for kv in (1.0, 0.5)} - excluded
    assert admitted <= pairs
    for pair in admitted:
        n = sum(1 for t in study.trials if quality_pair(t.params) == pair)
        assert n >= MIN_ARM_TRIALS, (pair, n)
    assert "not compared" not in result.stdout


def test_a_pair_searched_too_little_is_not_compared(tmp_path: Path, scenario_file):
    result = run_autotune(
        "--scenario", str(scenario_file), "--trials", "3", "--polish", "0", "--no-html",
        "--sampler", "random", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode in (0, 3), result.stderr
    assert "not compared (1 trial)" in result.stdout or "not compared (2 trials)" in result.stdout


def test_the_cost_per_million_tokens_follows_the_price(tmp_path: Path, scenario_file):
    """A chip at 3 per hour serving T output tokens/s costs 3 / (T * 3600) per token."""
    result = run_autotune(
        "--scenario", str(scenario_file), "--trials", "4", "--polish", "0", "--no-html",
        "--chip-cost-per-hour", "3", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    exported = yaml.safe_load((tmp_path / "best-config.yaml").read_text())
    tokens_per_s = exported["capacity"]["output_tokens_per_s"]
    assert exported["cost"]["chip_per_hour"] == 3
    assert abs(exported["cost"]["per_million_output_tokens"] - 3e6 / (tokens_per_s * 3600)) < 1e-9
    assert "M out tok @3/h" in result.stdout


def test_a_bad_price_is_refused(tmp_path: Path, scenario_file):
    for price in ("0", "-1", "nan", "lots"):
        result = run_autotune(
            "--scenario", str(scenario_file), "--chip-cost-per-hour", price, cwd=tmp_path
        )
        assert result.returncode == 2
        assert "--chip-cost-per-hour" in result.stderr
    assert not (tmp_path / "studies.db").exists()


def test_the_front_collapses_ties(tmp_path: Path, scenario_file):
    """Polish measures neighbours that change knobs of no consequence (a prefill batch bound
    never reached): they read the same, and the front shows one row with the rest named."""
    result = run_autotune(
        "--scenario", str(scenario_file), "--trials", "110", "--polish", "100", "--no-html",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    study = _study(tmp_path)
    front = result.stdout.split("Pareto front", 1)[1].split("└", 1)[0]
    rows = [line for line in front.splitlines() if line.startswith("│")]
    exported = yaml.safe_load((tmp_path / "best-config.yaml").read_text())
    shown = {  # the starred row shows the answer's throughput (tuner.answer)
        t.number: exported["capacity"]["output_tokens_per_s"]
        if t.number == exported["trial"]
        else t.values[1]
        for t in study.best_trials
    }
    alike = {(f"{t.values[0]:.1f}", f"{shown[t.number]:.0f}") for t in study.best_trials}
    assert len(rows) == len(alike)
    # the polish's neighbours that change a knob of no consequence: ties there are
    assert len(study.best_trials) > len(alike), "no alike trials: the test proves nothing"
    assert "alike (the same TTFT p99 and throughput as shown): trial" in result.stdout


def test_a_chip_budget_study_starts_co_located_from_the_one_chip_study(
    tmp_path: Path, scenario_file
):
    """A one-chip study of the scenario first; the 4-chip study of the same scenario in the
    same storage then measures the one-chip study's best configs first, as co-located trials
    (on N chips a co-located config runs one chip's config N times). The one-chip study's
    trials count as co-located ones, so the trials after the seeds are disaggregated until that
    side has as many as the co-located side (seeds plus the one-chip study's trials), and no
    config is measured twice (each proposal's side sampler is seeded afresh: seeded alike, the
    first twenty trials ran two configs)."""
    db = f"sqlite:///{tmp_path / 'studies.db'}"
    common = ("--scenario", str(scenario_file), "--polish", "0", "--no-html", "--storage", db)
    one = run_autotune(*common, "--trials", "8", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    (one_chip_name,) = optuna.get_all_study_names(db)
    one_chip = optuna.load_study(study_name=one_chip_name, storage=db)
    feasible = [t for t in one_chip.trials if t.user_attrs.get("status") == "feasible"]
    most = max(t.values[1] for t in feasible)  # max-throughput: the most tokens/s

    four = run_autotune(*common, "--trials", "16", "--chips", "4", cwd=tmp_path)
    assert four.returncode in (0, 3), four.stderr
    assert f"co-located starts from study {one_chip_name} (one chip)" in four.stderr
    (name,) = set(optuna.get_all_study_names(db)) - {one_chip_name}
    study = optuna.load_study(study_name=name, storage=db)
    first = study.trials[0]
    source, number = first.user_attrs["seeded_from"].split("#")
    best = one_chip.trials[int(number)]
    assert source == one_chip_name and best in feasible
    assert best.values[1] >= 0.99 * most  # the best, or tied with it within the tolerance
    assert first.user_attrs["knobs"]["deployment"] == "co-located"
    for knob, value in best.user_attrs["knobs"].items():
        assert first.user_attrs["knobs"][knob] == value
    runs = [yaml.safe_dump(t.user_attrs["knobs"]) for t in study.trials[:16]]
    assert len(set(runs)) == len(runs)
    searched_on_one_chip = len(one_chip.get_trials(states=(optuna.trial.TrialState.COMPLETE,)))
    assert f"its {searched_on_one_chip} trials count as co-located ones" in four.stderr
    seeds = sum(1 for t in study.trials if "seeded_from" in t.user_attrs)
    # the co-located side's count once its seeds ran: the one-chip study's trials, the seeds
    # among them counted once
    catch_up = searched_on_one_chip
    deployments = [t.user_attrs["knobs"]["deployment"] for t in study.trials]
    assert deployments[:seeds] == ["co-located"] * seeds
    assert deployments[seeds : seeds + catch_up] == ["disaggregated"] * catch_up
    assert deployments[seeds + catch_up] == "co-located"  # caught up: the sides take turns


def test_each_deployment_gets_its_three_trials_before_the_one_chip_count_applies(
    tmp_path: Path, scenario_file
):
    """A side needs MIN_ARM_TRIALS measured trials to be compared: with a one-chip study of 50
    trials counted as co-located, the first trials still take turns until each deployment
    has three, and only then go to disaggregated (the side the count leaves short)."""
    prepared = _prepared(tmp_path, scenario_file, chips=2)
    prepared.study.set_user_attr(ONE_CHIP_TRIALS, 50)
    run = StudyRun(
        prepared.study, prepared.scenario, prepared.space, prepared.runner, prepared.storage,
        new_sampler=prepared.new_sampler,
    )  # fmt: skip
    optimize(run, 2 * MIN_ARM_TRIALS + 2, None)
    deployments = [t.params["deployment"] for t in prepared.study.trials]
    turns = ["co-located", "disaggregated"] * MIN_ARM_TRIALS
    assert deployments == [*turns, "disaggregated", "disaggregated"]


def _prepared(tmp_path: Path, scenario_file: Path, chips: int):
    """The study as the command line prepares it, on the simulator, nothing run."""
    return prepare(
        scenario=str(scenario_file),
        runner_name="sim",
        engine="mindie",
        model=None,
        hardware=None,
        engine_cmd=None,
        runner_config=None,
        space_path=None,
        trials=2,
        seed=0,
        sampler="auto",
        storage=f"sqlite:///{tmp_path / 'studies.db'}",
        study_name=None,
        baseline_path=None,
        heartbeat_s=60,
        outputs={},
        chips=chips,
    )


def test_without_a_one_chip_study_the_run_says_how_to_seed_one(tmp_path: Path, scenario_file):
    """What a real engine's run says (on the simulator the run searches one chip first): the
    study is prepared as the command line does, and nothing is queued."""
    prepared = _prepared(tmp_path, scenario_file, chips=2)
    note, queued = seed_co_located(prepared, limit=50)
    assert queued == 0 and not prepared.study.trials
    assert note is not None and "no one-chip study of this scenario in the storage" in note


def test_on_the_simulator_one_chip_is_searched_first(tmp_path: Path, scenario_file):
    result = run_autotune(
        "--scenario", str(scenario_file), "--trials", "4", "--polish", "0", "--no-html",
        "--chips", "2", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode in (0, 3), result.stderr
    assert "one chip's study first" in result.stderr
    assert "co-located starts from study" in result.stderr
    names = optuna.get_all_study_names(f"sqlite:///{tmp_path / 'studies.db'}")
    assert len(names) == 2 and sum(name.endswith(".2chips") for name in names) == 1


def test_the_largest_seed_still_proposes(tmp_path: Path, scenario_file):
    """Side samplers are seeded by the run's seed plus the study's size: at --seed 2**32 - 1
    the sum must wrap, not break numpy's seed range."""
    result = run_autotune(
        "--scenario", str(scenario_file), "--trials", "3", "--polish", "0", "--no-html",
        "--chips", "2", "--seed", str(2**32 - 1), cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode in (0, 3), result.stderr
    assert "Traceback" not in result.stderr
    names = optuna.get_all_study_names(f"sqlite:///{tmp_path / 'studies.db'}")
    chips = next(n for n in names if n.endswith(".2chips"))
    study = optuna.load_study(study_name=chips, storage=f"sqlite:///{tmp_path / 'studies.db'}")
    assert len(study.trials) >= 3
