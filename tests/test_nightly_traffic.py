"""A night fed the latest traffic (`autotune nightly --trace`): the drift rule on planted figures,
the figures of a load against hand counts, and real nights on real SQLite files: the same traffic
runs the night as before, twice its rate re-tunes on it and says why, bad logs are refused."""

from __future__ import annotations

import json
import sqlite3
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
import yaml

from objectives.scenario import Scenario, load_scenario
from objectives.userfile import InputError
from runners.load.workload import Requests, make_requests
from tests.conftest import run_autotune
from tests.test_nightly import _nightly as nightly
from tuner.nightly import EXIT_PROMOTED, EXIT_UNCHANGED
from tuner.nightly_traffic import Traffic, compare, drifted, tonights_scenario, traffic_of

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE = ROOT / "tests" / "data" / "mooncake-fast25-synthetic.jsonl.gz"


def _traffic(**changed) -> Traffic:
    base = {
        "requests": 1000,
        "rate": 5.0,
        "burstiness": 1.0,
        "input_mean": 1000.0,
        "output_mean": 200.0,
        "input_tokens": (900.0, 4000.0),
        "output_tokens": (150.0, 600.0),
        "prefix_share": 0.30,
    }
    return Traffic(**(base | changed))


def _moved(before: Traffic, after: Traffic) -> dict[str, float]:
    return {c.figure: round(c.change, 4) for c in drifted(compare(before, after))}


def test_the_same_traffic_has_not_drifted_and_each_figure_past_its_threshold_has():
    assert _moved(_traffic(), _traffic()) == {}
    assert _moved(_traffic(), _traffic(rate=10.0)) == {"rate": 1.0}
    assert _moved(_traffic(), _traffic(rate=5.9)) == {}  # +18%: within 20%
    assert _moved(_traffic(), _traffic(burstiness=1.3)) == {"burstiness": 0.3}
    assert _moved(_traffic(), _traffic(input_mean=1250.0)) == {"input mean": 0.25}
    assert _moved(_traffic(), _traffic(output_tokens=(150.0, 900.0))) == {"output p99": 0.5}
    # the prefix share moves in points: 0.30 -> 0.45 is 15 points, past 10; 0.30 -> 0.38 is not
    assert _moved(_traffic(), _traffic(prefix_share=0.45)) == {"prefix share": 0.15}
    assert _moved(_traffic(), _traffic(prefix_share=0.38)) == {}


def test_a_closed_loop_has_no_rate_to_compare():
    figures = {c.figure for c in compare(_traffic(rate=None, burstiness=None), _traffic())}
    assert "rate" not in figures and "burstiness" not in figures
    assert {"input mean", "output p99", "prefix share"} <= figures


def test_traffic_of_a_load_against_hand_counts():
    # 5 requests 1 s apart (span 4 s + one mean gap: 1 req/s), even gaps (CV 0); prompts 100,
    # 200, 300, 400, 500 of which the second and fourth open with a 50-token shared prefix.
    requests = Requests(
        np.array([100, 200, 300, 400, 500]),
        np.array([10, 10, 10, 10, 10]),
        np.arange(5, dtype=np.float64),
        None,
        np.array([-1, 0, -1, 0, -1]),
        50,
    )
    figures = traffic_of(requests)
    assert figures.rate == pytest.approx(1.0) and figures.burstiness == pytest.approx(0.0)
    assert figures.input_mean == 300 and figures.input_tokens[0] == 300
    assert figures.prefix_share == pytest.approx(100 / 1500)


def _trace_study_scenario(folder: Path, log: Path) -> Path:
    data = yaml.safe_load((ROOT / "objectives/presets/customer-service.yaml").read_text())
    scenario = {k: v for k, v in data.items() if k not in ("workload", "load")}
    scenario["name"] = "svc"
    scenario["workload"] = {"trace": {"file": log.name, "format": "azure"}}
    path = folder / "svc.yaml"
    path.write_text(yaml.safe_dump(scenario))
    return path


def _azure_log(path: Path, rate_multiple: float = 1.0, requests: int = 600) -> Path:
    """A service's hour in the Azure format: Poisson arrivals at 4 req/s (times the multiple),
    lognormal prompts and answers; the same draw for every multiple, so only the rate differs."""
    rng = np.random.default_rng(3)
    at = np.cumsum(rng.exponential(0.25, requests)) / rate_multiple
    inputs = np.clip(rng.lognormal(np.log(300), 0.6, requests).astype(int), 4, 2000)
    outputs = np.clip(rng.lognormal(np.log(80), 0.5, requests).astype(int), 2, 400)
    start = datetime(2023, 11, 16, 18, 0, 0)
    rows = [
        f"{(start + timedelta(seconds=float(t))).isoformat(' ')},{i},{o}\n"
        for t, i, o in zip(at, inputs, outputs, strict=True)
    ]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(rows))
    return path


