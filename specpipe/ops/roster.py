"""Host 0's side of host identities: the coordinator key, and admitting and revoking hosts.

The coordinator key (`settings.coordinator_key_path`, mode 0600) never leaves host 0; its public
half, `coordinator.pub`, goes to every host, which pins it. The roster is kept twice: in host
0's instance folder (`settings.roster_path`, signed like the registry's copy, so a Redis that
lost its data gets it back at the next admission or `specpipe up`), and on the registry, where
every host reads it (`identity.read_roster`). Each change is a new version, so no host goes
back to an older one.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import redis
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from specpipe import settings
from specpipe.ops.redis_server import KEEPER_USER
from specpipe.swarm import credentials, datakeys, identity
from specpipe.swarm.clock import SwarmClock
from specpipe.swarm.identity import Roster, Signer


def init_coordinator(home: Path | None = None) -> Signer:
    """The coordinator's key in `home` (this process's instance folder by default), made when
    there is none, with its public half beside it in `coordinator.pub` (what hosts pin), and
    its sealing key (made too)."""
    identity.ensure_private(settings.coordinator_key_path(home))
    signer = coordinator(home)
    pin = (home or settings.instance_dir()) / settings.COORDINATOR_PUB_FILE
    text = identity.pin_text(signer)
    if not pin.is_file() or pin.read_text().strip() != text:
        pin.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        pin.write_text(text + "\n")
    return signer


def coordinator(home: Path | None = None) -> Signer:
    """The coordinator's key, which must be there (IdentityError naming the file otherwise),
    with its sealing key (made when there is none: host 0 from before data keys)."""
    path = settings.coordinator_key_path(home)
    if not path.exists():
        raise identity.IdentityError(
            f"no coordinator key at {path}: run `specpipe host init` on host 0 first"
        )
    sealing = identity.ensure_private(settings.sealing_key_path(path), X25519PrivateKey)
    return Signer(identity.COORDINATOR, identity.load_private(path), sealing)


def current(client: redis.Redis, swarm: str, signer: Signer, home: Path | None = None) -> Roster:
    """The newest roster of host 0's copy and the registry's (the latter only when this
    coordinator signed it)."""
    kept = identity.load_roster_file(settings.roster_path(swarm, home), swarm, signer)
    value = identity.stored_roster(client, swarm)
    if value is None:
        return kept
    try:
        published = Roster.verified(value, swarm, signer.key.public_key())
    except identity.IdentityError:
        return kept
    return published if published.version > kept.version else kept


@contextmanager
def changing(swarm: str, home: Path | None = None) -> Iterator[None]:
    """Held while one change of the roster reads it and stores the next version: a change made
    meanwhile by another process on host 0 (`host revoke` while the beat rotates) would
    otherwise be lost, a revoked host admitted again."""
    kept = settings.roster_path(swarm, home)
    path = kept.with_name(kept.name + ".lock")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and the lock with it


@contextmanager
def keeping(client: redis.Redis, home: Path | None = None) -> Iterator[redis.Redis]:
    """`client`'s server as host 0's keeper of the registry's users (`KEEPER_USER`), where the
    instance folder (`home`) holds its password; else `client` itself (a Redis whose users
    are all allowed that, as a test's)."""
    password = settings.keeper_password(home)
    if password is None:
        yield client
        return
    pool = client.connection_pool
    options = {**pool.connection_kwargs, "username": KEEPER_USER, "password": password}
    keeper = redis.Redis(
        connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **options)
    )
    try:
        yield keeper
    finally:
        keeper.close()


def store(client: redis.Redis, roster: Roster, signer: Signer, home: Path | None = None) -> None:
    """Keep `roster` in host 0's copy, put it on the registry, and make the registry's host
    users those of the hosts it admits (a revoked host's connections closed at once)."""
    identity.save_roster_file(settings.roster_path(roster.swarm, home), roster, signer)
    identity.publish_roster(client, roster, signer)
    with keeping(client, home) as keeper:
        try:
            credentials.sync(keeper, roster, signer.sealing, SwarmClock(client).now())
        except redis.exceptions.NoPermissionError:
            raise identity.IdentityError(
                "the roster is stored, but the registry's users cannot be kept: host 0's "
                f"instance folder has no {settings.KEEPER_PASSWORD_FILE} of its Redis's "
                'keeper (docs/deploy.md, "Host 0\'s Redis")'
            ) from None


