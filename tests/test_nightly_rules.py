"""Nightly's decision rules with fake figures, its default margin, and its lock (held before the
night writes anything, and noticed when lost)."""

from __future__ import annotations

import os
import socket
import sqlite3
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from sqlalchemy import create_engine, update
from sqlalchemy.orm import Session

from objectives.scenario import Scenario, load_scenario
from tests.test_nightly import _nightly, _study
from tuner.nightly import (
    LockLost,
    Repeats,
    acquire_lock,
    beat_lock,
    decide,
    default_min_gain,
    lock_kept,
    release_lock,
)
from tuner.storage import Base, NightlyLock

INCUMBENT = {"batch_size": 16}
CANDIDATE = {"batch_size": 32}


def _repeats(
    knobs: dict, throughputs: list[float], ttfts: list[float], feasible: list[bool] | None = None
) -> Repeats:
    feasible = feasible or [True] * len(throughputs)
    return Repeats(
        knobs,
        [
            {"ttft_p99_ms": t, "output_tokens_per_s": x, "feasible": ok, "fault": None}
            for x, t, ok in zip(throughputs, ttfts, feasible, strict=True)
        ],
    )


@pytest.fixture
def scenario() -> Scenario:
    """Capacity mode, pick max-throughput, ties within 1% (the preset's tie_tolerance)."""
    chosen = load_scenario("customer-service")
    assert chosen.tie_tolerance == 0.01 and chosen.pick == "max-throughput"
    return chosen


def test_a_gain_must_beat_the_smallest_margin(scenario: Scenario):
    incumbent = _repeats(INCUMBENT, [1000, 1000, 1000], [200, 200, 200])
    above = decide(
        scenario, incumbent, _repeats(CANDIDATE, [1060, 1060, 1060], [200, 200, 200]), 0.05
    )
    assert above.outcome == "promoted" and "6.0%" in above.reason and "5.0%" in above.reason
    below = decide(
        scenario, incumbent, _repeats(CANDIDATE, [1040, 1040, 1040], [200, 200, 200]), 0.05
    )
    assert below.outcome == "unchanged" and "4.0%" in below.reason


def test_the_margin_widens_to_the_noise_of_either_side(scenario: Scenario):
    # The incumbent's repeats spread (110 - 100) / 105 = 9.5%: an 8% gain is within the noise.
    noisy = _repeats(INCUMBENT, [100, 110, 105], [200, 200, 200])
    within = decide(
        scenario, noisy, _repeats(CANDIDATE, [113.4, 113.4, 113.4], [200, 200, 200]), 0.02
    )
    assert within.outcome == "unchanged" and "9.5%" in within.reason
    beyond = decide(scenario, noisy, _repeats(CANDIDATE, [116, 116, 116], [200, 200, 200]), 0.02)
    assert beyond.outcome == "promoted"
    # The candidate's own spread counts the same: (130 - 100) / 115 = 26%.
    steady = _repeats(INCUMBENT, [100, 100, 100], [200, 200, 200])
    jumpy = decide(scenario, steady, _repeats(CANDIDATE, [100, 130, 115], [200, 200, 200]), 0.02)
    assert jumpy.outcome == "unchanged" and "26.1%" in jumpy.reason


def test_a_tie_on_throughput_is_decided_by_ttft_with_the_same_margin(scenario: Scenario):
    incumbent = _repeats(INCUMBENT, [1000, 1000], [200, 200])
    faster = decide(
        scenario, incumbent, _repeats(CANDIDATE, [1005, 1005], [160, 160]), 0.05
    )  # +0.5%: a tie
    assert faster.outcome == "promoted" and faster.reason.startswith("TTFT p99 better by 20.0%")
    barely = decide(
        scenario, incumbent, _repeats(CANDIDATE, [1005, 1005], [194, 194]), 0.05
    )  # 3% < 5%
    assert barely.outcome == "unchanged" and barely.reason.startswith("TTFT p99")
    slower = decide(scenario, incumbent, _repeats(CANDIDATE, [1005, 1005], [240, 240]), 0.05)
    assert slower.outcome == "unchanged"


def test_no_tie_means_the_second_objective_is_never_asked(scenario: Scenario):
    # +3%: beyond the 1% tie, within the 5% margin; a far lower TTFT does not promote it.
    result = decide(
        scenario,
        _repeats(INCUMBENT, [1000, 1000], [200, 200]),
        _repeats(CANDIDATE, [1030, 1030], [50, 50]),
        0.05,
    )
    assert result.outcome == "unchanged" and result.reason.startswith("throughput better by 3.0%")


def test_pick_min_ttft_decides_on_ttft_first(scenario: Scenario):
    min_ttft = scenario.model_copy(update={"pick": "min-ttft"})
    incumbent = _repeats(INCUMBENT, [1000, 1000], [200, 200])
    assert (
        decide(min_ttft, incumbent, _repeats(CANDIDATE, [900, 900], [170, 170]), 0.05).outcome
        == "promoted"
    )
    # TTFT within the tie: throughput decides.
    tied = decide(min_ttft, incumbent, _repeats(CANDIDATE, [1200, 1200], [199, 199]), 0.05)
    assert tied.outcome == "promoted" and tied.reason.startswith("throughput better by 20.0%")


