"""`specpipe token`: API tokens, shown once at creation and stored only hashed. Each belongs to
a user, whom the API acts as."""

from __future__ import annotations

import click

from specpipe.cli.options import store_error, store_session


@click.group(name="token", invoke_without_command=True)
@click.pass_context
def token(ctx: click.Context) -> None:
    """Manage API tokens (lists them when called bare)."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(token_list)


@token.command(name="create")
@click.argument("name")
@click.option(
    "--user",
    "owner",
    metavar="USER",
    help="The user the API acts as with this token (default: the built-in admin).",
)
def token_create(name: str, owner: str | None) -> None:
    """Create a token called NAME and print it once.

    Example:

        specpipe token create ci --user alice
    """
    from models.tokens import create_token
    from models.users import find_user

    name = name.strip()
    if not name or len(name) > 100:
        raise click.BadParameter("must be 1 to 100 characters", param_hint="NAME")
    with store_session() as session:
        try:
            user = None
            if owner is not None:
                user = find_user(session, owner)
                if user is None:
                    raise click.ClickException(f"no user named {owner!r}")
            plaintext = create_token(session, name, user)
            session.commit()
        except click.ClickException:
            raise
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
        except Exception as exc:  # e.g. the database is not migrated
            raise store_error("create the token", exc) from exc
    click.echo(plaintext)
    click.echo("Store it now: it is not shown again.", err=True)


@token.command(name="list")
def token_list() -> None:
    """List tokens: name, owner, created, last used, and whether revoked."""
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
            state = "revoked" if row.revoked_at else "active"
            last = f"{used:%Y-%m-%d %H:%M} UTC" if used else "never used"
            created = f"created {as_utc(row.created_at):%Y-%m-%d}"
            click.echo(f"{row.name}\t{state}\t{row.user.name}\t{created}\t{last}")


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
