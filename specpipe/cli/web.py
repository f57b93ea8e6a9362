"""`specpipe web`: serve the web app and API with waitress."""

from __future__ import annotations

import click

from specpipe.cli.options import store_error

# Idle keep-alive connections and those waiting for a thread, beyond one per thread.
CONNECTIONS_BESIDE_THREADS = 100


@click.command(name="web")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option(
    "--threads",
    default=8,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Threads for pages and API calls; each open /v1 completion the app allows "
    "(SPECPIPE_OPEN_COMPLETIONS) has one more of its own.",
)
@click.option(
    "--migrate/--no-migrate",
    default=True,
    show_default=True,
    help="Upgrade the database to the latest schema first.",
)
def web(host: str, port: int, threads: int, migrate: bool) -> None:
    """Serve the web app (forms, history, proofs, nodes, /api/v1).

    Uses SECRET_KEY, else the key kept in the instance folder, generating it on first start.
    While no user has a password, it gives the built-in `admin` one and leaves it in the
    instance folder (admin_password, mode 0600).

    Example:

        specpipe web --host 0.0.0.0 --port 8000
    """
    import waitress

    from specpipe import settings

    settings.ensure_secret_key()
    from app import create_app

    try:
        app = create_app()
    except ValueError as exc:  # a malformed setting, told before anything else is done
        raise click.ClickException(str(exc)) from None
    if migrate:
        from models import migrate as migrations

        try:
            migrations.upgrade(settings.database_url())
        except Exception as exc:  # an unreachable or broken database is one line
            raise store_error("migrate the database", exc) from exc
    first_login()
    # A thread for each completion the app may hold open, so those never take the threads
    # the pages need; connections to match, since each holds one.
    all_threads = threads + app.config["OPEN_COMPLETIONS"]
    click.echo(f"specpipe web on http://{host}:{port}/")
    waitress.serve(
        app,
        host=host,
        port=port,
        threads=all_threads,
        connection_limit=all_threads + CONNECTIONS_BESIDE_THREADS,
        channel_request_lookahead=1,  # so a wait learns when its client hung up
        ident="specpipe",
    )


def first_login() -> None:
    """Make sure someone can log in: while no user has a password, the built-in admin gets a
    generated one, written owner-only to the instance folder."""
    import secrets

    from models.db import session_scope
    from models.users import BUILTIN_ADMIN, first_password
    from specpipe import settings

    password = secrets.token_urlsafe(18)
    try:
        with session_scope(settings.database_url()) as session:
            if not first_password(session, password):
                return
            path = settings.write_admin_password(password)  # before the commit makes it count
    except Exception as exc:  # an unreachable or unmigrated database is one line
        raise store_error("read the users", exc) from exc
    click.echo(
        f"specpipe web: log in as {BUILTIN_ADMIN!r} with the password in {path} "
        f"(change it with `specpipe user passwd {BUILTIN_ADMIN}`)"
    )
