"""Fixtures for the swarm tests: real Redis servers and real stage worker processes."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from specpipe.ops import roster
from specpipe.ops.redis_server import RedisServer
from specpipe.ops.supervisor import terminate_all
from specpipe.settings import COORDINATOR_PUB_FILE, Settings
from specpipe.swarm import identity, trust, wire
from tests.swarmprocs import wait_heartbeats

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The Redis every test may use (tests/conftest.py finds or starts it)."""
    url = os.environ.get("TESTING_REDIS_URL", "redis://127.0.0.1:6379/0")
    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"the swarm tests need Redis at {url} (TESTING_REDIS_URL): {exc}")
    finally:
        client.close()
    return url


@pytest.fixture(scope="session")
def second_redis() -> str:
    """A second, private redis-server on another port: another host's Redis."""
    with RedisServer() as server:
        yield server.url


def clean(url: str, swarm: str) -> None:
    """The swarm's keys deleted, and its hosts' registry users (`swarm.credentials`)."""
    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(f"specpipe:{swarm}:*"))
    if keys:
        client.delete(*keys)
    for name in client.execute_command("ACL", "USERS"):
        if name.decode().endswith(f"@{swarm}"):
            client.execute_command("ACL", "DELUSER", name)
    client.close()


@pytest.fixture
def swarm(redis_url):
    """A swarm name of its own, so tests never see each other's streams."""
    name = f"t{uuid.uuid4().hex[:10]}"
    yield name
    clean(redis_url, name)


@pytest.fixture(scope="session")
def key() -> bytes:
    return secrets.token_hex(16).encode()


@pytest.fixture
def ring_settings(redis_url, swarm, key) -> Settings:
    """The settings a coordinator of this test's swarm would read. The swarm pins no coordinator
    key: these tests are of the shared-key mode, which runs only behind its opt-out."""
    return Settings.from_env().for_swarm(redis_url, swarm, key, insecure_shared_key=True)


class Stages:
    """Starts toy stage worker processes and stops every one of them at the end."""

    def __init__(
        self,
        swarm: str,
        key: bytes,
        registry: str,
        env: dict[str, str] | None = None,
        keys=None,
        pinned: bool = False,
    ) -> None:
        self.swarm, self.key, self.registry = swarm, key, registry
        self.env = env or {}  # more of the workers' environment (their host identities)
        self.pinned = pinned  # whether that environment pins the coordinator's key
        self.keys = keys or key  # what their records are read with
        self.procs: dict[str, subprocess.Popen] = {}
        self.args: dict[str, list[str]] = {}

    def start(self, host: str, layers: str, redis_url: str, *extra: str, wait: bool = True):
        argv = [
            sys.executable,
            "-m",
            "tests.swarm.toy_worker",
            "--host",
            host,
            "--layers",
            layers,
            "--redis",
            redis_url,
            "--registry",
            self.registry,
            "--swarm",
            self.swarm,
            *extra,
        ]
        self.args[host] = argv
        self.procs[host] = subprocess.Popen(argv, cwd=ROOT, env=self._env())
        if wait:
            self.wait_ready([host])

    def wait_ready(self, hosts, timeout_s: float = 60.0) -> None:
        """Wait until each host has heartbeated since it was (re)started."""
        wait_heartbeats(self.registry, self.swarm, self.keys, self.procs, hosts, timeout_s)

    def kill9(self, host: str) -> None:
        proc = self.procs[host]
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def restart(self, host: str, drop_args: tuple[str, ...] = ()) -> None:
        """Start `host` again with the same arguments, less the flags (and values) named."""
        argv = list(self.args[host])
        for flag in drop_args:
            i = argv.index(flag)
            del argv[i : i + 2]
        self.args[host] = argv
        self.procs[host] = subprocess.Popen(argv, cwd=ROOT, env=self._env())
        self.wait_ready([host])

    def _env(self) -> dict[str, str]:
        key = self.key.decode()
        # A stage that pins no coordinator key runs only in the shared-key mode, out loud.
        opt_out = {} if self.pinned else {"SPECPIPE_INSECURE_SHARED_KEY": "1"}
        env = {**os.environ, "SPECPIPE_SWARM_KEY": key, "OMP_NUM_THREADS": "1", **opt_out}
        return {**env, **self.env}

    def stop(self) -> None:
        terminate_all(self.procs.values(), timeout_s=10)


@pytest.fixture
def stages(swarm, key, redis_url):
    """Start toy stages with `stages.start(host, "A:B", redis_url)`; all stop afterwards."""
    group = Stages(swarm, key, redis_url)
    yield group
    group.stop()


@pytest.fixture
def identified(tmp_path, swarm, key, redis_url, ring_settings):
    """Host 0's instance folder (the coordinator key, the roster of a, b, spares a2 and b2) and toy
    stage processes that sign with their own keys from it and pin the coordinator's."""
    client = redis.Redis.from_url(redis_url)
    home = tmp_path / "instance"
    roster.admit_own_hosts(client, swarm, ["a", "a2", "b", "b2"], home)
    client.close()
    pin = (home / COORDINATOR_PUB_FILE).read_text().strip()
    settings = replace(
        ring_settings.for_swarm(redis_url, swarm, key, coordinator_public_key=pin), home=home
    )
    env = {"SPECPIPE_HOME": str(home)}
    group = Stages(swarm, key, redis_url, env=env, keys=trust.keyring(settings), pinned=True)
    yield group, settings, home
    group.stop()


def host_keyring(settings: Settings, host: str) -> wire.Keyring:
    """What host `host`'s stage process seals, signs and believes with: its own keys from the
    instance folder `settings.home` (the `identified` fixture's), and the roster on the registry
    with the copies of the data keys it opens."""
    keys = trust.keyring(settings, host)
    client = redis.Redis.from_url(settings.redis_url)
    try:
        found, _ = identity.read_roster(client, settings.swarm, keys.coordinator)
    finally:
        client.close()
    return keys.with_roster(found)
