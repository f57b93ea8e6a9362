"""Alembic environment: one migration history for SQLite and PostgreSQL.

The URL comes from the Alembic config (set by `models.migrate`) or else from
`specpipe.settings.database_url()`. SQLite runs in batch mode so ALTERs work there too.
"""

from alembic import context

from models import Base
from models.db import get_engine, normalize_url
from specpipe.settings import database_url

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return normalize_url(config.get_main_option("sqlalchemy.url") or database_url())


def run_migrations_offline() -> None:
    """Emit SQL without a database connection (`alembic upgrade --sql`)."""
    url = _url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Migrate through a live connection."""
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    with get_engine(_url()).connect() as connection:
        _run(connection)


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
