"""Secrets and key files: the swarm's keys and their rotation, the web app's secret key, the
Redis passwords, the hosts' and the coordinator's signing keys, host 0's roster, and writing any
of them readable by its owner only. Nothing secret has a default: each comes from the
environment or from a file in the instance folder."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from specpipe.settings.environment import instance_dir, tls_dir

SECRET_KEY_FILE = "secret_key"
SWARM_KEY_FILE = "swarm_key"
REDIS_PASSWORD_FILE = "redis_password"
LOCAL_REDIS_PASSWORD_FILE = "redis_local_password"
KEEPER_PASSWORD_FILE = "redis_keeper_password"
ADMIN_PASSWORD_FILE = "admin_password"
# Host identities (`specpipe.swarm.identity`): each host's own signing key, the coordinator's
# on host 0, the coordinator's public key every host pins, and host 0's copy of the roster.
HOST_KEYS_DIR = "host_keys"
COORDINATOR_KEY_FILE = "coordinator_key"
COORDINATOR_PUB_FILE = "coordinator.pub"
ROSTERS_DIR = "rosters"


def swarm_key() -> str | None:
    """The key that signs the data plane now (the first of `swarm_keys`), or None."""
    keys = swarm_keys()
    return keys[0] if keys else None


def swarm_keys(now: float | None = None) -> tuple[str, ...]:
    """The swarm keys accepted now, the signing one first: `SPECPIPE_SWARM_KEY` (one key, or
    `NEW,OLD@UNTIL` while a new key spreads), else the key file `SPECPIPE_SWARM_KEY_FILE` names,
    else the instance folder's key file, else ().

    The file's first line is the signing key; each further line, `KEY UNTIL`, is an old key
    accepted until the Unix time UNTIL (`specpipe key rotate` writes them). ValueError when
    `SPECPIPE_SWARM_KEY` cannot be read (the message never holds a key)."""
    now = time.time() if now is None else now
    value = os.environ.get("SPECPIPE_SWARM_KEY")
    if value:
        return tuple(key for key, until in _env_keys(value) if until is None or until > now)
    return key_file_keys(swarm_key_path(), now)


def swarm_key_path() -> Path:
    """The key file processes read when `SPECPIPE_SWARM_KEY` is unset: the one
    `SPECPIPE_SWARM_KEY_FILE` names, else the instance folder's."""
    path = os.environ.get("SPECPIPE_SWARM_KEY_FILE")
    return Path(path) if path else instance_dir() / SWARM_KEY_FILE


def _env_keys(value: str) -> list[tuple[str, float | None]]:
    """`SPECPIPE_SWARM_KEY` as (key, deadline) pairs: `NEW` signs and has none; each old key
    after a comma may end at `@UNTIL`, a Unix time or an ISO 8601 date (UTC unless it says)."""
    pairs: list[tuple[str, float | None]] = []
    for position, item in enumerate(k.strip() for k in value.split(",") if k.strip()):
        key, marked, until = item.rpartition("@")
        if not marked:
            pairs.append((item, None))
            continue
        if position == 0:
            raise ValueError(
                "SPECPIPE_SWARM_KEY: the first key signs and takes no @expiry; write NEW,OLD@UNTIL"
            )
        deadline = parse_deadline(until)
        if not key.strip() or deadline is None:
            raise ValueError(
                f"SPECPIPE_SWARM_KEY: old key {position} ends at {until.strip()!r}, which is "
                "neither a Unix time nor an ISO date (NEW,OLD@1767225600 or "
                "NEW,OLD@2026-01-01T00:00Z)"
            )
        pairs.append((key.strip(), deadline))
    return pairs


