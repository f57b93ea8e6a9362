"""The web app while /v1 completions wait: does the login page still answer? (`specpipe bench web`)

It serves the real app as `specpipe web` does (waitress, the same command) in an instance folder
of its own, with a private Redis and no coordinator, so every job it is given stays queued: a
streamed completion stays open (its keep-alive comments), a non-streamed one waits. Users and
their API tokens are made in its store (`api_load.make_users`), the completions spread over them.
With every completion open, it times `GET /login`, each on a fresh connection, then hangs up on
the completions and times how long until the server has cancelled all their jobs.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from specpipe.bench.api_load import make_users
from specpipe.bench.stack import CLEARED
from specpipe.ops.redis_server import RedisServer, free_port

Log = Callable[[str], None]
TARGET_MS = 1000.0  # the login page answers within this while the completions are open
LOGIN_TIMEOUT_S = 10.0


@dataclass
class WebLoadResult:
    """What one run measured."""

    streams: int  # streamed completions asked for
    waits: int  # non-streamed completions asked for
    streams_open: int  # streams that answered 200 and stayed open
    waits_open: int  # non-streamed completions still waiting when the logins were timed
    login_ms: list[float]  # each GET /login; LOGIN_TIMEOUT_S * 1000 for one that never answered
    login_failures: int  # logins that did not answer 200 within LOGIN_TIMEOUT_S
    cancelled_after_hangup_s: float | None  # until every job was cancelled; None: not all were

    @property
    def login_p50_ms(self) -> float:
        return statistics.median(self.login_ms)

    @property
    def login_max_ms(self) -> float:
        return max(self.login_ms)

    @property
    def passed(self) -> bool:
        """Every completion open, every login answered, the slowest within the target."""
        return (
            self.streams_open == self.streams
            and self.waits_open == self.waits
            and self.login_failures == 0
            and self.login_max_ms < TARGET_MS
        )

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "login_p50_ms": self.login_p50_ms,
            "login_max_ms": self.login_max_ms,
            "target_ms": TARGET_MS,
            "passed": self.passed,
        }


class WebServer:
    """`specpipe web` on a free port, in `home`, with a private Redis (context manager)."""

    def __init__(self, home: Path, env: dict[str, str] | None = None) -> None:
        self.home = Path(home)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.database_url = f"sqlite:///{self.home / 'specpipe.sqlite3'}"
        self.redis = RedisServer(password=secrets.token_urlsafe(18))
        self.extra_env = env or {}
        self.proc: subprocess.Popen | None = None
        self.log_path = self.home / "web.log"

    def __enter__(self) -> WebServer:
        self.home.mkdir(parents=True, exist_ok=True)
        self.redis.start()
        env = {k: v for k, v in os.environ.items() if k not in CLEARED}
        env.update(
            SPECPIPE_HOME=str(self.home),
            REDIS_URL=self.redis.url,
            DATABASE_URL=self.database_url,
            PYTHONUNBUFFERED="1",
            **self.extra_env,
        )
        command = [sys.executable, "-m", "specpipe", "web", "--port", str(self.port)]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy(60.0)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specpipe web exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"specpipe web did not answer /healthz within {timeout_s:g} s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.redis.stop()


def post_completion(port: int, token: str, body: dict) -> socket.socket:
    """Send one POST /v1/chat/completions on a connection of its own; the answer is not read."""
    data = json.dumps(body).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {token}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", port), timeout=LOGIN_TIMEOUT_S)
    sock.sendall(head.encode() + data)
    return sock


def read_status(sock: socket.socket) -> int:
    """The status of the answer on `sock`, read up to the end of its headers; 0 when none came."""
    received = b""
    try:
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(4096)
            if not chunk:
                break
            received += chunk
    except TimeoutError:  # no thread took it up in time
        return 0
    parts = received.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def answered(sock: socket.socket) -> bool:
    """Whether anything came back on `sock` (a waiting completion has sent nothing)."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


