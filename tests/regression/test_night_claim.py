"""Who runs a night: one worker at a time, never twice once done; a dead worker's lock lapses."""

from __future__ import annotations

import uuid

import pytest
import redis

from tests.waiting import wait_until
from workers.regression import attempts_key, claim_night, lock_key, result_key


@pytest.fixture
def client(private_redis):
    client = redis.Redis.from_url(private_redis)
    yield client
    client.close()


def outcomes(client, swarm: str, key: str) -> list[str]:
    return [a.decode().split()[-1] for a in client.lrange(attempts_key(swarm, key), 0, -1)]


def wait_refreshes(client: redis.Redis, name: str, times: int) -> None:
    """Wait until the lock `name` has been refreshed `times` times: its TTL went back up."""
    seen = {"ttl": client.pttl(name), "refreshes": 0}

    def refreshed() -> bool:
        ttl = client.pttl(name)
        if ttl > seen["ttl"]:
            seen["refreshes"] += 1
        seen["ttl"] = ttl
        return seen["refreshes"] >= times

    wait_until(refreshed, 10, f"{times} refreshes of {name}", detail=lambda: seen)


def test_a_night_runs_once_while_held_and_never_again_once_done(client):
    swarm, key = f"s{uuid.uuid4().hex[:6]}", "night-2026-11-30"
    first = claim_night(client, swarm, key, "w1", ttl_s=1)
    assert first is not None
    # The keeper refreshes the lock again and again, so it outlives its first lifetime, still
    # w1's: each refresh moves its expiry on by a lifetime.
    wait_refreshes(client, lock_key(swarm, key), 2)
    assert client.get(lock_key(swarm, key)) == first.lock.local.token
    assert claim_night(client, swarm, key, "w2", ttl_s=1) is None
    client.set(result_key(swarm, key), "{}")  # what a finished run leaves
    first.stop()
    assert not client.exists(lock_key(swarm, key))
    assert claim_night(client, swarm, key, "w3", ttl_s=1) is None
    assert outcomes(client, swarm, key) == ["ran", "skipped", "skipped"]


def test_a_dead_workers_lock_lapses_and_the_redelivered_night_runs(client):
    swarm, key = f"s{uuid.uuid4().hex[:6]}", "night-2026-11-30"
    dead = client.lock(lock_key(swarm, key), timeout=1, thread_local=False)
    assert dead.acquire(blocking=False)  # taken, then its process was killed: no refreshes
    assert claim_night(client, swarm, key, "w1", ttl_s=1) is None
    wait_until(lambda: not client.exists(lock_key(swarm, key)), 10, "the dead lock to lapse")
    again = claim_night(client, swarm, key, "w1", ttl_s=1)
    assert again is not None
    again.stop()
    assert outcomes(client, swarm, key) == ["skipped", "ran"]


def test_a_run_that_failed_leaves_the_night_open_for_a_retry(client):
    swarm, key = f"s{uuid.uuid4().hex[:6]}", "night-2026-11-30"
    claim_night(client, swarm, key, "w1", ttl_s=1).stop()  # raised before storing an outcome
    retry = claim_night(client, swarm, key, "w1", ttl_s=1)
    assert retry is not None
    retry.stop()
