"""Each stage host's own user on host 0's registry, with a password no other host holds.

A stage host reaches the registry (host 0's Redis) as `NAME@SWARM`. Neither side sends its
password: both derive it (`registry_password`) from an X25519 exchange between the host's
sealing key and the coordinator's (whose public half `coordinator.pub` carries beside the
signing key), through HKDF-SHA256 bound to the swarm and the host's name. Host 0 keeps the users
in step with the roster (`sync`, at `host admit` and `host revoke` and on every beat): one for
each admitted host with a sealing key, none for anyone else, so revoking a host deletes its user
and closes its connections.

What a host's user may do (`rules`) is what its stage does on the registry and nothing more:
write its own inventory record (`inventory.node_key`) and its own reply streams
(`streams.reply_key` ends in its name), read the others' records, the roster and the registry's
clock. No `EXPIRE` or `DEL` on anything but its own keys, no key of another type anywhere it
does not own, no Lua, no channels. What it can still do is fill its own reply streams: host 0
measures each host's keys on every beat (`police`) and shuts out a host over its quota.
"""

from __future__ import annotations

import hashlib
import logging
import re
from urllib.parse import quote, urlsplit

import redis
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from specpipe.swarm.identity import Roster, sealing_public_key
from specpipe.swarm.values import text

PASSWORD_INFO = b"specpipe registry password v1\x00"
# A name that can go into an ACL key pattern as it is: no glob characters, no spaces.
SAFE_NAME = re.compile(r"[A-Za-z0-9._:-]{1,128}")
DEFAULT_QUOTA_BYTES = 64 * 1024 * 1024  # what one host's keys may take on the registry
CONNECTION = ("+ping", "+hello", "+auth", "+select", "+echo", "+client|setname", "+client|id")

log = logging.getLogger("specpipe.registry")


class CredentialError(ValueError):
    """A host whose registry credentials cannot be made."""


def user(swarm: str, host: str) -> str:
    """The registry user of stage host `host` of `swarm` (`@` is in no host's or swarm's name,
    so no two swarms sharing a registry share a user)."""
    return f"{host}@{swarm}"


def registry_password(own: X25519PrivateKey, other: X25519PublicKey, swarm: str, host: str) -> str:
    """Host `host`'s password on `swarm`'s registry: the host computes it with its own sealing
    key and the coordinator's public one, host 0 with the coordinator's and the host's."""
    hkdf = HKDF(hashes.SHA256(), length=32, salt=None, info=PASSWORD_INFO + scope(swarm, host))
    return hkdf.derive(own.exchange(other)).hex()


def scope(swarm: str, host: str) -> bytes:
    """The swarm's and the host's names, each length-prefixed: what binds a derived secret or a
    sealed answer to them."""
    parts = [swarm.encode(), host.encode()]
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def rules(swarm: str, host: str, password_sha256: str) -> list[str]:
    """The ACL rules (`ACL SETUSER` arguments) of `host`'s registry user, whose password has the
    SHA-256 `password_sha256` (hex): its own record read and written, its own reply streams
    appended to, the other records and the roster read. CredentialError for a name that cannot
    go into a key pattern."""
    if not SAFE_NAME.fullmatch(host) or not SAFE_NAME.fullmatch(swarm):
        raise CredentialError(f"{host!r} cannot have a registry user: its name has other signs")
    prefix = f"specpipe:{swarm}"
    return [
        "reset",
        "on",
        f"#{password_sha256}",
        *CONNECTION,
        "+time",
        # Its own record: the only key it may write whole or remove.
        f"~{prefix}:node:{host}",
        "+set",
        "+get",
        "+del",
        # Everyone's records and the roster (signed by the coordinator): read only.
        f"(%R~{prefix}:node:* %R~{prefix}:roster +get +mget)",
        # Its replies to the coordinators: appended to its own streams, with their lifetime.
        f"(~{prefix}:reply:*@{host} +xadd +expire)",
    ]


