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
    help="How long the old key stays accepted.",
)
def key_rotate(grace_s: float) -> None:
    """Make a new swarm key in the instance folder; the old one stays accepted for a while.

    Every process of a `specpipe up` swarm signs with the new key within a heartbeat. On hosts
    of their own, copy the key file (or set SPECPIPE_SWARM_KEY=NEW,OLD) on each host before
    the grace period ends.
    """
    from specpipe import settings

    if not settings.swarm_keys():
        raise click.ClickException(
            f"no swarm key in {settings.instance_dir()}: `specpipe up` makes one, "
            "or set SPECPIPE_SWARM_KEY"
        )
    try:
        settings.rotate_swarm_key(grace_s)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    path = settings.instance_dir() / settings.SWARM_KEY_FILE
    click.echo(f"new swarm key in {path}; the old one is accepted for {grace_s:g} s more")
