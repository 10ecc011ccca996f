"""One process at a time creates a new database's tables.

Optuna's RDBStorage creates its schema unguarded: processes started together on a new database
each find the tables missing, and all but one fail (`table studies already exists`, or the
UNIQUE row of `alembic_version`). A schema race is no bad input, so creation is serialised:
for SQLite by an flock on the database's folder (taking it writes nothing there; SQLite's own
locks are POSIX locks on the file, which an flock on the folder never touches), for PostgreSQL
by a session advisory lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

SCHEMA_LOCK_KEY = int.from_bytes(b"autotune", "big") >> 1  # a bigint for pg_advisory_lock


@contextmanager
def _folder_locked(folder: Path) -> Iterator[None]:
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # an unreadable folder: go on unserialised, as before
        yield
        return
    try:
        with contextlib.suppress(OSError):  # a filesystem without flock (some network mounts)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


@contextmanager
def _advisory_locked(url: str) -> Iterator[None]:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            connection.execute(text("select pg_advisory_lock(:key)"), {"key": SCHEMA_LOCK_KEY})
            try:
                yield
            finally:
                connection.execute(
                    text("select pg_advisory_unlock(:key)"), {"key": SCHEMA_LOCK_KEY}
                )
    finally:
        engine.dispose()


@contextmanager
def schema_creation(url: str) -> Iterator[None]:
    """Hold while creating tables in the storage at `url` (a URL check_url accepted)."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        assert parsed.database, "check_url refuses a SQLite URL without a database file"
        with _folder_locked(Path(parsed.database).expanduser().resolve().parent):
            yield
    elif backend == "postgresql":
        with _advisory_locked(url):
            yield
    else:
        yield
