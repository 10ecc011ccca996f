"""One answer in every output (issue 42, item 1): the console's front and answer line, the
export and the report state the same capacity, throughput, fleet and cost, those of the rate
the hold held; the fleet is sized on no more than the config served; a run's hold and repeats
are its own, whatever another run records on the study later (item 3)."""

from __future__ import annotations

import html
import json
import math
import re
from pathlib import Path

import optuna
import yaml

from runners.load.capacity import fleet_for_peak
from tests.conftest import run_autotune, small_scenario
from tuner.answer import answer
from tuner.export import trial_export
from tuner.study import keep_hold, keep_repeats

PRICE = 2.0
PEAK = 200.0


def _front_row(stdout: str) -> list[str]:
    """The starred row's cells and the front's column names, from the console's table."""
    lines = stdout.splitlines()
    (row,) = [line for line in lines if line.startswith("│") and " * │" in line]
    return [cell.strip() for cell in row.split("│")[1:-1]]


def test_console_export_and_report_state_the_same_held_answer(tmp_path: Path):
    """The issue's input: 300 requests, a peak of 200 req/s, a 16x hold, a chip at 2 per hour.
    The hold lowers the claim on this seed (the test checks it did, else it proves nothing);
    then every output states the rate that held, its tok/s, ceil(peak / what it served)
    instances and price / (tok/s * 3600) per output token."""
    data = small_scenario(requests=300).model_dump(mode="json")
    data |= {"name": "cs300", "load": {"peak_rate": PEAK}}
    (tmp_path / "cs300.yaml").write_text(yaml.safe_dump(data))
    done = run_autotune(
        "--scenario", "cs300.yaml", "--trials", "10", "--polish", "0", "--hold", "16",
        "--chip-cost-per-hour", str(PRICE), "--export", "best.yaml", "--html", "report.html",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    exported = yaml.safe_load((tmp_path / "best.yaml").read_text())
    capacity = exported["capacity"]
    assert capacity.get("lowered_by") == "hold", "the hold did not lower this claim"
    assert capacity["rate"] == exported["hold"]["held_rate"]
    served = min(capacity["rate"], capacity["requests_per_s"])
    assert capacity["instances_for_peak"] == math.ceil(PEAK / served)
    tokens = capacity["output_tokens_per_s"]
    per_million = PRICE / (tokens * 3600) * 1e6
    assert math.isclose(exported["cost"]["per_million_output_tokens"], per_million)
    assert exported["cost"]["fleet_per_hour"] == capacity["instances_for_peak"] * PRICE

    # the console's front: the exported row, as shown
    cells = _front_row(done.stdout)
    assert cells[0] == f"{exported['trial']} *"
    assert cells[2] == f"{tokens:.0f}"
    assert cells[3] == f"{capacity['rate']:.3g} / {capacity['requests_per_s']:.3g}"
    assert cells[4] == str(capacity["instances_for_peak"])
    assert cells[5] == f"{per_million:.3g}"
    # the console's answer line and the report's answer row: the same sentence
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("answer: ")]
    for figure in (
        f"{tokens:.0f} tok/s",
        f"at {capacity['rate']:.4g} req/s",
        f"{capacity['instances_for_peak']} instances",
        f"{per_million:.3g} per million",
    ):
        assert figure in line, (figure, line)
    report = html.unescape((tmp_path / "report.html").read_text())
    assert f"<td>answer</td><td>{line.removeprefix('answer: ')}</td>" in report
    # the report's exported-config section is the export itself
    section = re.search(r"Exported config: trial \d+</h2><pre>(.*?)</pre>", report, re.S)
    assert section is not None
    assert yaml.safe_load(section.group(1))["capacity"] == capacity
    # and `autotune pareto --json` later, from what the study keeps
    shown = run_autotune("pareto", "--json", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["answer"] == capacity


def test_the_fleet_is_sized_on_no_more_than_the_load_served():
    """A window whose arrivals ran ahead of the rate served more than it was offered: sizing
    on that would leave the fleet short. 200 req/s at an offered 15.56 needs 13 instances (12
    would take 16.7 each, which a window that served 17.0 would claim); served 15.43 of an
    offered 15.56 needs 13 as well, served 14.3 needs 14; a closed loop's rate is requests in
    flight, so what it served sizes it."""
    assert fleet_for_peak(PEAK, 15.56, 16.1, closed_loop=False) == 13
    assert fleet_for_peak(PEAK, 15.56, 17.0, closed_loop=False) == 13  # not 12 on 17.0
    assert fleet_for_peak(PEAK, 15.56, 15.43, closed_loop=False) == 13
    assert fleet_for_peak(PEAK, 15.56, 14.3, closed_loop=False) == 14
    assert fleet_for_peak(PEAK, 64, 20.0, closed_loop=True) == 10
    assert fleet_for_peak(PEAK, 15.56, 0.0, closed_loop=False) is None


def _study_with_two_trials() -> tuple[optuna.Study, list[optuna.trial.FrozenTrial]]:
    """Two feasible trials that claimed 20 and 18 req/s, on the customer-service scenario with
    a peak of 100 req/s."""
    scenario = small_scenario()
    scenario = scenario.model_copy(
        update={"load": scenario.load.model_copy(update={"peak_rate": 100.0})}
    )
    study = optuna.create_study(directions=["minimize", "maximize"])
    study.set_user_attr("scenario", scenario.model_dump(mode="json"))
    identity = {"runner": "sim", "engine": "mindie", "model": "qwen2-7b", "hardware": "x"}
    study.set_user_attr("identity", identity)
    for claim in (20.0, 18.0):
        study.add_trial(
            optuna.trial.create_trial(
                values=[100.0, claim * 128],
                params={},
                distributions={},
                user_attrs={
                    "knobs": {"batch_size": int(claim)},
                    "capacity_rate": claim,
                    "capacity_rps": claim,
                    "capacity_output_tokens_per_s": claim * 128,
                    "instances_for_peak": math.ceil(100 / claim),
                },
                system_attrs={"constraints": [-1.0]},
            )
        )
    return study, study.trials


def _hold(trial: int, claimed: float, held: float) -> dict:
    load = {
        "rate": held, "requests_per_s": held * 0.99, "output_tokens_per_s": held * 120,
        "ttft_p99_ms": 300.0, "tpot_p99_ms": 20.0, "delivered_share": 0.99, "meets": True,
    }  # fmt: skip
    return {
        "trial": trial, "picked": trial, "factor": 64, "draws": 12, "claimed_rate": claimed,
        "held_rate": held, "loads": [load], "complete_trials": 2,
        "held": [{"trial": trial, "claimed_rate": claimed, "held_rate": held}],
    }  # fmt: skip


def test_a_later_runs_hold_leaves_an_earlier_runs_answer_alone():
    """Run A held trial 0 at 19 req/s; run B then held trial 1 at 17. Trial 0's export states
    A's hold (19 req/s, ceil(100 / 18.81) = 6 instances), not B's record or the search's 20."""
    study, (first, second) = _study_with_two_trials()
    keep_hold(study, _hold(first.number, 20.0, 19.0))
    keep_hold(study, _hold(second.number, 18.0, 17.0))
    exported = trial_export(study, study.trials[first.number])
    assert exported.capacity is not None and exported.hold is not None
    assert exported.capacity["rate"] == 19.0 and exported.hold["held_rate"] == 19.0
    assert exported.capacity["instances_for_peak"] == math.ceil(100 / (19.0 * 0.99))
    # B's own export states B's hold
    assert trial_export(study, study.trials[second.number]).capacity["rate"] == 17.0


def test_every_output_states_the_worst_repeat():
    """Trial 0 searched 20 req/s; its two repeats with fresh arrivals found 19 and 17.5: the
    answer is 17.5 req/s and the fleet for 100 req/s is ceil(100 / 17.5) = 6, not the first
    draw's 5."""
    study, (first, _) = _study_with_two_trials()

    def capacity(rate: float) -> dict:
        return {
            "capacity_rate": rate,
            "capacity_rps": rate,
            "capacity_output_tokens_per_s": rate * 128,
        }

    repeats = {
        "k": 3, "noise": 0.1, "pick": 0, "tied": [], "complete_trials": 2,
        "trials": {"0": {
            "ttft_p99_ms": [100.0, 110.0, 120.0], "throughput": [2560.0, 2432.0, 2240.0],
            "met": [True, True, True],
            "capacity": [capacity(20.0), capacity(19.0), capacity(17.5)],
        }},
    }  # fmt: skip
    keep_repeats(study, repeats)
    stated = answer(study, study.trials[first.number])
    assert stated.metrics["capacity_rate"] == 17.5
    assert stated.metrics["instances_for_peak"] == 6
    assert stated.throughput == 17.5 * 128
    assert stated.metrics["capacity_lowered_by"] == "repeats"
    assert "lowered from 20 by the repeats" in stated.describe()


def test_a_repeat_that_missed_the_sla_leaves_the_capacity_unconfirmed():
    """Trial 0's repeats (tuner.repeats, a planted engine): the first fresh draw finds 19 req/s,
    the second misses the SLA. No rate is certain then: the answer marks the capacity unheld
    and sizes no fleet, rather than stating the 19 of the draw that met."""
    from tuner.repeats import repeat_pick

    study, (first, _) = _study_with_two_trials()
    scenario = small_scenario()
    found = {"capacity_rate": 19.0, "capacity_rps": 19.0, "capacity_output_tokens_per_s": 2432.0}
    planted = {
        20: [(100.0, 2432.0, True, found), (100.0, 2000.0, False, found)],
        18: [(100.0, 2304.0, True, None), (100.0, 2304.0, True, None)],
    }
    result = repeat_pick(study, scenario, 3, lambda config, k: planted[config["batch_size"]][k - 1])
    assert result is not None
    stated = answer(study, study.trials[first.number], repeats=result)
    assert stated.repeats is not None and stated.repeats["worst"] == 0.0
    assert stated.metrics.get("capacity_unheld") is True
    assert stated.metrics["instances_for_peak"] is None
