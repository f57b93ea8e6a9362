"""`specpipe host`: host identities. Each host's own signing key, and on host 0 the coordinator
key and the roster of admitted hosts (`specpipe.swarm.identity`, `specpipe.ops.roster`)."""

from __future__ import annotations

from pathlib import Path

import click


@click.group(name="host")
def host() -> None:
    """Host identities: this host's key, and (on host 0) admitting and revoking hosts."""


@host.command(name="init")
def host_init() -> None:
    """On host 0: make the coordinator's key (once) and print its public key.

    Copy the `coordinator.pub` it writes into every other host's TLS folder (beside `ca.pem`):
    each host then believes only what the coordinator and the hosts it admits sign.
    """
    from specpipe import settings
    from specpipe.ops import roster
    from specpipe.swarm import identity
    from specpipe.swarm.identity import IdentityError

    try:
        signer = roster.init_coordinator()
    except IdentityError as exc:
        raise click.ClickException(str(exc)) from None
    pin = settings.instance_dir() / settings.COORDINATOR_PUB_FILE
    click.echo(f"coordinator key in {settings.coordinator_key_path()}; public key in {pin}:")
    click.echo(identity.pin_text(signer))


@host.command(name="key")
@click.option("--host", "host_name", required=True, help="This host's name in the swarm.")
def host_key(host_name: str) -> None:
    """Print this host's public keys, for host 0 to admit: the signing key, then the sealing key
    that its copies of the data keys are sealed to (both made on first use, mode 0600).

    Example:

        specpipe host key --host mn
    """
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from specpipe import settings
    from specpipe.swarm import identity

    try:
        identity.check_host_name(host_name)
        path = settings.host_key_path(host_name)
        key = identity.ensure_private(path)
        sealing = identity.ensure_private(settings.sealing_key_path(path), X25519PrivateKey)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{identity.public_hex(key)} {identity.public_hex(sealing)}")


GRACE = click.option(
    "--grace-s",
    default=300.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="How long the data key sealing until now stays accepted, for the rounds in flight.",
)


@host.command(name="admit")
@click.argument("name")
@click.argument("public_key")
@click.argument("sealing_key", required=False)
def host_admit(name: str, public_key: str, sealing_key: str | None) -> None:
    """On host 0: admit host NAME under PUBLIC_KEY and SEALING_KEY (the two keys `specpipe host
    key` printed there).

    The roster is published on the registry (REDIS_URL) at once, with the host's copies of the
    data keys; a host already admitted gets its new keys (and the data keys are rotated).
    Example:

        specpipe host admit mn 3b6a27bc...e1f2 9c04d1aa...07b3
    """
    from specpipe.ops import roster

    _on_registry(lambda client, swarm: roster.admit(client, swarm, name, public_key, sealing_key))
    click.echo(f"admitted {name}")


@host.command(name="revoke")
@click.argument("name")
@GRACE
def host_revoke(name: str, grace_s: float) -> None:
    """On host 0: revoke host NAME. From the next read of the roster (within a heartbeat) its
    records are ignored, its messages refused, and jobs route around it; its registry user is
    deleted at once; the data keys are rotated, the new one sealed to the remaining hosts only.
    An open invitation for NAME is withdrawn too."""
    from specpipe.ops import invitations, roster

    def revoke(client, swarm):
        withdrawn = invitations.withdraw(client, swarm, name)
        if withdrawn:
            click.echo(f"withdrew the invitation of {name}")
        if withdrawn and name not in roster.current(client, swarm, roster.coordinator()).hosts:
            return
        roster.revoke(client, swarm, name, grace_s=grace_s)
        click.echo(f"revoked {name}")

    _on_registry(revoke)


@host.command(name="rotate")
@GRACE
def host_rotate(grace_s: float) -> None:
    """On host 0: a new data key now, sealed to every admitted host; the one before stays
    accepted for --grace-s. (Host 0's beat makes one when the current one is
    SPECPIPE_DATA_KEY_EPOCH_S old, a day by default.)"""
    from specpipe.ops import roster

    def rotate(client, swarm):
        epoch = roster.rotate(client, swarm, grace_s=grace_s).epoch
        click.echo(f"data key epoch {epoch.number}")

    _on_registry(rotate)


def _lifetime(ctx: click.Context, param: click.Parameter, value: str) -> float:
    """`--expires` in seconds, or a one-line usage error."""
    from models.tokens import parse_lifetime

    try:
        return parse_lifetime(value).total_seconds()
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@host.command(name="invite")
@click.argument("name")
@click.option("--layers", help="The layers it is to serve (A:B); default: it chooses (auto).")
@click.option(
    "--expires",
    "expires_s",
    default="1h",
    show_default=True,
    metavar="AGE",
    callback=_lifetime,
    help="How long the invitation can be used (once): minutes, hours or days (30m, 12h, 2d).",
)
@click.option(
    "--registry",
    "registry_url",
    help="The registry's address as the other hosts reach it; default: REDIS_URL's, without "
    "its user and password.",
)
@click.option(
    "--ca-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="The swarm CA's folder (`specpipe ca init`); default: the instance folder's `ca`.",
)
def host_invite(
    name: str, layers: str | None, expires_s: float, registry_url: str | None, ca_dir: Path | None
) -> None:
    """On host 0: invite a new host NAME, and print one line for it to join with.

    On the new host, `specpipe join TOKEN` makes its keys, is admitted, gets its certificate
    and what the swarm's hosts share, and serves: host 0's beat answers it within a beat. The
    line works once, until it expires. Example:

        specpipe host invite mn --layers 9:18
    """
    from specpipe import settings
    from specpipe.cli.ca import ca_dir_or_default
    from specpipe.cli.options import layer_range
    from specpipe.ops import certificates, invitations

    if layers is not None:
        layer_range(None, None, layers)  # a usage error for a malformed range
    ca = certificates.Authority.in_dir(ca_dir_or_default(ca_dir))
    if not ca.cert.exists():
        raise click.ClickException(
            f"no swarm CA in {ca.cert.parent}: `specpipe ca init` there first (or --ca-dir)"
        )
    registry = registry_url or settings.redis_url()

    def make(client, swarm):
        invitation = invitations.invite(
            client,
            swarm,
            name,
            registry=registry,
            ca=ca,
            expires_s=expires_s,
            layers=layers,
        )
        click.echo(invitation.token())

    _on_registry(make)


@host.command(name="list")
def host_list() -> None:
    """On host 0: the admitted hosts and their public keys, and the roster's version."""
    from specpipe.ops import roster

    def show(client, swarm):
        current = roster.current(client, swarm, roster.coordinator())
        epoch = f", data key epoch {current.epoch.number}" if current.epoch else ""
        click.echo(f"roster of swarm {swarm!r}, version {current.version}{epoch}")
        for name, key in sorted(current.hosts.items()):
            click.echo(f"{name}  {key} {current.sealing.get(name, '')}".rstrip())

    _on_registry(show)


def _on_registry(change) -> None:
    """`change(client, swarm)` on the swarm's registry, any failure one line."""
    import redis

    from specpipe import settings
    from specpipe.swarm.redact import redact_url

    url, swarm = settings.redis_url(), settings.swarm_name()
    client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=5)
    try:
        change(client, swarm)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    except redis.RedisError as exc:
        where = redact_url(url)
        raise click.ClickException(f"cannot reach the registry at {where}: {exc}") from None
    finally:
        client.close()
