"""Database fixtures: one suite, SQLite or PostgreSQL, chosen by TESTING_DATABASE_URL.

Unset (or sqlite): each pytest-xdist worker migrates its own SQLite file. A PostgreSQL URL:
each worker creates its own database beside the one named (and drops it at the end), so
`-n auto` never shares state. Tables are emptied before every test. Every test that uses these
fixtures gets the `db` marker, so `pytest -m db` reruns just those on another backend.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from models import Base
from models.db import get_engine, make_session_factory, normalize_url
from models.migrate import upgrade

DB_FIXTURES = {"db_url", "database_url", "fresh_database_url", "db_session"}


def testing_url() -> str | None:
    """TESTING_DATABASE_URL when it names a server database, else None (SQLite)."""
    url = os.environ.get("TESTING_DATABASE_URL", "")
    return None if not url or url.startswith("sqlite") else normalize_url(url)


def backend_name() -> str:
    """`postgresql` or `sqlite`, for reports and skips."""
    url = testing_url()
    return make_url(url).get_backend_name() if url else "sqlite"


def pytest_collection_modifyitems(items) -> None:
    """Mark every test that touches the database with `db`."""
    for item in items:
        if DB_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.db)


def pytest_configure(config) -> None:
    """Register the `db` marker."""
    config.addinivalue_line("markers", "db: touches the database (rerun on PostgreSQL)")


class _Server:
    """Create and drop databases on the PostgreSQL server TESTING_DATABASE_URL names."""

    def __init__(self, url: str):
        self.base = make_url(url)
        self.admin = create_engine(self.base, isolation_level="AUTOCOMMIT")

    def create(self, tag: str) -> str:
        name = f"{self.base.database}_{tag}_{uuid.uuid4().hex[:8]}"
        with self.admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        return self.base.set(database=name).render_as_string(hide_password=False)

    def drop(self, url: str) -> None:
        get_engine(url).dispose()
        name = make_url(url).database
        with self.admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def _worker(request) -> str:
    return getattr(request.config, "workerinput", {}).get("workerid", "main")


@pytest.fixture(scope="session")
def _db_server() -> Iterator[_Server | None]:
    url = testing_url()
    if url is None:
        yield None
        return
    server = _Server(url)
    yield server
    server.admin.dispose()


def _new_database(server: _Server | None, tmp_dir, tag: str) -> str:
    if server is None:
        return f"sqlite:///{tmp_dir / f'{tag}-{uuid.uuid4().hex[:8]}.sqlite3'}"
    return server.create(tag)


def _drop_database(server: _Server | None, url: str) -> None:
    if server is None:
        get_engine(url).dispose()
    else:
        server.drop(url)


@pytest.fixture(scope="session")
def database_url(request, _db_server, tmp_path_factory) -> Iterator[str]:
    """This worker's migrated database, shared by its tests (use `db_url` for a clean one)."""
    url = _new_database(_db_server, tmp_path_factory.mktemp("db"), _worker(request))
    upgrade(url)
    yield url
    _drop_database(_db_server, url)


@pytest.fixture
def db_url(database_url: str) -> str:
    """The worker's database with every table emptied: a fresh store for this test."""
    engine = get_engine(database_url)
    tables = [t.name for t in Base.metadata.sorted_tables]
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE"))
        else:
            for name in reversed(tables):
                conn.execute(text(f"DELETE FROM {name}"))
    return database_url


@pytest.fixture
def db_session(db_url: str):
    """A session on a fresh store, closed after the test."""
    session = make_session_factory(db_url)()
    yield session
    session.close()


@pytest.fixture
def fresh_database_url(request, _db_server, tmp_path) -> Iterator[str]:
    """A brand-new, unmigrated database, dropped after the test."""
    url = _new_database(_db_server, tmp_path, f"{_worker(request)}_fresh")
    yield url
    _drop_database(_db_server, url)
