"""Run the Alembic migrations in `migrations/` against a database URL."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from models.db import get_engine, normalize_url

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(url: str) -> Config:
    """An Alembic config for `url`, without needing an alembic.ini."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolates %; URLs may hold percent-encoded passwords.
    config.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at `url` up to `revision`."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    """Migrate the database at `url` down to `revision`."""
    command.downgrade(alembic_config(url), revision)


def heads(url: str = "sqlite://") -> list[str]:
    """The head revisions of the migration history (one, if the history is linear)."""
    return list(ScriptDirectory.from_config(alembic_config(url)).get_heads())


def current(url: str) -> str | None:
    """The revision the database at `url` is at, None when unmigrated."""
    with get_engine(normalize_url(url)).connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()