def time_login(url: str) -> float | None:
    """Milliseconds for one GET /login on a fresh connection; None unless a 200 came in time."""
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(url + "/login", timeout=LOGIN_TIMEOUT_S) as response:
            response.read()
            ok = response.status == 200
    except OSError:
        return None
    return (time.perf_counter() - started) * 1000 if ok else None


def _served_model(url: str, token: str) -> str:
    request = urllib.request.Request(
        url + "/v1/models", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())["data"][0]["id"]


def _job_statuses(database_url: str) -> list[str]:
    from sqlalchemy import select as select_rows

    from models.db import make_session_factory
    from models.jobs import Job

    with make_session_factory(database_url)() as session:
        return list(session.scalars(select_rows(Job.status)))


def _wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def run(
    streams: int = 50,
    waits: int = 20,
    logins: int = 20,
    users: int = 10,
    home: Path | None = None,
    env: dict[str, str] | None = None,
    log: Log = print,
) -> WebLoadResult:
    """Open `streams` streamed and `waits` non-streamed completions on a fresh `specpipe web`,
    spread over `users` users, and time `logins` GETs of /login while they are open."""
    with tempfile.TemporaryDirectory(prefix="specpipe-bench-web-") as scratch:
        with WebServer(Path(home or scratch), env) as server:
            tokens = list(make_users(server.database_url, users, prefix="webload").values())
            model = _served_model(server.url, tokens[0])
            log(f"specpipe web on {server.url}, model {model}, {users} users")
            time_login(server.url)  # untimed: the first render compiles the templates
            body = {"model": model, "messages": [{"role": "user", "content": "Hello"}]}
            body["max_tokens"] = 8
            # Untimed too: a fresh server's first submission opens the model's tokenizer (4 s
            # here idle, far more on a busy machine); hung up at once, its job is cancelled.
            warm_up = post_completion(server.port, tokens[0], body)
            _wait_for(lambda: len(_job_statuses(server.database_url)) >= 1, 60.0)
            warm_up.close()
            opened: list[socket.socket] = []
            try:
                streams_open = 0
                for i in range(streams):
                    sock = post_completion(server.port, tokens[i % users], {**body, "stream": True})
                    opened.append(sock)
                    streams_open += read_status(sock) == 200
                waiting = [
                    post_completion(server.port, tokens[(streams + i) % users], body)
                    for i in range(waits)
                ]
                opened.extend(waiting)
                total = streams + waits
                _wait_for(lambda: len(_job_statuses(server.database_url)) >= total + 1, 30.0)
                waits_open = sum(not answered(sock) for sock in waiting)
                log(f"open: {streams_open}/{streams} streams, {waits_open}/{waits} waiting")
                timings = [time_login(server.url) for _ in range(logins)]
            finally:
                for sock in opened:
                    sock.close()
            hung_up = time.monotonic()
            cancelled = _wait_for(
                lambda: all(s == "cancelled" for s in _job_statuses(server.database_url)), 30.0
            )
            cancelled_s = time.monotonic() - hung_up if cancelled else None
    result = WebLoadResult(
        streams=streams,
        waits=waits,
        streams_open=streams_open,
        waits_open=waits_open,
        login_ms=[t if t is not None else LOGIN_TIMEOUT_S * 1000 for t in timings],
        login_failures=sum(t is None for t in timings),
        cancelled_after_hangup_s=cancelled_s,
    )
    after = (
        f"{cancelled_s:.1f} s after the clients hung up"
        if cancelled_s is not None
        else "not all within 30 s of the clients hanging up"
    )
    log(
        f"GET /login x{logins}: median {result.login_p50_ms:.0f} ms, slowest "
        f"{result.login_max_ms:.0f} ms (target < {TARGET_MS:.0f} ms), "
        f"{result.login_failures} unanswered; jobs cancelled {after}"
    )
    return result