def keep_users(
    client: redis.Redis,
    swarm: str,
    home: Path | None = None,
    quota_bytes: int = credentials.DEFAULT_QUOTA_BYTES,
) -> list[str]:
    """Host 0's beat: a host whose keys take over `quota_bytes` of the registry shut out, and
    the registry's host users in step with the roster (again after a restart of the registry,
    which keeps none). The hosts shut out now."""
    signer = coordinator(home)
    roster = current(client, swarm, signer, home)
    now = SwarmClock(client).now()
    with keeping(client, home) as keeper:
        return credentials.police(keeper, roster, signer.sealing, now, quota_bytes)


def admit(
    client: redis.Redis,
    swarm: str,
    host: str,
    key_hex: str,
    sealing_hex: str | None = None,
    home: Path | None = None,
) -> Roster:
    """Admit `host` under the public key `key_hex` and the sealing key `sealing_hex` (replacing
    its old ones, if any), with its copies of the data keys. A host admitted again under other
    keys rotates the data keys (its old keys may be someone else's now). IdentityError without
    a sealing key where the swarm's messages are sealed with data keys."""
    signer = coordinator(home)
    with changing(swarm, home):
        before = current(client, swarm, signer, home)
        if sealing_hex is None and datakeys.uses_data_keys(before):
            raise identity.IdentityError(
                f"swarm {swarm!r} seals with data keys: admit {host} with both keys that "
                "`specpipe host key` prints there"
            )
        roster = before.admitting(host, key_hex, sealing_hex)
        rekeyed = host in before.hosts and (
            before.hosts[host] != roster.hosts[host]
            or before.sealing.get(host) != roster.sealing.get(host)
        )
        if rekeyed and datakeys.uses_data_keys(before):
            grace_s = datakeys.DEFAULT_GRACE_S
            roster = datakeys.rotated(roster.revoking(host), signer.sealing, grace_s)
            roster = roster.admitting(host, key_hex, sealing_hex)
        roster = datakeys.sealed_for_new_hosts(roster, signer.sealing)
        store(client, roster, signer, home)
    return roster


def revoke(
    client: redis.Redis,
    swarm: str,
    host: str,
    home: Path | None = None,
    grace_s: float = datakeys.DEFAULT_GRACE_S,
) -> Roster:
    """Take `host` out of the roster: from the next read of it, nothing it signs is believed;
    where data keys seal, a new epoch sealed to the remaining hosts only, the previous one
    accepted `grace_s` more seconds (for the rounds in flight)."""
    signer = coordinator(home)
    with changing(swarm, home):
        roster = current(client, swarm, signer, home).revoking(host)
        if datakeys.uses_data_keys(roster):
            roster = datakeys.rotated(roster, signer.sealing, grace_s)
        else:  # the first epoch, if it was the last host without a sealing key
            roster = datakeys.sealed_for_new_hosts(roster, signer.sealing)
        store(client, roster, signer, home)
    return roster


def rotate(
    client: redis.Redis,
    swarm: str,
    home: Path | None = None,
    grace_s: float = datakeys.DEFAULT_GRACE_S,
    every_s: float = 0.0,
) -> Roster | None:
    """A new data key epoch, sealed to the admitted hosts (the previous one accepted `grace_s`
    more seconds); IdentityError when an admitted host has no sealing key. With `every_s`,
    only when the current epoch is that old (host 0's beat): None when it is not, or when the
    swarm has no data keys yet."""
    signer = coordinator(home)
    with changing(swarm, home):
        roster = current(client, swarm, signer, home)
        if every_s and not datakeys.due(roster, every_s):
            return None
        roster = replace(roster, version=roster.version + 1)
        roster = datakeys.rotated(roster, signer.sealing, grace_s)
        store(client, roster, signer, home)
    return roster


def admit_own_hosts(
    client: redis.Redis, swarm: str, hosts: Iterable[str], home: Path | None = None
) -> Roster:
    """For a swarm whose hosts keep their keys in this instance folder (`specpipe up`'s, the
    lab's): the coordinator's keys and each host's made where missing, every host admitted under
    its keys with its copies of the data keys, and the roster published (again: a Redis started
    afresh has none)."""
    signer = init_coordinator(home)
    with changing(swarm, home):
        roster = current(client, swarm, signer, home)
        updated = roster
        for host in hosts:
            path = settings.host_key_path(host, home)
            key = identity.public_hex(identity.ensure_private(path))
            opener = identity.ensure_private(settings.sealing_key_path(path), X25519PrivateKey)
            sealing = identity.public_hex(opener)
            if (roster.hosts.get(host), roster.sealing.get(host)) != (key, sealing):
                updated = updated.admitting(host, key, sealing)
        sealed = datakeys.sealed_for_new_hosts(updated, signer.sealing)
        if sealed != roster:
            sealed = replace(sealed, version=roster.version + 1)
        store(client, sealed, signer, home)
    return sealed
