"""A user of its own for each host on every other host's Redis, with a password only that pair
holds.

A stage sends a round onward by writing to the next stage's stream on that stage's own Redis;
the coordinator writes the first. So each stage host's Redis admits the others as writers, and
each writer as itself: host W reaches host X's Redis as `W@SWARM` (the coordinator as
`coordinator@SWARM`) with a password neither sends beforehand. Both derive it (`password`) from
an X25519 exchange between W's sealing key and X's, through HKDF-SHA256 bound to the swarm and
to both names in order, so W's password on X is not X's on W, nor W's on any third host, nor
any host's registry password. A host that learns a password (the Redis it serves sees the ones
its writers send) can use it only where it came from: on its own Redis.

The owner keeps its Redis's users in step with the roster (`sync`, from the stage worker's
heartbeat, through its Redis's keeper user): one for the coordinator and one for each other
admitted host with a sealing key, none for anyone else, so a revoked host's users are gone from
every stage host within a heartbeat. What a writer may do there (`rules`) is what a stage does
to another's Redis: append to the swarm's stage streams and ring their bells, and read the
stages' counters. The writer's side is `Peering`: whose address is whose, from the inventory,
and each owner's sealing key, from the roster.

One Redis belongs to one host: two stage hosts sharing a Redis would each make the users with
its own key (a machine that serves two stages runs them under one host name, or two Redis).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable

import redis
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from specpipe.swarm import credentials
from specpipe.swarm.identity import COORDINATOR, IdentityError, Roster, sealing_public_key
from specpipe.swarm.redact import without_credentials
from specpipe.swarm.values import text

PASSWORD_INFO = b"specpipe peer password v1\x00"


def password(
    own: X25519PrivateKey, other: X25519PublicKey, swarm: str, writer: str, owner: str
) -> str:
    """The password `writer` logs in to `owner`'s Redis with: the writer computes it with its
    own sealing key and the owner's public one, the owner with its own and the writer's."""
    info = PASSWORD_INFO + credentials.scope(swarm, writer) + credentials.scope(swarm, owner)
    hkdf = HKDF(hashes.SHA256(), length=32, salt=None, info=info)
    return hkdf.derive(own.exchange(other)).hex()


def rules(swarm: str, password_sha256: str) -> list[str]:
    """The ACL rules of a writer's user on a stage host's Redis, whose password has the SHA-256
    `password_sha256` (hex): the swarm's stage streams and their bells appended to, the
    stages' counters read; nothing else."""
    if not credentials.SAFE_NAME.fullmatch(swarm):
        raise credentials.CredentialError(
            f"{swarm!r} cannot have peer users: its name has other signs"
        )
    prefix = f"specpipe:{swarm}"
    return [
        "reset",
        "on",
        f"#{password_sha256}",
        *credentials.CONNECTION,
        f"~{prefix}:stage:*",
        "+xadd",
        "+lpush",
        "+ltrim",
        f"(%R~{prefix}:stats:* +hgetall)",
    ]


def writers(
    roster: Roster, owner: str, coordinator: X25519PublicKey | None
) -> dict[str, X25519PublicKey]:
    """Who may write to `owner`'s Redis, by name, with their sealing keys: the coordinator
    (when its pin has a sealing key) and every other admitted host that has one."""
    found = {COORDINATOR: coordinator} if coordinator is not None else {}
    for host, sealing_hex in roster.sealing.items():
        if host != owner and credentials.SAFE_NAME.fullmatch(host):
            found[host] = sealing_public_key(sealing_hex)
    return found


def sync(
    client: redis.Redis,
    roster: Roster,
    owner: str,
    own: X25519PrivateKey,
    coordinator: X25519PublicKey | None,
) -> tuple[list[str], list[str]]:
    """Make the users of `owner`'s Redis (`client`, its keeper) those of the writers `roster`
    and the coordinator's key name (`writers`), each with the password the pair derives; any
    other user of this swarm deleted (Redis closes its connections). The users made and
    deleted."""
    wanted = {}
    for writer, key in writers(roster, owner, coordinator).items():
        secret = password(own, key, roster.swarm, writer, owner)
        digest = hashlib.sha256(secret.encode()).hexdigest()
        wanted[credentials.user(roster.swarm, writer)] = rules(roster.swarm, digest)
    for name, acl in wanted.items():
        client.execute_command("ACL", "SETUSER", name, *acl)
    ours = f"@{roster.swarm}"
    existing = (text(n) for n in client.execute_command("ACL", "USERS"))
    deleted = sorted(n for n in existing if n.endswith(ours) and n not in wanted)
    for name in deleted:
        client.execute_command("ACL", "DELUSER", name)
    return sorted(wanted), deleted


class Peering:
    """How one host (or the coordinator) logs in to the other hosts' Redis: as `name@SWARM`,
    with the password it derives with each owner (`password`). It learns whose each address is
    from the inventory and the owners' sealing keys from the roster (`learn`), both swapped
    whole, so the threads of a process may read while one learns."""

    def __init__(
        self,
        swarm: str,
        name: str,
        sealing: X25519PrivateKey,
        coordinator: X25519PublicKey | None = None,
    ) -> None:
        self.swarm, self.name, self._sealing = swarm, name, sealing
        self._coordinator = coordinator
        self._owners: dict[str, str] = {}  # a bare address -> the host whose Redis it is
        self._keys: dict[str, X25519PublicKey] = {}  # a host -> its sealing key
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Peering({self.swarm!r}, {self.name!r})"

    def learn(self, roster: Roster | None = None, nodes: Iterable[tuple[str, str]] = ()) -> None:
        """Take `roster`'s sealing keys (when given) and `nodes`' (host, address) pairs."""
        with self._lock:
            if roster is not None:
                keys = {}
                for host, sealing_hex in roster.sealing.items():
                    try:
                        keys[host] = sealing_public_key(sealing_hex)
                    except IdentityError:
                        continue  # a roster the coordinator signed; a bad key is its host's loss
                self._keys = keys
            owners = dict(self._owners)
            for host, address in nodes:
                if address:
                    owners[without_credentials(address)] = host
            self._owners = owners

    def keep(self, client: redis.Redis, roster: Roster) -> tuple[list[str], list[str]]:
        """Make the users of this host's own Redis (`client`, as its keeper) those `roster`
        names (`sync`)."""
        return sync(client, roster, self.name, self._sealing, self._coordinator)

    def login(self, address: str, host: str | None = None) -> tuple[str, str] | None:
        """The user and password to log in to `address` with, the Redis of `host` (else of the
        host the inventory gave it to); None when this process does not know whose it is or
        that host's key."""
        owner = host or self._owners.get(without_credentials(address))
        key = self._keys.get(owner) if owner else None
        if key is None or owner == self.name:
            return None
        secret = password(self._sealing, key, self.swarm, self.name, owner)
        return credentials.user(self.swarm, self.name), secret
