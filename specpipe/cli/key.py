"""`specpipe key`: the swarm key that signs the data plane and the inventory."""

from __future__ import annotations

import click


@click.group(name="key")
def key() -> None:
    """Manage the swarm key."""


@key.command(name="rotate")
@click.option(
    "--grace-s",
    default=3600.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="How long the key signing until now stays accepted (an older key's deadline is "
    "never moved later).",
)
@click.option(
    "--revoke",
    is_flag=True,
    help="Accept no old key from now on (after a leak): hosts without the new key drop out.",
)
@click.pass_context
def key_rotate(ctx: click.Context, grace_s: float, revoke: bool) -> None:
    """Make a new swarm key in the key file; the old one stays accepted for a while.

    Every process of a `specpipe up` swarm signs with the new key within a heartbeat, and
    stops accepting an old key when its deadline passes (at once with --revoke). On hosts of
    their own, copy the key file (or set SPECPIPE_SWARM_KEY=NEW,OLD@UNTIL) on each host
    before the grace period ends.
    """
    from specpipe import settings

    if revoke and ctx.get_parameter_source("grace_s") is not click.core.ParameterSource.DEFAULT:
        raise click.UsageError("--revoke keeps no old key: leave out --grace-s")
    try:
        if not settings.swarm_keys():
            raise click.ClickException(
                f"no swarm key in {settings.swarm_key_path()}: `specpipe up` makes one, "
                "or set SPECPIPE_SWARM_KEY"
            )
        settings.rotate_swarm_key(grace_s, revoke=revoke)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    path = settings.swarm_key_path()
    if revoke:
        click.echo(f"new swarm key in {path}; no old key is accepted")
    else:
        click.echo(f"new swarm key in {path}; old keys are accepted for {grace_s:g} s more at most")
