"""`specpipe user`: the people who log in to the web app, with hashed passwords."""

from __future__ import annotations

import sys

import click

from specpipe.cli.options import store_error, store_session


def read_password() -> str:
    """A new password: one line of standard input when it is not a terminal, else typed twice
    at a hidden prompt."""
    from getpass import getpass

    if not sys.stdin.isatty():
        line = sys.stdin.readline()
        if not line:
            raise click.ClickException("no password on standard input")
        return line.rstrip("\r\n")
    first = getpass("Password: ")
    if getpass("Repeat the password: ") != first:
        raise click.ClickException("the two passwords differ")
    return first


def _checked_password() -> str:
    from models.users import check_password

    try:
        return check_password(read_password())
    except ValueError as exc:
        raise click.ClickException(f"the password {exc}") from None


def _existing_user(session, name: str):
    """The user called `name`, else a one-line error."""
    from models.users import find_user

    try:
        row = find_user(session, name)
    except Exception as exc:  # e.g. the database is not migrated
        raise store_error("read users", exc) from None
    if row is None:
        raise click.ClickException(f"no user named {name!r}")
    return row


def _tokens_revoked(count: int) -> str:
    return f"{count} API token{'s' if count != 1 else ''} revoked"


@click.group(name="user", invoke_without_command=True)
@click.pass_context
def user(ctx: click.Context) -> None:
    """Manage the web app's users (lists them when called bare)."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(user_list)


@user.command(name="create")
@click.argument("name")
@click.option("--admin", is_flag=True, help="An admin sees and acts on every user's jobs.")
def user_create(name: str, admin: bool) -> None:
    """Create a user called NAME; the password is read from standard input (one line) or, at a
    terminal, typed twice.

    Example:

        specpipe user create alice
        printf '%s\\n' "$PASSWORD" | specpipe user create ci-bot
    """
    from models.users import check_name, create_user

    try:
        check_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="NAME") from None
    password = _checked_password()
    with store_session() as session:
        try:
            create_user(session, name, password, is_admin=admin)
            session.commit()
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
        except Exception as exc:  # e.g. the database is not migrated
            raise store_error("create the user", exc) from None
    click.echo(f"created {'admin ' if admin else ''}{name}")


@user.command(name="list")
def user_list() -> None:
    """List users: name, role, enabled or disabled (since when), created, and whether they
    can log in."""
    from sqlalchemy import select

    from models.db import as_utc
    from models.users import User

    with store_session() as session:
        try:
            rows = session.scalars(select(User).order_by(User.name)).all()
        except Exception as exc:  # e.g. the database is not migrated
            raise store_error("read users", exc) from None
        for row in rows:
            role = "admin" if row.is_admin else "user"
            state = f"disabled {as_utc(row.disabled_at):%Y-%m-%d}" if row.disabled else "enabled"
            created = f"created {as_utc(row.created_at):%Y-%m-%d}"
            login = "" if row.has_password else "\tno password (specpipe user passwd)"
            click.echo(f"{row.name}\t{role}\t{state}\t{created}{login}")


@user.command(name="passwd")
@click.argument("name")
def user_passwd(name: str) -> None:
    """Set NAME's password (read as for `create`); its open sessions end and its API tokens
    are revoked."""
    from models.accounts import change_password
    from models.users import BUILTIN_ADMIN
    from specpipe.settings import admin_password_file

    with store_session() as session:
        row = _existing_user(session, name)
        revoked = change_password(session, row, _checked_password())
        session.commit()
    if row.name == BUILTIN_ADMIN:
        admin_password_file().unlink(missing_ok=True)  # the generated one no longer works
    tokens = f"; {_tokens_revoked(revoked)}" if revoked else ""
    click.echo(f"password set for {name}{tokens}")


@user.command(name="disable")
@click.argument("name")
def user_disable(name: str) -> None:
    """Disable NAME: it can no longer log in, its open sessions end at their next request, and
    its API tokens are revoked for good (`enable` does not bring them back). Its queued and
    running jobs go on. The last enabled admin cannot be disabled."""
    from models.accounts import disable_user

    with store_session() as session:
        row = _existing_user(session, name)
        try:
            revoked = disable_user(session, row)
            session.commit()
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
    click.echo(f"disabled {name}; {_tokens_revoked(revoked)} (enabling does not restore them)")


@user.command(name="enable")
@click.argument("name")
def user_enable(name: str) -> None:
    """Let NAME log in again. Its API tokens revoked when it was disabled stay revoked: make new
    ones with `specpipe token create`."""
    from models.accounts import enable_user

    with store_session() as session:
        row = _existing_user(session, name)
        try:
            enable_user(session, row)
            session.commit()
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
    click.echo(f"enabled {name}; its revoked API tokens stay revoked (specpipe token create)")


@user.command(name="delete")
@click.argument("name")
def user_delete(name: str) -> None:
    """Delete NAME and its API tokens; its jobs go to the built-in admin."""
    from models.user_deletion import delete_user

    with store_session() as session:
        try:
            moved = delete_user(session, name)
            session.commit()
        except (LookupError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
        except Exception as exc:  # e.g. the database is not migrated
            raise store_error("delete the user", exc) from None
    click.echo(f"deleted {name}; {moved} job{'s' if moved != 1 else ''} now belong to admin")