def registry_url(url: str, swarm: str, host: str, password: str) -> str:
    """`url` (the registry's address) with the user and password of `swarm`'s host `host`; a
    URL that already names a user is left as it is (an operator's own)."""
    return with_user(url, user(swarm, host), password)


def with_user(url: str, name: str, password: str) -> str:
    """`url` with the user `name` and `password`, unless it names a user already."""
    if urlsplit(url).username or "//" not in url:
        return url
    start = url.index("//") + 2
    return f"{url[:start]}{quote(name, safe='')}:{quote(password, safe='')}@{url[start:]}"


def shut_out_key(swarm: str) -> str:
    """Host 0's hash of the hosts shut out of the registry for their usage: name -> until
    (swarm time)."""
    return f"specpipe:{swarm}:shut-out"


def sync(
    client: redis.Redis, roster: Roster, coordinator: X25519PrivateKey, now: float
) -> tuple[list[str], list[str]]:
    """Make the registry's host users those of `roster`'s hosts with a sealing key, but any
    host shut out until after `now` (swarm time): each made afresh with its derived password,
    any other user of this swarm's deleted (Redis closes its connections). The users made and the
    users deleted."""
    shut = {text(h): float(u) for h, u in client.hgetall(shut_out_key(roster.swarm)).items()}
    wanted = {}
    for host, sealing_hex in roster.sealing.items():
        if shut.get(host, 0.0) > now or not SAFE_NAME.fullmatch(host):
            continue
        password = registry_password(
            coordinator, sealing_public_key(sealing_hex), roster.swarm, host
        )
        digest = hashlib.sha256(password.encode()).hexdigest()
        wanted[user(roster.swarm, host)] = rules(roster.swarm, host, digest)
    existing = {text(name) for name in client.execute_command("ACL", "USERS")}
    for name, acl in wanted.items():
        client.execute_command("ACL", "SETUSER", name, *acl)
    ours = f"@{roster.swarm}"
    hosts = (n for n in existing if n.endswith(ours) and SAFE_NAME.fullmatch(n[: -len(ours)]))
    deleted = sorted(n for n in hosts if n not in wanted)
    for name in deleted:
        client.execute_command("ACL", "DELUSER", name)
    return sorted(wanted), deleted


def usage(client: redis.Redis, swarm: str) -> dict[str, int]:
    """The bytes each host's keys take on the registry (its record and its reply streams), by
    host name, for the hosts that have any."""
    used: dict[str, int] = {}
    for key in client.scan_iter(match=f"specpipe:{swarm}:reply:*@*", count=1000):
        host = text(key).rpartition("@")[2]
        used[host] = used.get(host, 0) + (client.memory_usage(key, samples=0) or 0)
    for host in list(used):
        used[host] += client.memory_usage(f"specpipe:{swarm}:node:{host}", samples=0) or 0
    return used


def police(
    client: redis.Redis,
    roster: Roster,
    coordinator: X25519PrivateKey,
    now: float,
    quota_bytes: int = DEFAULT_QUOTA_BYTES,
    shut_s: float = 600.0,
) -> list[str]:
    """Host 0's beat: any host whose keys take over `quota_bytes` is shut out for `shut_s`
    (its user deleted, its connections closed, then its reply streams deleted: the rounds they
    answered are sent again); the users synced with `roster`. The hosts shut out now."""
    over = [h for h, n in usage(client, roster.swarm).items() if n > quota_bytes]
    for host in over:
        client.hset(shut_out_key(roster.swarm), host, now + shut_s)
    sync(client, roster, coordinator, now)  # first: nothing more is written as it deletes
    for host in over:
        for key in client.scan_iter(match=f"specpipe:{roster.swarm}:reply:*@{host}", count=1000):
            client.delete(key)
        log.error(
            "host %s took over %d MB of the registry: shut out for %g s",
            host,
            quota_bytes // (1024 * 1024),
            shut_s,
        )
    return over
