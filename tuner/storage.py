"""Storage: Optuna's RDB storage, plus our own tables beside it (Pareto snapshots)."""

from __future__ import annotations

import json
import os
import socket
import warnings
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import optuna
from sqlalchemy import (
    JSON,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    create_engine,
    delete,
    select,
    text,
    update,
)
from sqlalchemy import inspect as sqlalchemy_inspect
from sqlalchemy.engine import CursorResult, Result, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, SQLAlchemyError
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    Session,
    mapped_column,
    relationship,
    selectinload,
)

from objectives.userfile import InputError, first_line
from runners.engines.process import pid_alive
from tuner.schema_lock import schema_creation

DEFAULT_STORAGE = "sqlite:///studies.db"
WORKER = f"{socket.gethostname()}:{os.getpid()}"  # who holds a claim or ran a trial


class Base(DeclarativeBase):
    pass


class ParetoSnapshot(Base):
    """The SLA-feasible Pareto front of a study at the end of one run."""

    __tablename__ = "autotune_pareto_snapshots"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    study_name: Mapped[str] = mapped_column(String(512), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    trials_total: Mapped[int] = mapped_column(Integer)
    trials_feasible: Mapped[int] = mapped_column(Integer)
    best_trial: Mapped[int | None] = mapped_column(Integer, nullable=True)
    members: Mapped[list[ParetoMember]] = relationship(
        back_populates="snapshot", cascade="all, delete-orphan", order_by="ParetoMember.ttft_p99_ms"
    )


class ParetoMember(Base):
    __tablename__ = "autotune_pareto_members"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    snapshot_id: Mapped[int] = mapped_column(ForeignKey("autotune_pareto_snapshots.id"), index=True)
    trial_number: Mapped[int] = mapped_column(Integer)
    ttft_p99_ms: Mapped[float] = mapped_column(Float)
    output_tokens_per_s: Mapped[float] = mapped_column(Float)
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    snapshot: Mapped[ParetoSnapshot] = relationship(back_populates="members")


class TrialBudget(Base):
    """Trials claimed in a study: workers on many hosts claim a slot before running a trial,
    so together they run exactly the requested number; a crashed trial gives its slot back."""

    __tablename__ = "autotune_trial_budgets"

    study_name: Mapped[str] = mapped_column(String(512), primary_key=True)
    claimed: Mapped[int] = mapped_column(Integer)


def sqlite_file(url: str) -> Path | None:
    """The database file of a SQLite URL (None for other databases or a malformed URL)."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return None
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database).expanduser()


def check_url(url: str, must_exist: bool = False) -> None:
    """Fail with one clear line before anything is written when a storage cannot be opened;
    with must_exist (read-only commands) a missing SQLite file is an error, never created."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise InputError(
            f"--storage: {url!r} is not a database URL (e.g. sqlite:///studies.db, postgresql://host/db)"
        ) from None
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:"):
            raise InputError(
                "--storage: an in-memory SQLite database would lose every trial; give a file"
            )
        path = Path(database).expanduser()
        if must_exist and not path.exists():
            raise InputError(f"--storage: no database at {path} (a study writes one there first)")
        parent = path.resolve().parent
        if not parent.is_dir():
            raise InputError(f"--storage: directory {parent} does not exist")
        return
    try:
        engine = create_engine(url)
        with engine.connect():
            pass
        engine.dispose()
    except ImportError as error:
        hint = " (pip install 'autotune[postgres]')" if "psycopg" in str(error) else ""
        raise InputError(
            f"--storage: cannot open {parsed.render_as_string(hide_password=True)}: "
            f"the driver is not installed: {error}{hint}"
        ) from None
    except SQLAlchemyError as error:
        raise InputError(
            f"--storage: cannot open {parsed.render_as_string(hide_password=True)}: "
            f"{first_line(error)}"
        ) from None


def study_name_missing(url: str, name: str) -> bool:
    """True when the storage holds no such study; never creates a database to find out."""
    check_url(url)
    database = sqlite_file(url)  # None: not SQLite (check_url refuses SQLite without a file)
    if database is not None and not database.exists():
        return True
    engine = create_engine(url)
    try:
        with engine.connect() as con:
            if not sqlalchemy_inspect(con).has_table("studies"):
                return True
            return (
                con.execute(
                    text("select 1 from studies where study_name = :n"), {"n": name}
                ).first()
                is None
            )
    finally:
        engine.dispose()


HEARTBEAT_S = 10  # a running trial's heartbeat; after 3 missed ones it is failed as stale
OPTUNA_TABLES = frozenset({"studies", "version_info"})  # what any Optuna storage holds


