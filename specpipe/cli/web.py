"""`specpipe web`: serve the web app and API with waitress."""

from __future__ import annotations

import click


@click.command(name="web")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--threads", default=8, show_default=True, type=click.IntRange(1, 64))
@click.option(
    "--migrate/--no-migrate",
    default=True,
    show_default=True,
    help="Upgrade the database to the latest schema first.",
)
def web(host: str, port: int, threads: int, migrate: bool) -> None:
    """Serve the web app (forms, history, proofs, nodes, /api/v1).

    Uses SECRET_KEY, else the key kept in the instance folder, generating it on first start.

    Example:

        specpipe web --host 0.0.0.0 --port 8000
    """
    import waitress

    from specpipe import settings

    settings.ensure_secret_key()
    if migrate:
        from models import migrate as migrations

        try:
            migrations.upgrade(settings.database_url())
        except Exception as exc:  # an unreachable or broken database is one line
            raise click.ClickException(f"could not migrate the database: {exc}") from exc
    from app import create_app

    click.echo(f"specpipe web on http://{host}:{port}/")
    waitress.serve(create_app(), host=host, port=port, threads=threads, ident="specpipe")
