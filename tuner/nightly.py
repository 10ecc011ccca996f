"""Nightly re-tuning: re-measure the deployed config, warm-start, and promote only a real win.

Decision (docs/nightly.md): the incumbent and the best SLA-feasible candidate are
each measured `repeats` times, repeat k with workload seed + k, so traffic sampling is part of
the noise. noise = the larger relative spread (max - min) / mean of the picked objective over
either's repeats; margin = max(noise, min_gain). The candidate is promoted when it meets the
SLA in every repeat and beats the incumbent's mean by more than the margin. If the incumbent
misses the SLA in any repeat (drift), a candidate that meets it in every repeat is promoted
with no margin.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import numpy as np
import optuna
from sqlalchemy import delete, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from objectives.scenario import Scenario
from objectives.scoring import constraint_values, is_feasible, objective_values
from objectives.userfile import InputError
from runners.base import Runner
from runners.engines.process import pid_alive
from runners.load.capacity import evaluate
from tuner.heartbeat import beating
from tuner.storage import WORKER, NightlyLock, NightlyRun, has_table, rows_matched

EXIT_UNCHANGED, EXIT_PROMOTED, EXIT_FAILED = 0, 10, 20
MIN_GAIN = 0.02  # the smallest default margin: below it a win is a rounding of the figures


def default_min_gain(scenario: Scenario) -> float:
    """The margin a night asks of a candidate unless --min-gain says: in capacity mode at least
    the search's precision, since two capacities closer than the final bracket are not told
    apart."""
    return max(MIN_GAIN, scenario.load.precision) if scenario.load.mode == "capacity" else MIN_GAIN


LOCK_STALE_AFTER = timedelta(minutes=30)  # no heartbeat for this long: the holder is gone


@dataclass
class Repeats:
    knobs: dict[str, Any]
    # per repeat: ttft_p99_ms, output_tokens_per_s (the throughput objective: at capacity in
    # capacity mode), feasible, fault
    runs: list[dict[str, Any]]

    @property
    def feasible_all(self) -> bool:
        return all(r["feasible"] for r in self.runs)

    def mean(self, key: str) -> float | None:
        """None when no repeat measured it: storage gets no NaN (PostgreSQL's JSON refuses it)."""
        values = [r[key] for r in self.runs if r[key] is not None]
        return float(np.mean(values)) if values else None

    def spread(self, key: str) -> float:
        values = [r[key] for r in self.runs if r[key] is not None]
        return float((max(values) - min(values)) / np.mean(values)) if len(values) > 1 else 0.0

    def as_record(self) -> dict[str, Any]:
        return {
            "knobs": self.knobs,
            "repeats": self.runs,
            "feasible_all": self.feasible_all,
            "ttft_p99_ms_mean": self.mean("ttft_p99_ms"),
            "output_tokens_per_s_mean": self.mean("output_tokens_per_s"),
        }


def measure(runner: Runner, scenario: Scenario, knobs: dict[str, Any], repeats: int) -> Repeats:
    """Evaluate a config `repeats` times as a trial does (capacity included), workload seed + k."""
    runs: list[dict[str, Any]] = []
    for k in range(repeats):
        evaluation = evaluate(runner, knobs, scenario, seed_offset=k)
        if evaluation.fault is not None:
            runs.append(
                {
                    "ttft_p99_ms": None,
                    "output_tokens_per_s": None,
                    "feasible": False,
                    "fault": evaluation.fault.message,
                }
            )
            continue
        metrics = evaluation.metrics
        values = objective_values(metrics, scenario)
        ok = values is not None and is_feasible(constraint_values(metrics, scenario.sla))
        ttft, throughput = values if values is not None else (None, None)
        runs.append(
            {
                "ttft_p99_ms": ttft,
                "output_tokens_per_s": throughput,
                "feasible": ok,
                "fault": None,
                **({"capacity_rps": metrics["capacity_rps"]} if "capacity_rps" in metrics else {}),
            }
        )
    return Repeats(knobs, runs)


@dataclass
class Decision:
    outcome: str  # promoted, unchanged, failed
    reason: str
    drift: bool = False


def decide(
    scenario: Scenario, incumbent: Repeats | None, candidate: Repeats | None, min_gain: float
) -> Decision:
    drift = incumbent is not None and not incumbent.feasible_all
    if candidate is None or not candidate.feasible_all:
        why = (
            "no candidate met the SLA"
            if candidate is None
            else "the best candidate missed the SLA in a repeat"
        )
        if incumbent is None or drift:
            return Decision("failed", f"{why}, and no deployed config meets it either", drift)
        return Decision("unchanged", why)
    if incumbent is None:
        return Decision("promoted", "no deployed config yet")
    if candidate.knobs == incumbent.knobs:
        return Decision("unchanged", "the best candidate is the deployed config", drift)
    if drift:
        return Decision(
            "promoted",
            "the deployed config no longer meets the SLA (drift); promoted without margin",
            True,
        )
    objectives = [("output_tokens_per_s", 1, "throughput"), ("ttft_p99_ms", -1, "TTFT p99")]
    if scenario.pick == "min-ttft":
        objectives.reverse()
    # The picked objective decides; when it ties (as the pick rule counts ties), the other one.
    for rank, (key, sign, label) in enumerate(objectives):
        margin = max(min_gain, incumbent.spread(key), candidate.spread(key))
        candidate_mean, incumbent_mean = candidate.mean(key), incumbent.mean(key)
        assert candidate_mean is not None and incumbent_mean is not None, (
            "both met the SLA in every repeat, so every repeat measured both objectives"
        )
        gain = sign * (candidate_mean / incumbent_mean - 1)
        if gain > margin:
            return Decision(
                "promoted", f"{label} better by {gain:.1%}, more than the margin {margin:.1%}"
            )
        if rank == 0 and abs(gain) > scenario.tie_tolerance:
            break
    return Decision(
        "unchanged", f"{label} better by {gain:.1%}, not more than the margin {margin:.1%}"
    )


def _stale(lock: NightlyLock, now: datetime) -> bool:
    host, _, pid = lock.holder.rpartition(":")
    if host == socket.gethostname() and pid.isdigit() and not pid_alive(int(pid)):
        return True
    beat = lock.beat_at if lock.beat_at.tzinfo else lock.beat_at.replace(tzinfo=timezone.utc)
    return now - beat > LOCK_STALE_AFTER


def acquire_lock(engine, study_name: str) -> str | None:
    """Take the study's nightly lock; returns a note when a stale lock was taken over."""
    now = datetime.now(timezone.utc)
    try:
        with Session(engine) as session, session.begin():
            session.add(
                NightlyLock(study_name=study_name, holder=WORKER, acquired_at=now, beat_at=now)
            )
        return None
    except IntegrityError:
        pass
    with Session(engine) as session, session.begin():
        lock = session.get(NightlyLock, study_name)
        if lock is None:
            raise InputError(
                f"nightly lock of {study_name}: released while being checked; run again"
            )
        if not _stale(lock, now):
            raise InputError(
                f"another nightly run of {study_name} holds the lock ({lock.holder}, since "
                f"{lock.acquired_at:%Y-%m-%d %H:%M:%S}); not starting a second one"
            )
        old = lock.holder
        taken = rows_matched(
            session.execute(
                update(NightlyLock)
                .where(NightlyLock.study_name == study_name, NightlyLock.holder == old)
                .values(holder=WORKER, acquired_at=now, beat_at=now)
            )
        )
    if taken != 1:
        raise InputError(f"another nightly run of {study_name} took over the stale lock first")
    return f"took over a stale nightly lock left by {old}"


class LockLost(InputError):
    """Another nightly run took this one's lock (its beats were missed): nothing more of this
    night is recorded or promoted, the other run's is."""


def beat_lock(engine, study_name: str) -> None:
    """Renew the lock's heartbeat; LockLost when this process no longer holds it."""
    with Session(engine) as session, session.begin():
        beaten = rows_matched(
            session.execute(
                update(NightlyLock)
                .where(NightlyLock.study_name == study_name, NightlyLock.holder == WORKER)
                .values(beat_at=datetime.now(timezone.utc))
            )
        )
        if beaten != 1:
            lock = session.get(NightlyLock, study_name)
            holder = f"is held by {lock.holder}" if lock is not None else "was released"
            raise LockLost(
                f"the nightly lock of {study_name} {holder} while this night ran; "
                "this night records and promotes nothing"
            )


class StudyLock:
    """The study's nightly lock, taken as soon as the storage is open (before the night writes
    to the study) and released whatever happens after."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.study_name: str | None = None
        self.note: str | None = None  # a note when a stale lock was taken over

    def take(self, storage: optuna.storages.RDBStorage, study_name: str) -> None:
        self.note = acquire_lock(storage.engine, study_name)
        self.engine, self.study_name = storage.engine, study_name

    def release(self) -> None:
        if self.engine is not None and self.study_name is not None:
            release_lock(self.engine, self.study_name)


LOCK_BEAT_S = 60.0


def lock_kept(engine, study_name: str, every_s: float = LOCK_BEAT_S):
    """Beat the lock while the night runs: measuring on real engines takes longer than the
    stale limit, and a silent lock would be taken over by another host."""
    return beating(
        lambda: beat_lock(engine, study_name),
        every_s,
        f"the nightly lock's heartbeat of {study_name}",
    )


def release_lock(engine, study_name: str) -> None:
    with Session(engine) as session, session.begin():
        session.execute(
            delete(NightlyLock).where(
                NightlyLock.study_name == study_name, NightlyLock.holder == WORKER
            )
        )


def record_night(
    engine,
    study_name: str,
    started: datetime,
    decision: Decision,
    incumbent: Repeats | None,
    candidate: Repeats | None,
) -> None:
    with Session(engine) as session, session.begin():
        session.add(
            NightlyRun(
                study_name=study_name,
                started_at=started,
                finished_at=datetime.now(timezone.utc),
                decision=decision.outcome,
                reason=decision.reason[:2000],
                incumbent=incumbent.as_record() if incumbent else None,
                candidate=candidate.as_record() if candidate else None,
            )
        )


def nights(engine, study_name: str | None) -> list[NightlyRun]:
    if not has_table(engine, NightlyRun.__tablename__):  # read-only commands create no table
        return []
    query = select(NightlyRun).order_by(NightlyRun.id)
    if study_name:
        query = query.where(NightlyRun.study_name == study_name)
    with Session(engine) as session:
        return list(session.scalars(query))


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def report(
    study_name: str,
    started: datetime,
    decision: Decision,
    incumbent: Repeats | None,
    candidate: Repeats | None,
    candidate_trial: int | None,
    traffic: list[str] | None = None,
) -> str:
    """`traffic`: the lines on tonight's traffic (tuner.nightly_traffic), where it was given."""
    lines = [f"# autotune nightly: {study_name}", "", f"{started:%Y-%m-%d %H:%M} UTC", ""]
    lines += traffic or []
    if decision.drift:
        lines += ["## DRIFT: the deployed config no longer meets the SLA", ""]
    lines += [
        f"**Decision: {decision.outcome}.** {decision.reason}",
        "",
        "| config | repeats meeting SLA | TTFT p99 ms (mean) | throughput tok/s (mean) |",
        "|---|---|---|---|",
    ]
    for label, r in (("deployed", incumbent), (f"candidate (trial {candidate_trial})", candidate)):
        if r is not None:
            met = sum(run["feasible"] for run in r.runs)
            ttft, throughput = r.mean("ttft_p99_ms"), r.mean("output_tokens_per_s")
            lines.append(
                f"| {label} | {met}/{len(r.runs)} | {_number(ttft)} | {_number(throughput)} |"
            )
    return "\n".join(lines) + "\n"
