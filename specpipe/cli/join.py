"""`specpipe join`: one command on a new host joins a running swarm as a stage.

The Redis it starts speaks TLS only, with the certificate `specpipe ca issue` made for this
host (its TLS folder: `redis.pem`, `redis.key`, `ca.pem`); without one it refuses, unless the
operator opts out out loud (`--insecure-no-tls`); and, as every swarm process does
(`specpipe.swarm.trust.check_pinned`), it refuses to serve on a host that pins no coordinator
key unless the operator opts out as loudly (`--insecure-shared-key`).
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import click

from specpipe.cli.checkpoints import ModelInputError
from specpipe.cli.options import compute_options, layer_range
from specpipe.cli.worker import configure_logging, serve_stage, swarm_keyring

if TYPE_CHECKING:
    from specpipe.ops.redis_server import RedisServer, TlsFiles
    from specpipe.settings import Settings
    from specpipe.swarm.inventory import Inventory
    from specpipe.swarm.wire import Keyring

log = logging.getLogger("specpipe.join")


def _layers(ctx, param, value: str) -> tuple[int, int] | None:
    """None for `auto`, else the range A:B."""
    return None if value.strip().lower() == "auto" else layer_range(ctx, param, value)


def address_towards(url: str) -> str:
    """The address of this host's interface that reaches the Redis at `url` (the one the
    other hosts of the swarm reach this host at); 127.0.0.1 for a local socket."""
    parsed = urlparse(url)
    if parsed.scheme == "unix" or not parsed.hostname:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((parsed.hostname, parsed.port or 6379))  # no packet is sent
        return probe.getsockname()[0]


def tls_files(folder: Path) -> TlsFiles:
    """This host's TLS files in `folder`; a one-line ClickException naming what is missing and
    how to make it."""
    from specpipe.ops.certificates import host_files

    files = host_files(folder)
    missing = [path.name for path in (files.cert, files.key, files.ca) if not path.is_file()]
    if missing:
        raise click.ClickException(
            f"no TLS files for this host's Redis in {folder} (missing {', '.join(missing)}): "
            "make them where the swarm's CA is with `specpipe ca issue --address ADDRESS` and "
            "copy that folder here (or pass --tls-dir), or pass --insecure-no-tls to serve "
            "in clear"
        )
    return files


def warn_if_in_clear(url: str) -> None:
    """Log a warning when the Redis at `url`, given by the operator, is reached in clear from
    another host: a `redis://` URL of an address other than loopback."""
    from specpipe.ops.redis_server import is_loopback
    from specpipe.swarm.redact import redact_url

    parsed = urlparse(url)
    if parsed.scheme == "redis" and not is_loopback(parsed.hostname or "localhost"):
        log.warning(
            "this host's Redis %s is not TLS (rediss://): links to this host are in clear",
            redact_url(url),
        )


def check_link(redis_url: str | None, tls: TlsFiles | None, address: str, port: int) -> None:
    """Before serving: with the operator's Redis at `redis_url`, a warning when it is in clear;
    else, for the one started on `address`:`port`, a warning when it is without TLS, or a
    one-line ClickException unless the certificate in `tls` fits `address`."""
    from specpipe.ops.certificates import CaError, check_host_files

    if redis_url is not None:
        warn_if_in_clear(redis_url)  # the operator's Redis, their choice
    elif tls is None:
        log.warning(
            "--insecure-no-tls: this host's Redis on %s:%d speaks plain text, so links to this "
            "host are in clear: the Redis passwords other hosts send here can be read on the "
            "way, and what passes held back or changed (what the swarm key seals stays sealed)",
            address,
            port,
        )
    else:
        try:
            check_host_files(tls, address)
        except CaError as exc:
            raise click.ClickException(
                f"{exc}: issue this host's with `specpipe ca issue --address {address}`"
            ) from None


@click.command(name="join")
@click.argument("token", required=False)
@click.option(
    "--registry",
    "registry_url",
    default=None,
    help="The swarm's registry Redis; default: SPECPIPE_REGISTRY_URL (which keeps "
    "its password off the command line).",
)
@click.option(
    "--layers",
    default="auto",
    show_default=True,
    callback=_layers,
    help="A:B, or auto: the first range nobody serves, else a spare for the busiest.",
)
@click.option(
    "--host",
    "host_name",
    default=None,
    help="This stage's name in the inventory [default: the machine's hostname].",
)
@click.option(
    "--model",
    "model_name",
    default=None,
    help="The swarm's model, as a checkpoint this host has [default: "
    "SPECPIPE_MODEL, else the embedded default].",
)
@click.option(
    "--redis",
    "redis_url",
    default=None,
    help="This host's Redis, used as given; default: REDIS_URL, else one started here with "
    "a password and TLS, on --address:--port.",
)
@click.option(
    "--tls-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="This host's TLS folder, as `specpipe ca issue` writes it (redis.pem, redis.key, "
    "ca.pem) [default: SPECPIPE_TLS_DIR, else <instance>/tls].",
)
@click.option(
    "--insecure-no-tls",
    is_flag=True,
    help="Start this host's Redis without TLS: every link to this host in clear (a warning "
    "at every start).",
)
@click.option(
    "--insecure-shared-key",
    is_flag=True,
    help="Serve on a host that pins no coordinator key: every holder of the swarm key may "
    "speak here as the coordinator or as any host (a warning at every start; also "
    "SPECPIPE_INSECURE_SHARED_KEY=1).",
)
@click.option(
    "--address",
    default=None,
    help="Where the other hosts reach this one [default: this host's address "
    "towards the registry].",
)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=6379,
    show_default=True,
    help="Port of the Redis started here.",
)
@click.option(
    "--accept-backported-redis",
    is_flag=True,
    help="Let the Redis started here serve other hosts although its release predates the fixes "
    "for its Lua code-execution bugs, because its distribution backported them (a warning at "
    "every start; also SPECPIPE_ACCEPT_BACKPORTED_REDIS=1).",
)
@click.option("--geo", default="", help="Location label to record (e.g. WA).")
@compute_options
def join(
    token: str | None,
    registry_url: str | None,
    layers: tuple[int, int] | None,
    host_name: str | None,
    model_name: str | None,
    redis_url: str | None,
    tls_dir: Path | None,
    insecure_no_tls: bool,
    insecure_shared_key: bool,
    address: str | None,
    port: int,
    accept_backported_redis: bool,
    geo: str,
    threads: int | None,
    dtype: str,
    device: str,
) -> None:
    """Join the swarm whose registry is REGISTRY as a stage, and serve until stopped.

    The swarm key comes from SPECPIPE_SWARM_KEY or the file SPECPIPE_SWARM_KEY_FILE names.
    Uses this host's Redis (--redis, REDIS_URL) or starts one, locked down: TLS only, with the
    certificate in this host's TLS folder (`specpipe ca issue` makes it); its own user with a
    password kept in the instance folder that never leaves this host, and the other hosts' peer
    user with the swarm's data-plane password (SPECPIPE_REDIS_PASSWORD_FILE, or the instance
    folder's); signs as this host with its own key, once host 0 admitted it (`specpipe host
    key` prints it, `specpipe host admit` on host 0), pinning the coordinator's key
    (coordinator.pub in the TLS folder); chooses a layer range (--layers, or auto); registers
    with the address the other hosts reach it at; Ctrl-C or SIGTERM leaves the swarm.

    With TOKEN (the line `specpipe host invite` printed on host 0), all of that comes with the
    invitation: this host's keys are made and admitted, its certificate signed, and what the
    swarm's hosts share kept in the instance folder, so that a later `specpipe join` without
    it serves again. Example:

        SPECPIPE_HOME=/var/lib/specpipe specpipe join specpipe-join-1:eyJjYSI6...

    Or, in the environment docs/deploy.md sets up, with this host's TLS folder
    (/var/lib/specpipe/tls) as `specpipe ca issue` made it, and host 0's coordinator.pub:

        SPECPIPE_HOME=/var/lib/specpipe specpipe join --layers auto
    """
    from specpipe import settings
    from specpipe.swarm.redact import redact_url

    if token is not None:
        host_name, address, invited = accept_invitation(token, host_name, address, tls_dir)
        layers = layers or invited
    model_name = model_name or settings.default_model()
    config = settings.Settings.from_env()
    registry_url = registry_url or settings.registry_url()
    if not registry_url:
        raise click.ClickException("no registry: pass --registry URL or set SPECPIPE_REGISTRY_URL")
    redis_url = redis_url or settings.configured_redis_url()
    config, folder = with_tls_folder(config, tls_dir, insecure_shared_key)
    if not config.swarm_key and config.coordinator_public_key is None:
        raise click.ClickException(  # only a swarm without host identities seals with one
            "no swarm key: set SPECPIPE_SWARM_KEY or SPECPIPE_SWARM_KEY_FILE"
        )
    tls = None
    if redis_url is None and not insecure_no_tls:
        tls = tls_files(folder)
    configure_logging()
    check_pinned(config)
    host_name = host_name or socket.gethostname().split(".")[0]
    keys = swarm_keyring(config, host_name)  # this host's own key, made on first use
    registry_url = own_registry_url(config, host_name, keys, registry_url)
    n_layers, label = model_layers(model_name)
    found = read_inventory(registry_url, config.swarm, keys)
    check_admitted(host_name, keys, found.roster)
    check_name_free(host_name, found)
    if layers is None:
        start, end, why = auto_layers(found, n_layers, label, config, registry_url, host_name)
    else:
        start, end = layers
        if end > n_layers:
            raise click.BadParameter(f"{label} has {n_layers} layers", param_hint="--layers")
        why = "as asked"
    address = address or address_towards(registry_url)
    server = None
    check_link(redis_url, tls, address, port)
    if redis_url is None:
        shared = config.coordinator_public_key is None  # a swarm without host identities
        server = own_redis(address, port, tls, accept_backported_redis, shared)
        redis_url = start_redis(server)
    click.echo(
        f"joining swarm {config.swarm!r} as {host_name}: layers {start}:{end} ({why}), "
        f"Redis {redact_url(redis_url)}"
    )
    try:
        serve_stage(
            host_name,
            (start, end),
            model_name,
            redis_url=redis_url,
            registry_url=registry_url,
            public_ip=address,
            geo=geo,
            dtype=dtype,
            device=device,
            threads=threads,
            config=config,
        )
    finally:
        if server is not None:
            server.stop()


def accept_invitation(
    token: str, host_name: str | None, address: str | None, tls_dir: Path | None
) -> tuple[str, str, tuple[int, int] | None]:
    """Redeem the invitation `token` (`specpipe.ops.invitations`): this host's keys made, its
    request answered by host 0, what came kept in the instance folder and the TLS folder. The
    host's name and address (as its certificate names them), and the layers it was invited to
    serve; a one-line ClickException for an invitation that does not work."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from specpipe import settings
    from specpipe.ops import invitations
    from specpipe.swarm import identity

    try:
        invitation = invitations.parse(token)
        if settings.swarm_name() not in (settings.DEFAULT_SWARM, invitation.swarm):
            raise invitations.InvitationError(
                f"the invitation is to swarm {invitation.swarm!r}, but SPECPIPE_SWARM (or this "
                f"instance folder) names {settings.swarm_name()!r}"
            )
        if host_name not in (None, invitation.host):
            raise invitations.InvitationError(
                f"the invitation is for host {invitation.host!r}, not {host_name!r}"
            )
        path = settings.host_key_path(invitation.host)
        key = identity.ensure_private(path)
        sealing = identity.ensure_private(settings.sealing_key_path(path), X25519PrivateKey)
        signer = identity.Signer(invitation.host, key, sealing)
        address = address or address_towards(invitation.registry)
        tls_key = ec.generate_private_key(ec.SECP256R1())
        click.echo(f"redeeming the invitation of {invitation.host} at {invitation.registry}")
        answer = invitations.redeem(invitation, signer, tls_key, address)
        folder = tls_dir.resolve() if tls_dir else settings.tls_dir()
        invitations.keep(invitation, answer, tls_key, settings.instance_dir(), folder)
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    layers = _layers(None, None, answer.layers) if answer.layers else None
    return invitation.host, address, layers


def with_tls_folder(
    config: Settings, tls_dir: Path | None, insecure_shared_key: bool
) -> tuple[Settings, Path]:
    """`config` with this host's TLS folder (`tls_dir`, else the default) and the operator's
    opt-out; the folder. A `tls_dir` given also holds the CA copy this host verifies the others
    against and the coordinator key it pins, where they are there."""
    from dataclasses import replace

    from specpipe import settings

    folder = tls_dir.resolve() if tls_dir else settings.tls_dir()
    config = replace(
        config,
        tls_dir=folder,
        insecure_shared_key=config.insecure_shared_key or insecure_shared_key,
    )
    if tls_dir is not None:  # this host verifies the others against the CA copy there
        ca_copy = folder / settings.CA_CERT_FILE
        config = replace(config, tls_ca=str(ca_copy) if ca_copy.is_file() else None)
        pin = folder / settings.COORDINATOR_PUB_FILE  # and pins the coordinator key there
        if pin.is_file():
            config = replace(config, coordinator_public_key=pin.read_text().strip())
    return config, folder


def model_layers(model_name: str) -> tuple[int, str]:
    """The number of layers of `model_name` and its label; a one-line error if it cannot be
    opened."""
    from specpipe.transformer.errors import ModelError
    from specpipe.transformer.resolve import model_label, open_checkpoint

    try:
        return open_checkpoint(model_name).config.n_layers, model_label(model_name)
    except ModelError as exc:
        raise ModelInputError(str(exc)) from None


def read_inventory(registry_url: str, swarm: str, keys: Keyring) -> Inventory:
    """The swarm's inventory as the registry at `registry_url` holds it; a one-line
    ClickException if it cannot be read."""
    import redis

    from specpipe.swarm import inventory

    client = redis.Redis.from_url(registry_url, socket_connect_timeout=5, socket_timeout=5)
    try:
        return inventory.read(client, swarm, keys)
    except redis.RedisError as exc:
        raise click.ClickException(f"cannot read the inventory: {exc}") from None
    finally:
        client.close()


def check_name_free(host_name: str, found: Inventory) -> None:
    """A one-line ClickException when a live host already serves under `host_name`; a name
    whose heartbeat lapsed (that host died) may be taken again."""
    taken = [n for n in found.nodes if n.host == host_name and not n.lapsed(found.now)]
    if taken:
        raise click.ClickException(
            f"a host named {host_name!r} already serves layers {taken[0].layers}: pass --host"
        )


def auto_layers(
    found: Inventory,
    n_layers: int,
    label: str,
    config: Settings,
    registry_url: str,
    host_name: str | None = None,
) -> tuple[int, int, str]:
    """The layer range to serve when asked for `auto`, and why (`inventory.choose_layers`,
    weighing the rounds each stage has processed, from its own Redis)."""
    from specpipe.swarm import inventory, streams
    from specpipe.swarm.dialing import Dialer

    stats = streams.read_stages_stats(
        [(n.host, n.redis_url) for n in found.nodes],
        config.swarm,
        dialer=Dialer.for_settings(config, registry_url, as_host=host_name),
        roster=found.roster,
    )
    load = {host: int(stat.get("processed", 0)) for host, stat in stats.items() if stat}
    return inventory.choose_layers(found.nodes, n_layers, label, load, found.now)


def own_redis(
    address: str, port: int, tls: TlsFiles | None, accept_backported: bool, shared: bool = False
) -> RedisServer:
    """The Redis this host starts on `address`:`port`: its own user's password and its
    keeper's stay here; the stage makes each other host a user of its own there
    (`specpipe.swarm.peering`), or, in a swarm without host identities (`shared`), the other
    hosts dial it with the swarm-wide data-plane password."""
    from specpipe import settings
    from specpipe.ops.redis_server import RedisServer

    return RedisServer(
        port=port,
        host=address,
        password=settings.ensure_local_redis_password(),
        data_dir=settings.instance_dir() / "redis",
        maxmemory=settings.redis_maxmemory(),
        tls=tls,
        accept_backported=accept_backported or settings.accept_backported_redis(),
        peer_password=settings.ensure_redis_password() if shared else None,
        keeper_password=settings.ensure_keeper_password(),
    )


def start_redis(server: RedisServer) -> str:
    """Start `server`; the URL this host's processes reach it at. A one-line ClickException if
    it cannot start."""
    from specpipe.ops.redis_server import RedisUnavailable

    try:
        return server.start()
    except RedisUnavailable as exc:
        raise click.ClickException(str(exc)) from None


def check_pinned(config: Settings) -> None:
    """Before anything is read or made: the refusal every swarm process gives on a host that
    pins no coordinator key without the opt-out (`trust.check_pinned`), as a one-line
    ClickException."""
    from specpipe.swarm import identity, trust

    try:
        trust.check_pinned(config)
    except identity.IdentityError as exc:
        raise click.ClickException(str(exc)) from None


def own_registry_url(config: Settings, host_name: str, keys: Keyring, url: str) -> str:
    """`url`, the registry, as this host dials it: as its own user (`trust.registry_url`); a
    one-line ClickException when it cannot be reached, or refuses that user (host 0 made it
    none: this host is not admitted, and the line says what to run there)."""
    import redis

    from specpipe.swarm import trust
    from specpipe.swarm.redact import redact_url

    own = trust.registry_url(config, host_name, url)
    client = redis.Redis.from_url(own, socket_connect_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        if own != url and isinstance(exc, redis.AuthenticationError):
            check_admitted(host_name, keys, None)
        where = redact_url(own)
        raise click.ClickException(f"cannot reach the registry at {where}: {exc}") from None
    finally:
        client.close()
    return own


def check_admitted(host_name: str, keys, roster) -> None:
    """A one-line ClickException unless host 0 admitted `host_name` under this host's key (what
    to run there, if not); nothing to check on a host that pins no coordinator key."""
    if keys.coordinator is None:
        return
    from specpipe.swarm import identity

    mine = keys.signer.public_hex
    sealing = identity.public_hex(keys.signer.sealing)
    admitted = roster.sealing.get(host_name) if roster is not None else None
    if (
        roster is None
        or roster.hosts.get(host_name) != mine
        or admitted not in (None, sealing)
        or (admitted is None and roster.epoch is not None)  # data keys seal: it needs a copy
    ):
        raise click.ClickException(
            f"host {host_name!r} is not admitted under this host's keys: on host 0 run "
            f"`specpipe host admit {host_name} {mine} {sealing}`"
        )