def test_tonights_scenario_reads_the_log_as_the_studys_trace_and_refuses_another_format(
    tmp_path,
):
    log = _azure_log(tmp_path / "monday.csv")
    study = load_scenario(str(_trace_study_scenario(tmp_path, log)))
    tonight, notes = tonights_scenario(study, _azure_log(tmp_path / "tue.csv", 2.0), None)
    assert notes == []
    assert tonight.workload.trace is not None and tonight.workload.trace.format == "azure"
    assert tonight.workload.arrival.rate == pytest.approx(2 * study.workload.arrival.rate)
    assert tonight.sla == study.sla and tonight.name == study.name
    with pytest.raises(InputError, match=r"^--trace-format: mooncake is not the study's"):
        tonights_scenario(study, log, "mooncake")
    drawn: Scenario = load_scenario("customer-service")
    with pytest.raises(InputError, match=r"^--trace-format: .*draws its traffic"):
        tonights_scenario(drawn, log, None)
    with pytest.raises(InputError, match=r"^--trace-format: csv needs a column map"):
        tonights_scenario(drawn, log, "csv")
    mooncake, _ = tonights_scenario(drawn, MOONCAKE, "mooncake")
    assert traffic_of_share(mooncake) > 0.3  # its prompt blocks repeat (64% of blocks)


def test_tonights_log_is_replayed_whole_not_at_the_study_logs_window(tmp_path):
    """The study replayed seconds 60-120 of Monday's log; tonight's log is another one, read
    from its first request to its last (Monday's offset names no place in it)."""
    log = _azure_log(tmp_path / "monday.csv")  # 600 requests at 4 req/s: about 150 s
    path = _trace_study_scenario(tmp_path, log)
    data = yaml.safe_load(path.read_text())
    data["workload"]["trace"] |= {"start_s": 60.0, "duration_s": 60.0}
    path.write_text(yaml.safe_dump(data))
    study = load_scenario(str(path))
    assert 180 <= study.workload.num_requests <= 300  # 60 s at about 4 req/s
    tonight, _ = tonights_scenario(study, _azure_log(tmp_path / "tue.csv"), None)
    assert tonight.workload.num_requests == 600


def test_a_burst_studys_night_keeps_its_ttft_bound_and_drops_the_drawn_bursts_with_a_note(
    tmp_path,
):
    """customer-service-burst bounds its drawn burst's TTFT; tonight's log brings its own
    arrivals, so that bound has no burst to judge: the night says so and keeps the rest."""
    study = load_scenario("customer-service-burst")
    tonight, notes = tonights_scenario(study, _azure_log(tmp_path / "tue.csv"), "azure")
    assert tonight.workload.burst is None and tonight.sla.burst_ttft_p99_ms is None
    assert tonight.sla.ttft_p99_ms == study.sla.ttft_p99_ms == 500
    assert len(notes) == 1 and "sla.burst_ttft_p99_ms" in notes[0]


def test_absolute_search_bounds_move_with_tonights_rate(tmp_path):
    """A study that searched 2-40 req/s around its 4 req/s searches 16-320 on a log at 8 times
    its rate (absolute bounds stated for one rate would refuse a log beyond them)."""
    log = _azure_log(tmp_path / "monday.csv")
    path = _trace_study_scenario(tmp_path, log)
    data = yaml.safe_load(path.read_text())
    data["load"] = {"min_rate": 2.0, "max_rate": 40.0}
    path.write_text(yaml.safe_dump(data))
    study = load_scenario(str(path))
    tonight, _ = tonights_scenario(study, _azure_log(tmp_path / "tue.csv", 8.0), None)
    moved = tonight.nominal_rate / study.nominal_rate
    assert moved == pytest.approx(8.0)
    assert tonight.load.min_rate == pytest.approx(2.0 * moved)
    assert tonight.load.max_rate == pytest.approx(40.0 * moved)


def _mooncake_log(path: Path, blocks_of) -> Path:
    """Mooncake's format: 200 requests 0.2 s apart, 4 blocks of 512 tokens each."""
    rows = [
        json.dumps(
            {"timestamp": i * 200, "input_length": 2048, "output_length": 16,
             "hash_ids": blocks_of(i)}
        )
        for i in range(200)
    ]  # fmt: skip
    path.write_text("\n".join(rows) + "\n")
    return path


def test_a_log_whose_blocks_never_repeat_shares_nothing_and_one_that_repeats_shares_them(
    tmp_path,
):
    drawn = load_scenario("customer-service")
    unique = _mooncake_log(tmp_path / "u.jsonl", lambda i: [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3])
    tonight, _ = tonights_scenario(drawn, unique, "mooncake")
    assert traffic_of_share(tonight) == 0.0
    # every prompt opens with the same two blocks: half of each prompt's tokens (but the first's)
    shared = _mooncake_log(tmp_path / "s.jsonl", lambda i: [0, 1, 2 + 2 * i, 3 + 2 * i])
    tonight, _ = tonights_scenario(drawn, shared, "mooncake")
    assert traffic_of_share(tonight) == pytest.approx(0.5, abs=0.01)


