"""Engines, sessions and the declarative base shared by every table in `models/`.

One naming convention for constraints keeps Alembic's migrations identical on SQLite and
PostgreSQL. URLs written as `postgresql://` use psycopg 3, the driver this project installs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path

from sqlalchemy import (
    JSON,
    Engine,
    MetaData,
    String,
    Text,
    TypeDecorator,
    create_engine,
    event,
    make_url,
)
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

UINT64_MAX = 2**64 - 1


class Base(DeclarativeBase):
    """Declarative base: every table shares one metadata with the naming convention."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict: JSON, list: JSON}


class Uint64(TypeDecorator):
    """An unsigned 64-bit integer (a seed), stored as 20 zero-padded digits.

    Neither SQLite nor PostgreSQL has an unsigned 64-bit column, and SQLite turns big NUMERICs
    into floats; padded text keeps every value exact and sorts in numeric order.
    """

    impl = String(20)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        value = int(value)
        if not 0 <= value <= UINT64_MAX:
            raise ValueError(f"{value} is outside 0 … 2^64-1")
        return f"{value:020d}"

    def process_result_value(self, value, dialect):
        return None if value is None else int(value)


class NulSafeText(TypeDecorator):
    """Text that may hold NUL characters (a model can generate them), stored escaped.

    PostgreSQL's text refuses NUL. Stored, a backslash becomes two and a NUL becomes `\\0`;
    read back, the text is exactly what was written, on every database.
    """

    impl = Text
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        return value.replace("\\", "\\\\").replace("\x00", "\\0")

    def process_result_value(self, value, dialect):
        if value is None:
            return None
        return _ESCAPED.sub(lambda m: "\x00" if m.group(1) == "0" else "\\", value)


_ESCAPED = re.compile(r"\\(\\|0)")


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


def as_utc(moment: datetime | None) -> datetime | None:
    """Treat a naive datetime (SQLite drops the zone) as UTC."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


def iso_utc(moment: datetime | None) -> str | None:
    """ISO 8601 in UTC with a `Z`, or None."""
    moment = as_utc(moment)
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z") if moment else None


def normalize_url(url: str) -> str:
    """Point bare PostgreSQL URLs at psycopg 3."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    # WAL lets the web app read while a worker writes progress.
    cursor.execute("PRAGMA journal_mode=WAL")
    # A commit then waits for no fsync (a checkpoint does): every job stores every round, and
    # on a slow disk fsyncs held the write lock long enough to starve other writers. A crash of
    # any process loses nothing; a power cut may lose the last rounds, which a resume redoes.
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


def create_private_file(path: Path) -> None:
    """Make `path` an empty file readable by its owner only, unless it exists (its folder too,
    owner-only, when it is new). SQLite takes an empty file for a new database and gives its
    journal and WAL files the database's mode, so the store's prompts, outputs and password
    hashes are never readable by other local users."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # a fresh instance folder
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass


def make_engine(url: str) -> Engine:
    """A new engine for `url`, with foreign keys and WAL on for SQLite (a new database file
    mode 0600)."""
    url = normalize_url(url)
    if url.startswith("sqlite"):
        database = make_url(url).database
        if database and database != ":memory:":
            create_private_file(Path(database))
        engine = create_engine(url, connect_args={"check_same_thread": False})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_pre_ping=True)


@lru_cache(maxsize=16)
def get_engine(url: str) -> Engine:
    """One shared engine per URL for this process."""
    return make_engine(url)


def make_session_factory(url: str) -> sessionmaker[Session]:
    """A session factory bound to the shared engine for `url`."""
    return sessionmaker(bind=get_engine(url), expire_on_commit=False)


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """A session that commits on success, rolls back on error and always closes."""
    session = make_session_factory(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