_UNIX_TIME = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def parse_deadline(text: str) -> float | None:
    """`text` as a Unix time: digits are one already, else an ISO 8601 date or time (UTC unless
    it names its zone); None when it is neither."""
    from datetime import UTC, datetime

    text = text.strip()
    if _UNIX_TIME.fullmatch(text):
        return float(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def key_file_keys(path: Path, now: float | None = None) -> tuple[str, ...]:
    """The keys a swarm key file (as `specpipe up` keeps it) accepts now, the signing one first;
    () when there is no such file."""
    if not path.is_file():
        return ()
    now = time.time() if now is None else now
    return tuple(key for key, until in _key_file(path.read_text()) if until is None or until > now)


def _key_file(text: str) -> list[tuple[str, float | None]]:
    """A key file's (key, deadline) pairs: the signing key first, with none; old keys whose
    line has no readable deadline are left out (never accepted)."""
    lines = [line.split() for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    pairs: list[tuple[str, float | None]] = [(lines[0][0], None)]
    for fields in lines[1:]:
        until = fields[1] if len(fields) > 1 else ""
        if _UNIX_TIME.fullmatch(until):
            pairs.append((fields[0], float(until)))
    return pairs


def ensure_swarm_key() -> str:
    """The swarm key, generating one into the instance folder (mode 0600) when there is none."""
    return swarm_key() or _write_secret(SWARM_KEY_FILE)


def rotate_swarm_key(grace_s: float, *, revoke: bool = False) -> str:
    """Make a new signing key in the key file processes read (`swarm_key_path`). The key that
    signed until now stays accepted for `grace_s` seconds; an older one keeps its deadline when
    that is sooner, so a rotation never gives a key longer. With `revoke` no old key stays
    accepted. Returns the new key. Refused (ValueError) when the key comes from
    `SPECPIPE_SWARM_KEY`: that is the environment's to change."""
    import secrets

    if os.environ.get("SPECPIPE_SWARM_KEY"):
        raise ValueError(
            "the swarm key comes from SPECPIPE_SWARM_KEY: set the new key there, "
            "as SPECPIPE_SWARM_KEY=NEW,OLD@UNTIL until every host has NEW"
        )
    now = time.time()
    path = swarm_key_path()
    lines = [secrets.token_hex(32)]
    if not revoke:
        deadline = int(now + grace_s)
        for key, until in _key_file(path.read_text()) if path.is_file() else []:
            if until is None or until > now:
                lines.append(f"{key} {deadline if until is None else min(int(until), deadline)}")
    write_private(path, "\n".join(lines) + "\n")
    return lines[0]


def secret_key() -> str | None:
    """`SECRET_KEY`, else the key `specpipe up` keeps in the instance folder, else None."""
    return _secret("SECRET_KEY", SECRET_KEY_FILE)


def _secret(variable: str, name: str) -> str | None:
    """The environment's `variable`, else the instance folder's file `name`, else None."""
    return os.environ.get(variable) or _secret_file(name)


def _secret_file(name: str) -> str | None:
    """The instance folder's file `name`, stripped, else None."""
    path = instance_dir() / name
    return (path.read_text().strip() or None) if path.is_file() else None


def ensure_secret_key() -> str:
    """The secret key, generating one into the instance folder (mode 0600) when there is none."""
    return secret_key() or _write_secret(SECRET_KEY_FILE)


def redis_password() -> str | None:
    """The swarm's data-plane Redis password, which every stage host's Redis accepts for its
    peer user `specpipe-peer` and a process adds to the addresses of other hosts it dials:
    `SPECPIPE_REDIS_PASSWORD`, else the file `SPECPIPE_REDIS_PASSWORD_FILE` names, else the one
    kept in the instance folder, else None."""
    path = os.environ.get("SPECPIPE_REDIS_PASSWORD_FILE")
    if path and not os.environ.get("SPECPIPE_REDIS_PASSWORD"):
        return Path(path).read_text().strip() or None
    return _secret("SPECPIPE_REDIS_PASSWORD", REDIS_PASSWORD_FILE)


def ensure_redis_password() -> str:
    """The peer password of the Redis `specpipe up` or `specpipe join` runs: `redis_password`,
    else a new one written into the instance folder (mode 0600)."""
    return redis_password() or _write_secret(REDIS_PASSWORD_FILE)


def local_redis_password() -> str | None:
    """The password of the `specpipe` user of the Redis `specpipe up` or `specpipe join` runs
    on this host (every command it allows, Lua too), for this host's own processes only, so it
    never leaves the host: the instance folder's `redis_local_password`, else None."""
    return _secret_file(LOCAL_REDIS_PASSWORD_FILE)


def keeper_password(home: Path | None = None) -> str | None:
    """The password of host 0's registry keeper (`redis_server.KEEPER_USER`), which makes and
    deletes the stage hosts' users there: the instance folder's `redis_keeper_password` (of
    `home`, else this process's), else None (a registry without one: its own user keeps)."""
    path = (home or instance_dir()) / KEEPER_PASSWORD_FILE
    return (path.read_text().strip() or None) if path.is_file() else None


def ensure_keeper_password() -> str:
    """`keeper_password`, else a new one written into the instance folder (mode 0600)."""
    return keeper_password() or _write_secret(KEEPER_PASSWORD_FILE)


def ensure_local_redis_password() -> str:
    """`local_redis_password`, else a new one written into the instance folder (mode 0600)."""
    return local_redis_password() or _write_secret(LOCAL_REDIS_PASSWORD_FILE)


_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def host_key_path(host: str, home: Path | None = None) -> Path:
    """Where host `host`'s signing key lives: the file `SPECPIPE_HOST_KEY_FILE` names, else
    `host_keys/HOST.key` in the instance folder (`home`, else this process's; one folder may
    hold several hosts' keys, as `specpipe up`'s does). ValueError for a host name that cannot
    name a file."""
    path = os.environ.get("SPECPIPE_HOST_KEY_FILE")
    if path:
        return Path(path)
    if not _FILE_NAME.fullmatch(host) or host.endswith(".") or ".." in host:
        raise ValueError(f"host name {host!r} must be letters, digits, '.', '_', ':' or '-'")
    return (home or instance_dir()) / HOST_KEYS_DIR / f"{host}.key"


def sealing_key_path(signing_key: Path) -> Path:
    """Where the X25519 key that data keys are sealed to lives, beside the signing key at
    `signing_key` (a host's, or the coordinator's): `host_keys/HOST.sealing`,
    `coordinator_key.sealing`."""
    return signing_key.with_name(signing_key.stem + ".sealing")


def coordinator_key_path(home: Path | None = None) -> Path:
    """Where host 0 keeps the coordinator's signing key: `SPECPIPE_COORDINATOR_KEY_FILE`, else
    `coordinator_key` in the instance folder (`home`, else this process's)."""
    path = os.environ.get("SPECPIPE_COORDINATOR_KEY_FILE")
    return Path(path) if path else (home or instance_dir()) / COORDINATOR_KEY_FILE


def coordinator_public_key() -> str | None:
    """The coordinator's public key this host pins (64 hex digits, then its sealing key's after a
    space, `identity.pinned`): `SPECPIPE_COORDINATOR_PUB`,
    else `coordinator.pub` in the TLS folder or the instance folder; None when there is none."""
    value = os.environ.get("SPECPIPE_COORDINATOR_PUB")
    if value:
        return value.strip()
    for folder in (tls_dir(), instance_dir()):
        path = folder / COORDINATOR_PUB_FILE
        if path.is_file():
            return path.read_text().strip()
    return None


def roster_path(swarm: str, home: Path | None = None) -> Path:
    """Host 0's own copy of swarm `swarm`'s roster (the registry holds the one hosts read), in
    the instance folder (`home`, else this process's)."""
    if not _FILE_NAME.fullmatch(swarm):
        raise ValueError(f"swarm name {swarm!r} must be letters, digits, '.', '_', ':' or '-'")
    return (home or instance_dir()) / ROSTERS_DIR / swarm


def _write_secret(name: str, key: str | None = None) -> str:
    """`key` (else a new random one) written to the instance folder, readable by its owner
    only."""
    import secrets

    key = key or secrets.token_hex(32)
    write_private(instance_dir() / name, key + "\n")
    return key


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` (replacing it whole), readable by its owner only (its folder too,
    when it is new)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".new")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a file left there before keeps no looser mode
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(partial, path)  # a reader sees the old file or the new one, never half of one


def admin_password_file() -> Path:
    """Where `specpipe web` leaves the built-in admin's first password (mode 0600)."""
    return instance_dir() / ADMIN_PASSWORD_FILE


def write_admin_password(password: str) -> Path:
    """Keep the built-in admin's generated first password in the instance folder, owner-only."""
    _write_secret(ADMIN_PASSWORD_FILE, password)
    return admin_password_file()
