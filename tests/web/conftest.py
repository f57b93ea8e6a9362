"""Fixtures for the web app: an app on a fresh store, clients, users, an API token, the job
queue.

Each test publishes to its own coordinator queue name on the real Redis, and counts its rate
limits there under its own key prefix, so tests can read exactly what was enqueued and parallel
workers never see each other's messages or limits. `client` is logged in as the built-in admin
(who sees every job); `anon` is nobody; `log_in` goes through the real login form. `rooms`
are the KV-cache reservations of the test's own swarm.
"""

from __future__ import annotations

import base64
import json
import re
import uuid

import pytest
import redis

from app import create_app
from models.db import make_session_factory
from models.tokens import create_token
from models.users import User, builtin_admin
from specpipe.settings import redis_url
from specpipe.swarm.kvbudget import Reservations
from tests.factories import finish_elsewhere
from workers.names import GENERATE_TASK


class Queue:
    """The test's coordinator queue in Redis, decoded."""

    def __init__(self, name: str):
        self.name = name
        self.redis = redis.Redis.from_url(redis_url())

    def messages(self) -> list[dict]:
        """Every message waiting in the queue, oldest first."""
        raw = self.redis.lrange(self.name, 0, -1)
        return [json.loads(m) for m in reversed(raw)]

    def job_ids(self) -> list[int]:
        """The job id of every generate task waiting, oldest first."""
        ids = []
        for message in self.messages():
            assert message["headers"]["task"] == GENERATE_TASK
            assert message["content-type"] == "application/json"
            args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
            ids.append(args[0])
        return ids


@pytest.fixture
def queue():
    """A unique coordinator queue, deleted afterwards."""
    q = Queue(f"test-coordinator-{uuid.uuid4().hex[:10]}")
    yield q
    q.redis.delete(q.name)
    q.redis.close()


@pytest.fixture
def make_app(db_url, queue):
    """Build the test's app, with `overrides` on top of the test configuration."""

    def make(**overrides):
        return create_app(
            {
                "TESTING": True,
                "DATABASE_URL": db_url,
                "COORDINATOR_QUEUE": queue.name,
                "SWARM": f"test-swarm-{uuid.uuid4().hex[:10]}",
                "MAX_PROMPT_CHARS": 500,
                "MAX_NEW_TOKENS": 1024,
                "MODEL": "tiny-test",
                "RATELIMIT_KEY_PREFIX": f"test-limits-{uuid.uuid4().hex[:10]}",
                **overrides,
            }
        )

    return make


@pytest.fixture
def app(make_app):
    """The app on a fresh store, CSRF on, publishing to the test's queue."""
    return make_app()


@pytest.fixture
def rooms(app):
    """The KV-cache reservations of the app's swarm (unique to the test) in the real Redis;
    every key of that swarm goes afterwards."""
    client = redis.Redis.from_url(app.config["REDIS_URL"])
    yield Reservations(client, app.config["SWARM"])
    keys = list(client.scan_iter(f"specpipe:{app.config['SWARM']}:*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def holders(rooms):
    """Make live holder keys in the app's swarm, standing in for jobs' locks."""

    def make(name: str) -> str:
        key = f"specpipe:{rooms.swarm}:test-holder:{name}"
        rooms.client.set(key, "held")
        return key

    return make


def as_user(client, user: User):
    """Make `client` send the session cookie of `user`, as a login leaves it."""
    with client.session_transaction() as cookie:
        cookie["user_id"] = user.id
        cookie["auth"] = user.session_check
    return client


def log_in(client, name: str, password: str, next: str | None = None):
    """Log in through the login form (with its CSRF token); the response to the POST."""
    token = csrf_token(client, "/login")
    data = {"csrf_token": token, "username": name, "password": password}
    if next is not None:
        data["next"] = next
    return client.post("/login", data=data)


@pytest.fixture
def admin(session) -> User:
    """The built-in admin."""
    user = builtin_admin(session)
    session.commit()
    return user


@pytest.fixture
def client(app, admin):
    """A test client logged in as the built-in admin."""
    return as_user(app.test_client(), admin)


@pytest.fixture
def anon(app):
    """A test client that is not logged in."""
    return app.test_client()


@pytest.fixture
def session(db_url):
    """A session on the test's store."""
    s = make_session_factory(db_url)()
    yield s
    s.close()


@pytest.fixture
def api_token(session) -> str:
    """A fresh active API token's plaintext."""
    token = create_token(session, f"test-{uuid.uuid4().hex[:6]}", builtin_admin(session))
    session.commit()
    return token


@pytest.fixture
def finished_after_load(monkeypatch, db_url):
    """Make a loader in `module` end the job it loads, from another session, before it returns:
    a job that finishes between a request's read and its write."""

    def patch(module, loader: str) -> None:
        original = getattr(module, loader)

        def load_then_finish(*args, **kwargs):
            loaded = original(*args, **kwargs)
            job = loaded[0] if isinstance(loaded, tuple) else loaded
            finish_elsewhere(db_url, job.id)
            return loaded

        monkeypatch.setattr(module, loader, load_then_finish)

    return patch


class Api:
    """A client helper that sends a bearer token."""

    def __init__(self, client, token: str):
        self.client = client
        self.headers = {"Authorization": f"Bearer {token}"}

    def get(self, path, **kw):
        return self.client.get("/api/v1" + path, headers=self.headers, **kw)

    def post(self, path, **kw):
        return self.client.post("/api/v1" + path, headers=self.headers, **kw)


@pytest.fixture
def api(client, api_token) -> Api:
    """The API with a token of the built-in admin."""
    return Api(client, api_token)


def csrf_token(client, path: str = "/") -> str:
    """The CSRF token from a page's form (the session cookie stays in the client)."""
    html = client.get(path).get_data(as_text=True)
    return re.search(r'name="csrf_token"[^>]*value="([^"]+)"', html).group(1)
