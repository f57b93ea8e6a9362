"""`specpipe token`: API tokens, shown once at creation and stored only hashed. Each belongs to
the user it names, whom the API acts as, and may expire (`--expires`)."""

from __future__ import annotations

from datetime import timedelta

import click

from specpipe.cli.options import store_error, store_session


@click.group(name="token", invoke_without_command=True)
@click.pass_context
def token(ctx: click.Context) -> None:
    """Manage API tokens (lists them when called bare)."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(token_list)


def _lifetime(ctx: click.Context, param: click.Parameter, value: str | None):
    """`--expires` as a timedelta, or a one-line usage error."""
    from models.tokens import parse_lifetime

    if value is None:
        return None
    try:
        return parse_lifetime(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@token.command(name="create")
@click.argument("name")
@click.option(
    "--user",
    "owner",
    metavar="USER",
    required=True,
    help="The user the API acts as with this token.",
)
@click.option(
    "--expires",
    "lifetime",
    metavar="AGE",
    callback=_lifetime,
    help="Stop accepting the token after AGE: minutes, hours or days (90m, 12h, 30d).",
)
def token_create(name: str, owner: str, lifetime: timedelta | None) -> None:
    """Create a token called NAME for USER and print it once.

    Example:

        specpipe token create ci --user alice --expires 30d
    """
    from models.tokens import create_token
    from models.users import find_user

    name = name.strip()
    if not name or len(name) > 100:
        raise click.BadParameter("must be 1 to 100 characters", param_hint="NAME")
    with store_session() as session:
        try:
            user = find_user(session, owner)
            if user is None:
                raise click.ClickException(f"no user named {owner!r}")
            plaintext = create_token(session, name, user, lifetime)
            session.commit()
        except click.ClickException:
            raise
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
        except Exception as exc:  # e.g. the database is not migrated
            raise store_error("create the token", exc) from exc
    click.echo(plaintext)
    click.echo("Store it now: it is not shown again.", err=True)


def _state(row) -> str:
    if row.revoked_at:
        return "revoked"
    return "expired" if row.expired else "active"


def _expiry(row) -> str:
    from models.db import as_utc

    if row.expires_at is None:
        return "never expires"
    when = f"{as_utc(row.expires_at):%Y-%m-%d %H:%M} UTC"
    return f"expired {when}" if row.expired else f"expires {when}"


@token.command(name="list")
def token_list() -> None:
    """List tokens: name, state (active, revoked, expired), owner, created, last used, expiry."""
    from sqlalchemy import select

    from models.db import as_utc
    from models.tokens import ApiToken

    with store_session() as session:
        try:
            rows = session.scalars(select(ApiToken).order_by(ApiToken.name)).all()
        except Exception as exc:  # e.g. the database is not migrated
            raise store_error("read tokens", exc) from exc
        for row in rows:
            used = as_utc(row.last_used_at)
            last = f"{used:%Y-%m-%d %H:%M} UTC" if used else "never used"
            created = f"created {as_utc(row.created_at):%Y-%m-%d}"
            fields = (row.name, _state(row), row.user.name, created, last, _expiry(row))
            click.echo("\t".join(fields))


@token.command(name="revoke")
@click.argument("name")
def token_revoke(name: str) -> None:
    """Revoke the token called NAME; the API refuses it from then on."""
    from models.tokens import revoke_token

    with store_session() as session:
        try:
            revoke_token(session, name)
            session.commit()
        except LookupError as exc:
            raise click.ClickException(str(exc)) from exc
    click.echo(f"revoked {name}")