def test_a_drawn_sessions_history_counts_as_shared_as_a_logs_turns_do():
    """multi-turn-chat's later turns carry their conversation so far: that history is a start
    the turn shares with its session's earlier prompts (a log's turns are counted so)."""
    requests = make_requests(load_scenario("multi-turn-chat").workload)
    assert requests.sessions is not None
    history = requests.input_tokens - requests.sessions.new_tokens
    assert traffic_of(requests).prefix_share == pytest.approx(
        history.sum() / requests.input_tokens.sum()
    )
    assert traffic_of(requests).prefix_share > 0.5  # 5 turns a session on average


def traffic_of_share(scenario: Scenario) -> float:
    return traffic_of(make_requests(scenario.workload)).prefix_share


def _night(work: Path, db: str, log: str, *extra: str):
    return nightly(work, Path("svc.yaml"), db, "--trace", log, *extra)


def _trace_study(work: Path, trials: int) -> str:
    """A study on the service's Monday log (svc.yaml); its storage URL."""
    _azure_log(work / "monday.csv")
    _trace_study_scenario(work, work / "monday.csv")
    db = f"sqlite:///{work / 'n.db'}"
    study = run_autotune(
        "--scenario", "svc.yaml", "--trials", str(trials), "--polish", "0", "--storage", db,
        cwd=work,
    )  # fmt: skip
    assert study.returncode == 0, study.stderr
    return db


def _studies(db_file: Path) -> list[str]:
    return [row[0] for row in sqlite3.connect(db_file).execute("select study_name from studies")]


def test_the_same_traffic_runs_the_night_as_before_and_twice_its_rate_retunes_on_it(tmp_path):
    db = _trace_study(tmp_path, 6)

    same = _night(tmp_path, db, "monday.csv")
    assert same.returncode == EXIT_PROMOTED, same.stderr  # no deployed config yet
    report = (tmp_path / "deployed.nightly.md").read_text()
    assert "Traffic: no drift" in report and "TRAFFIC DRIFT" not in report
    assert "traffic: no drift" in same.stderr
    assert len(_studies(tmp_path / "n.db")) == 1  # the night ran on the study itself

    _azure_log(tmp_path / "tuesday.csv", rate_multiple=2.0)
    busier = _night(tmp_path, db, "tuesday.csv")
    assert busier.returncode in (EXIT_PROMOTED, EXIT_UNCHANGED), busier.stderr
    assert "TRAFFIC DRIFT: rate +100%" in busier.stderr
    report = (tmp_path / "deployed.nightly.md").read_text()
    assert "## TRAFFIC DRIFT: rate +100%" in report
    assert "input mean" in report and "drift**" in report  # the table, the rate marked
    studies = _studies(tmp_path / "n.db")
    traffic_study = next(s for s in studies if ".traffic-" in s)
    assert f"as study `{traffic_study}`" in report
    reason = (
        sqlite3.connect(tmp_path / "n.db")
        .execute("select reason from autotune_nightly_runs order by id desc")
        .fetchone()[0]
    )
    assert reason.startswith("traffic drifted: rate +100%") and traffic_study in reason
    # The re-tune started from the study's front, then ran the night's budget.
    warm = sqlite3.connect(tmp_path / "n.db").execute(
        "select count(*) from trial_user_attributes a join trials t using (trial_id) "
        "join studies s using (study_id) where s.study_name = ? and a.key = 'warm_start'",
        (traffic_study,),
    )
    assert warm.fetchone()[0] >= 1


def test_nightly_trace_bad_input_one_line_exit_2_nothing_written(tmp_path):
    db = _trace_study(tmp_path, 3)
    (tmp_path / "logs").mkdir()
    (tmp_path / "empty.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    rows = (tmp_path / "monday.csv").read_text().splitlines()
    rows[5] = rows[5].rsplit(",", 1)[0] + ",-3"  # a negative answer length
    (tmp_path / "bad-row.csv").write_text("\n".join(rows) + "\n")
    cases = {
        "an empty log": (("empty.csv",), "--trace empty.csv"),
        "a bad row": (("bad-row.csv",), "bad-row.csv"),
        "another format": ((str(MOONCAKE),), "--trace"),
        "a directory": (("logs",), "--trace logs"),
        "a missing file": (("none.csv",), "--trace none.csv"),
        "format differs": (("monday.csv", "--trace-format", "burstgpt"), "--trace-format"),
    }
    before = sorted(p.name for p in tmp_path.iterdir())
    failures = []
    for name, (args, expected) in cases.items():
        result = _night(tmp_path, db, *args)
        lines = result.stderr.strip().splitlines()
        if result.returncode != 2 or len(lines) != 1 or expected not in lines[0]:
            failures.append((name, result.returncode, lines[-3:]))
    assert not failures, failures
    alone = run_autotune(
        "nightly", "--scenario", "svc.yaml", "--storage", db, "--trace-format", "azure",
        cwd=tmp_path,
    )  # fmt: skip
    assert alone.returncode == 2 and "--trace-format" in alone.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    nights = sqlite3.connect(tmp_path / "n.db").execute(
        "select count(*) from sqlite_master where name = 'autotune_nightly_runs'"
    )
    if nights.fetchone()[0]:
        assert (
            sqlite3.connect(tmp_path / "n.db")
            .execute("select count(*) from autotune_nightly_runs")
            .fetchone()[0]
            == 0
        )
