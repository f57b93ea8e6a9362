"""`specpipe db`: migrate the store (SQLite or PostgreSQL, from DATABASE_URL)."""

from __future__ import annotations

import click

from specpipe.cli.options import store_error


@click.group(name="db")
def db() -> None:
    """Manage the database schema."""


@db.command(name="upgrade")
@click.option("--revision", default="head", show_default=True, help="Target revision.")
def db_upgrade(revision: str) -> None:
    """Migrate the database up to REVISION.

    Example:

        DATABASE_URL=postgresql://postgres@127.0.0.1/specpipe specpipe db upgrade
    """
    _migrate("upgrade", revision)


@db.command(name="downgrade")
@click.option("--revision", default="base", show_default=True, help="Target revision.")
def db_downgrade(revision: str) -> None:
    """Migrate the database down to REVISION (base removes every table)."""
    _migrate("downgrade", revision)


@db.command(name="current")
def db_current() -> None:
    """Show the database's revision."""
    from models import migrate
    from specpipe.settings import database_url

    try:
        click.echo(migrate.current(database_url()) or "base (not migrated)")
    except Exception as exc:  # an unreachable database is one line
        raise store_error("read the database", exc) from exc


def _migrate(direction: str, revision: str) -> None:
    """Migrate the store up or down to `revision` and say where it is now, in one line."""
    from models import migrate
    from specpipe.settings import database_url

    url = database_url()
    try:
        getattr(migrate, direction)(url, revision)
        click.echo(f"database at revision {migrate.current(url) or 'base'}")
    except Exception as exc:  # driver and Alembic errors become one line
        raise store_error("migrate", exc) from exc
