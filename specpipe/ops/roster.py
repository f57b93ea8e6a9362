"""Host 0's side of host identities: the coordinator key, and admitting and revoking hosts.

The coordinator key (`settings.coordinator_key_path`, mode 0600) never leaves host 0; its public
half, `coordinator.pub`, goes to every host, which pins it. The roster is kept twice: in host
0's instance folder (`settings.roster_path`, signed like the registry's copy, so a Redis that
lost its data gets it back at the next admission or `specpipe up`), and on the registry, where
every host reads it (`identity.read_roster`). Each change is a new version, so no host goes
back to an older one.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import redis

from specpipe import settings
from specpipe.swarm import identity
from specpipe.swarm.identity import Roster, Signer


def init_coordinator(home: Path | None = None) -> Signer:
    """The coordinator's key in `home` (this process's instance folder by default), made when
    there is none, with its public half beside it in `coordinator.pub` (what hosts pin)."""
    key = identity.ensure_private(settings.coordinator_key_path(home))
    signer = Signer(identity.COORDINATOR, key)
    pin = (home or settings.instance_dir()) / settings.COORDINATOR_PUB_FILE
    if not pin.is_file() or pin.read_text().strip() != signer.public_hex:
        pin.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        pin.write_text(signer.public_hex + "\n")
    return signer


def coordinator(home: Path | None = None) -> Signer:
    """The coordinator's key, which must be there (IdentityError naming the file otherwise)."""
    path = settings.coordinator_key_path(home)
    if not path.exists():
        raise identity.IdentityError(
            f"no coordinator key at {path}: run `specpipe host init` on host 0 first"
        )
    return Signer(identity.COORDINATOR, identity.load_private(path))


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


def store(client: redis.Redis, roster: Roster, signer: Signer, home: Path | None = None) -> None:
    """Keep `roster` in host 0's copy, then put it on the registry."""
    identity.save_roster_file(settings.roster_path(roster.swarm, home), roster, signer)
    identity.publish_roster(client, roster, signer)


def admit(
    client: redis.Redis, swarm: str, host: str, key_hex: str, home: Path | None = None
) -> Roster:
    """Admit `host` under the public key `key_hex` (replacing its old one, if any)."""
    signer = coordinator(home)
    roster = current(client, swarm, signer, home).admitting(host, key_hex)
    store(client, roster, signer, home)
    return roster


def revoke(client: redis.Redis, swarm: str, host: str, home: Path | None = None) -> Roster:
    """Take `host` out of the roster: from the next read of it, nothing it signs is believed."""
    signer = coordinator(home)
    roster = current(client, swarm, signer, home).revoking(host)
    store(client, roster, signer, home)
    return roster


def admit_own_hosts(
    client: redis.Redis, swarm: str, hosts: Iterable[str], home: Path | None = None
) -> Roster:
    """For a swarm whose hosts keep their keys in this instance folder (`specpipe up`'s, the
    lab's): the coordinator's key and each host's made where missing, every host admitted under
    its key, and the roster published (again: a Redis started afresh has none)."""
    signer = init_coordinator(home)
    roster = current(client, swarm, signer, home)
    wanted = dict(roster.hosts)
    for host in hosts:
        key = identity.ensure_private(settings.host_key_path(host, home))
        wanted[host] = identity.public_hex(key)
    if wanted != roster.hosts:
        roster = Roster(swarm, roster.version + 1, wanted)
    store(client, roster, signer, home)
    return roster
