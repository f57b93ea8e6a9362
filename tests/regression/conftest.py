"""Fixtures for the regression tests: a private Redis, toy stage processes, Celery workers.

Everything runs on a redis-server of its own, so the Celery workers started here never take
another test's (or another suite's) coordinator tasks, and nothing else takes theirs.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

from specpipe.ops.redis_server import RedisServer
from specpipe.swarm import inventory
from tests.waiting import wait_until
from workers.names import NIGHTLY_QUEUE

ROOT = Path(__file__).resolve().parents[2]
# Small proofs: seconds, not the reference run's minutes.
SMALL_SIZES = {
    "SPECPIPE_NIGHTLY_LOCAL_DRAWS": "40000",
    "SPECPIPE_NIGHTLY_SAMPLER_TRIALS": "400",
    "SPECPIPE_NIGHTLY_STOPS": "3",
    "SPECPIPE_NIGHTLY_DRAWS": "120",
    "SPECPIPE_NIGHTLY_GENERATION_TOKENS": "16",
    "SPECPIPE_NIGHTLY_PILOT_DRAWS": "8",
    "SPECPIPE_NIGHTLY_MAX_NEW_TOKENS": "16",
    "SPECPIPE_NIGHTLY_SEED": "20261129",
}
# Smaller still, for the tests of who runs a night and what is reported of it, whatever its
# verdict: too few draws for the proof's power check, so a night run with them fails.
PLUMBING_SIZES = {
    **SMALL_SIZES,
    "SPECPIPE_NIGHTLY_STOPS": "1",
    "SPECPIPE_NIGHTLY_DRAWS": "30",
    "SPECPIPE_NIGHTLY_GENERATION_TOKENS": "8",
    "SPECPIPE_NIGHTLY_PILOT_DRAWS": "4",
    "SPECPIPE_NIGHTLY_MAX_NEW_TOKENS": "8",
}
STAGES = (("wa-1", "0:2", "WA", "198.51.100.7"), ("nj-1", "2:4", "NJ", "203.0.113.9"))


@pytest.fixture(scope="session")
def private_redis() -> str:
    """A redis-server of this suite's own on a free port, locked down as `specpipe up` runs it:
    a password, and only the commands the swarm uses."""
    with RedisServer(password=secrets.token_hex(16)) as server:
        yield server.url


class Swarm:
    """A swarm on the private Redis: its name, key, stage processes and Celery workers."""

    def __init__(self, redis_url: str, db_url: str) -> None:
        self.redis_url, self.db_url = redis_url, db_url
        self.name = f"n{uuid.uuid4().hex[:10]}"
        self.key = secrets.token_hex(16)
        self.procs: list[subprocess.Popen] = []
        self.sizes = SMALL_SIZES  # the nightly's proof sizes in every process it starts
        self.client = redis.Redis.from_url(redis_url)

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            **self.sizes,
            "DATABASE_URL": self.db_url,
            "REDIS_URL": self.redis_url,
            "SPECPIPE_SWARM": self.name,
            "SPECPIPE_SWARM_KEY": self.key,
            # The swarm pins no coordinator key: its processes run in the shared-key mode,
            # which only its opt-out allows.
            "SPECPIPE_INSECURE_SHARED_KEY": "1",
            "SPECPIPE_MODEL": "toy",
            "OMP_NUM_THREADS": "1",
            **extra,
        }

    def _spawn(self, argv: list[str], **extra: str) -> subprocess.Popen:
        proc = subprocess.Popen(argv, cwd=ROOT, env=self.env(**extra))
        self.procs.append(proc)
        return proc

    def start_stages(
        self,
        lossy_tail: bool = False,
        model: str | None = None,
        lossy_head: bool = False,
        draft_head: str | None = None,
    ) -> None:
        """Both toy stages (or a real model's halves); the tail deliberately lossy when asked
        (the lossy test double in its configuration). With `lossy_head` the head's worker is
        configured with it too: flagged in the inventory, though only a tail's sampling is
        biased by it. `draft_head`: a draft head file for a real model's tail."""
        stages = STAGES
        if model:
            from specpipe.transformer.resolve import open_checkpoint

            n = open_checkpoint(model).config.n_layers
            stages = (
                (STAGES[0][0], f"0:{n // 2}", *STAGES[0][2:]),
                (STAGES[1][0], f"{n // 2}:{n}", *STAGES[1][2:]),
            )
        for i, (host, layers, geo, ip) in enumerate(stages):
            tail = i == len(STAGES) - 1
            on = lossy_tail if tail else lossy_head and i == 0
            sampler = ["--sampler", "lossy"] if on else []
            head = ["--draft-head", draft_head] if draft_head and tail else []
            self._spawn(
                [
                    sys.executable,
                    "-m",
                    "tests.regression.stage",
                    "--host",
                    host,
                    "--layers",
                    layers,
                    "--redis",
                    self.redis_url,
                    "--swarm",
                    self.name,
                    "--geo",
                    geo,
                    "--public-ip",
                    ip,
                    *(["--model", model] if model else []),
                    *head,
                    *sampler,
                ],
            )
        hosts = {s[0] for s in stages}

        def online() -> bool:
            if {n.host for n in inventory.load(self.client, self.name, self.key)} >= hosts:
                return True
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError("a stage process exited")
            return False

        wait_until(online, 120, f"stages {sorted(hosts)} to come online", interval_s=0.1)

    def start_workers(self, n: int = 1) -> None:
        """n Celery worker processes on the nightly queue (one task at a time each)."""
        for i in range(n):
            self._spawn(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "tests.regression.celery_toy",
                    "worker",
                    "-Q",
                    NIGHTLY_QUEUE,
                    "--pool=solo",
                    "--loglevel=WARNING",
                    "--without-gossip",
                    "--without-mingle",
                    "--without-heartbeat",
                    "-n",
                    f"{self.name}-{i}@%h",
                ],
            )

    def wait_result(self, key: str, timeout_s: float = 150) -> dict:
        """The stored run of the night `key` (key, run_id, name, verdict), once there is one."""
        from models.db import session_scope
        from models.proof_store import night_outcome

        def result() -> dict | None:
            with session_scope(self.db_url) as session:
                value = night_outcome(session, key)
            if value is None and any(p.poll() is not None for p in self.procs):
                raise RuntimeError("a stage or worker process exited")
            return value

        return wait_until(result, timeout_s, f"the nightly result for {key}", interval_s=0.2)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # The swarm's name is its own; its stages' records go now, the rest of its keys with the
        # server at the end of the session.
        records = (inventory.node_key(self.name, stage[0]) for stage in STAGES)
        self.client.delete(*records, "coordinator")
        self.client.close()


@pytest.fixture
def live_swarm(private_redis, db_url):
    """A swarm on the private Redis and the test's fresh store; every process stops after."""
    swarm = Swarm(private_redis, db_url)
    yield swarm
    swarm.stop()


@pytest.fixture
def redis_url_for_cli(private_redis) -> str:
    """The private Redis, for commands that only read the inventory."""
    return private_redis