def test_sla_misses_and_drift(scenario: Scenario):
    healthy = _repeats(INCUMBENT, [1000, 1000], [200, 200])
    drifted = _repeats(INCUMBENT, [1000, 1000], [200, 900], [True, False])
    good = _repeats(
        CANDIDATE, [900, 900], [210, 210]
    )  # worse on both objectives, but meets the SLA
    flaky = _repeats(CANDIDATE, [2000, 2000], [100, 900], [True, False])
    assert decide(scenario, healthy, flaky, 0.05).outcome == "unchanged"
    assert decide(scenario, drifted, flaky, 0.05).outcome == "failed"
    promoted = decide(scenario, drifted, good, 0.05)
    assert promoted.outcome == "promoted" and promoted.drift and "without margin" in promoted.reason
    assert decide(scenario, None, good, 0.05).outcome == "promoted"
    assert (
        decide(scenario, healthy, _repeats(INCUMBENT, [2000, 2000], [100, 100]), 0.05).outcome
        == "unchanged"
    )


def test_the_default_margin_is_at_least_the_capacity_search_precision(scenario: Scenario):
    # A 4% capacity gain is below the search's 5% bracket: by default it is not a win.
    assert scenario.load.precision == 0.05
    incumbent = _repeats(INCUMBENT, [1000, 1000], [200, 200])
    candidate = _repeats(CANDIDATE, [1040, 1040], [200, 200])
    assert decide(scenario, incumbent, candidate, default_min_gain(scenario)).outcome == "unchanged"
    finer = scenario.model_copy(
        update={"load": scenario.load.model_copy(update={"precision": 0.01})}
    )
    assert decide(finer, incumbent, candidate, default_min_gain(finer)).outcome == "promoted"
    fixed = scenario.model_copy(update={"load": scenario.load.model_copy(update={"mode": "fixed"})})
    assert default_min_gain(fixed) == 0.02  # no search: the plain 2%


def _study_attrs(db: Path) -> list[tuple]:
    return (
        sqlite3.connect(db)
        .execute(
            "select study_id, key, value_json from study_user_attributes order by study_id, key"
        )
        .fetchall()
    )


def test_a_night_that_cannot_take_the_lock_writes_nothing_to_the_study(
    tmp_path: Path, scenario_file: Path
):
    db = _study(tmp_path, scenario_file)
    con = sqlite3.connect(tmp_path / "n.db")
    now = datetime.now(timezone.utc).isoformat(" ")
    con.execute(
        "insert into autotune_nightly_locks values (?, ?, ?, ?)",
        (
            "small-cs.sim.mindie.qwen2-7b.ascend-910b2",
            f"{socket.gethostname()}:{os.getpid()}",
            now,
            now,
        ),
    )
    con.commit()
    before = _study_attrs(tmp_path / "n.db")
    space = tmp_path / "space.yaml"
    space.write_text(
        "knobs:\n  quantization: {value: w8a8}\n"
    )  # another run would record other fixed knobs
    held = _nightly(tmp_path, scenario_file, db, "--space", str(space))
    assert held.returncode == 2 and "holds the lock" in held.stderr, held.stderr
    assert _study_attrs(tmp_path / "n.db") == before


@pytest.fixture
def lock_db(tmp_path: Path):
    engine = create_engine(f"sqlite:///{tmp_path / 'lock.db'}")
    Base.metadata.create_all(engine)
    acquire_lock(engine, "s")
    yield engine
    release_lock(engine, "s")
    engine.dispose()


def _take_over(engine) -> None:
    with Session(engine) as session, session.begin():
        session.execute(
            update(NightlyLock).where(NightlyLock.study_name == "s").values(holder="elsewhere:1")
        )


def test_a_lost_lock_is_noticed_by_its_beat(lock_db):
    beat_lock(lock_db, "s")  # held: beats
    _take_over(lock_db)
    with pytest.raises(LockLost, match="is held by elsewhere:1 while this night ran"):
        beat_lock(lock_db, "s")


def test_the_lock_thread_says_so_when_the_lock_is_lost(lock_db, capsys):
    _take_over(lock_db)
    said = ""
    with lock_kept(lock_db, "s", every_s=0.01):
        for _ in range(2000):  # a bound against a hang, not a timing: the first failed beat says it
            said += capsys.readouterr().err
            if "is held by elsewhere:1" in said:
                break
            time.sleep(0.01)
        time.sleep(0.1)  # further failed beats of the same streak add no line
    said += capsys.readouterr().err
    lines = said.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "autotune: warning: the nightly lock's heartbeat of s failed"
    ), said