def _tables(url: str) -> set[str]:
    """The tables of an existing database, read without writing to it."""
    engine = create_engine(url)
    try:
        with engine.connect() as con:
            return set(sqlalchemy_inspect(con).get_table_names())
    except SQLAlchemyError as error:
        raise InputError(f"--storage: cannot open {url}: {first_line(error)}") from None
    finally:
        engine.dispose()


def open_storage(
    url: str, heartbeat_s: int = HEARTBEAT_S, read_only: bool = False
) -> optuna.storages.RDBStorage:
    """The study storage. read_only (the commands that only read: pareto, export, report,
    history, calibrate): the database must exist and hold Optuna's tables, and nothing is
    created in it, ours included; a command that fails there has changed nothing."""
    check_url(url, must_exist=read_only)
    if read_only and not _tables(url) >= OPTUNA_TABLES:
        raise InputError(
            f"--storage: {url} holds no Optuna studies "
            f"(no {' or '.join(sorted(OPTUNA_TABLES))} table)"
        )

    def give_back_slot(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        release_claim(storage, study.study_name)

    try:
        with warnings.catch_warnings(), schema_creation(url):
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            storage = optuna.storages.RDBStorage(
                url,
                heartbeat_interval=heartbeat_s,
                grace_period=3 * heartbeat_s,
                heartbeat_stale_trial_callback=give_back_slot,
                skip_table_creation=read_only,
            )
            if not read_only:
                Base.metadata.create_all(storage.engine)
    except Exception as error:  # a file that is not a database, a schema from another Optuna
        raise InputError(f"--storage: cannot open {url}: {first_line(error)}") from None
    return storage


def has_table(engine, table: str) -> bool:
    """Whether one of our tables exists: a read-only command on a database no run of ours
    wrote (or one from before the table) reads it as empty instead of creating it."""
    with engine.connect() as con:
        return sqlalchemy_inspect(con).has_table(table)


def save_snapshot(
    storage: optuna.storages.RDBStorage,
    study_name: str,
    front: list[
        tuple[optuna.trial.FrozenTrial, dict[str, Any]]
    ],  # each member and the knobs it ran with
    trials_total: int,
    trials_feasible: int,
    best_trial: int | None,
) -> int:
    with Session(storage.engine) as session, session.begin():
        snapshot = ParetoSnapshot(
            study_name=study_name,
            created_at=datetime.now(timezone.utc),
            trials_total=trials_total,
            trials_feasible=trials_feasible,
            best_trial=best_trial,
            members=[
                ParetoMember(
                    trial_number=t.number,
                    ttft_p99_ms=t.values[0],
                    output_tokens_per_s=t.values[1],
                    params=json.loads(json.dumps(knobs)),
                    metrics=json.loads(json.dumps(t.user_attrs)),
                )
                for t, knobs in front
            ],
        )
        session.add(snapshot)
        session.flush()
        return snapshot.id


def latest_snapshot(storage: optuna.storages.RDBStorage, study_name: str) -> ParetoSnapshot | None:
    with Session(storage.engine, expire_on_commit=False) as session:
        query = (
            select(ParetoSnapshot)
            .where(ParetoSnapshot.study_name == study_name)
            .order_by(ParetoSnapshot.id.desc())
            .limit(1)
            .options(selectinload(ParetoSnapshot.members))  # loaded while the session is open
        )
        return session.scalars(query).first()


def ensure_budget(
    storage: optuna.storages.RDBStorage, study_name: str, existing_trials: int
) -> None:
    try:
        with Session(storage.engine) as session, session.begin():
            session.add(TrialBudget(study_name=study_name, claimed=existing_trials))
    except IntegrityError:
        pass  # another worker created it first


def rows_matched(result: Result[Any]) -> int:
    """The rows an UPDATE matched. Session.execute is typed to return a Result, but what a DML
    statement returns is a CursorResult, which counts them."""
    assert isinstance(result, CursorResult), "an UPDATE's result is a CursorResult"
    return result.rowcount


def claim_trial(storage: optuna.storages.RDBStorage, study_name: str, total: int | None) -> bool:
    """Take one trial slot; with a total, only while fewer than `total` are claimed (atomic)."""
    query = update(TrialBudget).where(TrialBudget.study_name == study_name)
    if total is not None:
        query = query.where(TrialBudget.claimed < total)
    with Session(storage.engine) as session, session.begin():
        return rows_matched(session.execute(query.values(claimed=TrialBudget.claimed + 1))) == 1


def release_claim(storage: optuna.storages.RDBStorage, study_name: str) -> None:
    with Session(storage.engine) as session, session.begin():
        session.execute(
            update(TrialBudget)
            .where(TrialBudget.study_name == study_name)
            .values(claimed=TrialBudget.claimed - 1)
        )


class QualityClaim(Base):
    """Which worker measures a (precision, KV) pair of a study: the first to insert the row.
    The others wait for its figure, so every trial of a pair carries the same one."""

    __tablename__ = "autotune_quality_claims"

    study_name: Mapped[str] = mapped_column(String(512), primary_key=True)
    pair: Mapped[str] = mapped_column(String(128), primary_key=True)
    holder: Mapped[str] = mapped_column(String(256))  # host:pid
    claimed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


def claim_pair(
    storage: optuna.storages.RDBStorage, study_name: str, pair: str, stale_after_s: float
) -> bool:
    """Claim the measurement of `pair` (atomic: the primary key admits one row), or take over a
    claim older than `stale_after_s` whose holder never recorded a figure (it died)."""
    now = datetime.now(timezone.utc)
    try:
        with Session(storage.engine) as session, session.begin():
            session.add(
                QualityClaim(study_name=study_name, pair=pair, holder=WORKER, claimed_at=now)
            )
        return True
    except IntegrityError:
        pass
    stale = now - timedelta(seconds=stale_after_s)
    with Session(storage.engine) as session, session.begin():
        holder = session.scalar(
            select(QualityClaim.holder).where(
                QualityClaim.study_name == study_name, QualityClaim.pair == pair
            )
        )
        # A holder on this host whose process is gone died holding it (or held it for a study
        # since deleted and recreated under the same name): no need to wait for it to go stale.
        gone = holder is not None and _dead_here(holder)
        taken = session.execute(
            update(QualityClaim)
            .where(
                QualityClaim.study_name == study_name,
                QualityClaim.pair == pair,
                (QualityClaim.holder == holder) if gone else (QualityClaim.claimed_at < stale),
            )
            .values(holder=WORKER, claimed_at=now)
        )
        return rows_matched(taken) == 1


def _dead_here(holder: str) -> bool:
    """Whether `holder` (host:pid, as WORKER) names a process of this host that no longer
    runs."""
    host, _, pid = holder.rpartition(":")
    return host == socket.gethostname() and pid.isdigit() and not pid_alive(int(pid))


def release_pair(storage: optuna.storages.RDBStorage, study_name: str, pair: str) -> None:
    """Give back this worker's claim on `pair` (its measurement ended without a figure or a
    reason: interrupted, say), so a later trial measures it without waiting."""
    with Session(storage.engine) as session, session.begin():
        session.execute(
            delete(QualityClaim).where(
                QualityClaim.study_name == study_name,
                QualityClaim.pair == pair,
                QualityClaim.holder == WORKER,
            )
        )


class NightlyRun(Base):
    """One night of re-tuning: what was measured, what was decided and why."""

    __tablename__ = "autotune_nightly_runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    study_name: Mapped[str] = mapped_column(String(512), index=True)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    decision: Mapped[str] = mapped_column(String(32))  # promoted, unchanged, failed
    reason: Mapped[str] = mapped_column(String(2000))
    incumbent: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    candidate: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class NightlyLock(Base):
    """At most one nightly run per study; a holder that died is detected and replaced."""

    __tablename__ = "autotune_nightly_locks"

    study_name: Mapped[str] = mapped_column(String(512), primary_key=True)
    holder: Mapped[str] = mapped_column(String(256))  # host:pid
    acquired_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    beat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


def load_study(
    storage: str, study_name: str | None
) -> tuple[optuna.Study, optuna.storages.RDBStorage]:
    """An existing study by name (or the only one in the storage), for the commands that read
    one."""
    rdb = open_storage(storage, read_only=True)
    summaries = optuna.get_all_study_summaries(rdb, include_best_trial=False)
    names = [s.study_name for s in summaries]
    if (
        study_name is None
    ):  # the simulated trials a `--screen` run keeps beside a study are not a choice
        tuned = [s.study_name for s in summaries if "screens" not in s.user_attrs]
        if len(tuned) != 1:
            raise InputError(
                f"--study: give one of: {', '.join(tuned) or '(no study in this storage)'}"
            )
        study_name = tuned[0]
    if study_name not in names:
        raise InputError(
            f"--study: no study {study_name!r} in {storage}; studies: {', '.join(names) or 'none'}"
        )
    study = optuna.load_study(study_name=study_name, storage=rdb)
    if "scenario" not in study.user_attrs:  # every study autotune runs records its scenario first
        raise InputError(
            f"--study {study_name}: not an autotune study (it records no scenario); "
            "autotune reads only the studies it ran"
        )
    return study, rdb
