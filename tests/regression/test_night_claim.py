"""Who runs a night: one worker at a time, never twice once its run is stored; a dead worker's
lock lapses; nothing written into Redis marks a night done; only tonight's key (dated in the
swarm's time zone) or a manual run's is run at all."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, date, datetime, timedelta

import pytest
import redis

from models.db import utcnow
from models.proof_store import night_outcome
from models.runs import Proof, Run
from tests.waiting import wait_until
from workers import regression
from workers.names import NIGHTLY_TASK, manual_key, night_key
from workers.regression import (
    attempts_key,
    claim_night,
    key_refusal,
    lock_key,
    swarm_today,
)


@pytest.fixture
def client(private_redis):
    client = redis.Redis.from_url(private_redis)
    yield client
    client.close()


@pytest.fixture
def claim(client, db_session):
    """claim_night on the private Redis and the test's store."""

    def claim(swarm: str, key: str, holder: str):
        return claim_night(client, db_session, swarm, key, holder, ttl_s=1)

    return claim


def store_night(session, key: str, verdict: str = "pass") -> Run:
    """What a finished nightly run leaves: its run, stored under the night's key."""
    run = Run(kind="nightly", night=key, verdict=verdict)
    session.add(run)
    session.commit()
    return run


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


def test_a_night_runs_once_while_held_and_never_again_once_done(client, claim, db_session):
    swarm, key = f"s{uuid.uuid4().hex[:6]}", "night-2026-11-30"
    first = claim(swarm, key, "w1")
    assert first is not None
    # The keeper refreshes the lock again and again, so it outlives its first lifetime, still
    # w1's: each refresh moves its expiry on by a lifetime.
    wait_refreshes(client, lock_key(swarm, key), 2)
    assert client.get(lock_key(swarm, key)) == first.lock.local.token
    assert claim(swarm, key, "w2") is None
    store_night(db_session, key)
    first.stop()
    assert not client.exists(lock_key(swarm, key))
    assert claim(swarm, key, "w3") is None
    assert outcomes(client, swarm, key) == ["ran", "skipped", "skipped"]


def test_a_dead_workers_lock_lapses_and_the_redelivered_night_runs(client, claim):
    swarm, key = f"s{uuid.uuid4().hex[:6]}", "night-2026-11-30"
    dead = client.lock(lock_key(swarm, key), timeout=1, thread_local=False)
    assert dead.acquire(blocking=False)  # taken, then its process was killed: no refreshes
    assert claim(swarm, key, "w1") is None
    wait_until(lambda: not client.exists(lock_key(swarm, key)), 10, "the dead lock to lapse")
    again = claim(swarm, key, "w1")
    assert again is not None
    again.stop()
    assert outcomes(client, swarm, key) == ["skipped", "ran"]


def test_a_run_that_failed_leaves_the_night_open_for_a_retry(claim):
    swarm, key = f"s{uuid.uuid4().hex[:6]}", "night-2026-11-30"
    claim(swarm, key, "w1").stop()  # raised before storing its run
    retry = claim(swarm, key, "w1")
    assert retry is not None
    retry.stop()


def test_an_outcome_written_into_redis_does_not_mark_a_night_done(client, claim, db_session):
    """Anyone with the broker's password can write keys; on main, a `nightly:result` key made
    the worker skip the night."""
    swarm, key = f"s{uuid.uuid4().hex[:6]}", "night-2026-12-01"
    fake = json.dumps({"key": key, "run_id": 1, "name": "run-faked", "verdict": "pass"})
    client.set(f"specpipe:{swarm}:nightly:result:{key}", fake)
    keeper = claim(swarm, key, "w1")
    assert keeper is not None  # the night runs
    keeper.stop()
    assert night_outcome(db_session, key) is None  # and nothing counts as its verdict yet
    run = store_night(db_session, key, verdict="error")
    run.proofs.append(
        Proof(kind="on_swarm", trigger="nightly", verdict="error", summary={"error": "no ring"})
    )
    db_session.commit()
    assert night_outcome(db_session, key) == {
        "key": key,
        "run_id": run.id,
        "name": run.name,
        "verdict": "error",
        "failed": {"on_swarm": "error: no ring"},  # what `regression run` prints under it
    }


def test_tonight_is_dated_in_the_swarms_time_zone(monkeypatch):
    late_in_utc = datetime(2026, 12, 7, 23, 30, tzinfo=UTC)  # already the 8th in Tokyo
    assert swarm_today(late_in_utc) == date(2026, 12, 7)  # the default zone is UTC
    monkeypatch.setenv("SPECPIPE_TIMEZONE", "Asia/Tokyo")
    assert swarm_today(late_in_utc) == date(2026, 12, 8)
    monkeypatch.setenv("SPECPIPE_TIMEZONE", "Mars/Olympus_Mons")
    with pytest.raises(ValueError, match="SPECPIPE_TIMEZONE must be an IANA time zone"):
        swarm_today(late_in_utc)


@pytest.mark.parametrize(
    "key",
    ["night-2026-12-09", "night-2026-12-07", "night-2026-12-8", "manual-", "manual-XYZ", "x", 7],
)
def test_only_tonights_key_or_a_manual_one_is_run(key):
    today = date(2026, 12, 8)
    assert key_refusal(night_key(today), today) is None
    assert key_refusal(manual_key(), today) is None
    refusal = key_refusal(key, today)
    assert refusal is not None and "night-2026-12-08" in refusal


@pytest.fixture
def nightly_env(monkeypatch, private_redis, db_url):
    """The task's settings pointed at the private Redis, the test's store and a swarm of its
    own, in a time zone whose date is not UTC's right now; a night that got past the refusal
    would be run by a stub, never the proofs."""
    swarm = f"s{uuid.uuid4().hex[:6]}"
    zone = "Pacific/Kiritimati" if utcnow().hour >= 10 else "Pacific/Pago_Pago"  # UTC+14, -11
    for name, value in {
        "REDIS_URL": private_redis,
        "DATABASE_URL": db_url,
        "SPECPIPE_SWARM": swarm,
        "SPECPIPE_TIMEZONE": zone,
    }.items():
        monkeypatch.setenv(name, value)
    ran = []

    def stub_run(session, target, settings, seed, sizes, night=None):
        ran.append(night)
        return store_night(session, night)

    monkeypatch.setattr(regression, "run_nightly", stub_run)
    monkeypatch.setattr(regression, "open_target", lambda model: "no model in this test")
    return swarm, ran


def nightly(**kwargs) -> dict:
    """Run the nightly task in this process, as the worker's app runs it (with its session)."""
    from workers.celery_app import celery

    return celery.tasks[NIGHTLY_TASK](**kwargs)


@pytest.mark.parametrize("days", [1, -1, 30])
def test_a_key_for_another_night_claims_and_stores_nothing(
    client, claim, db_session, nightly_env, days
):
    swarm, ran = nightly_env
    key = night_key(swarm_today() + timedelta(days=days))  # queued ahead, or left behind
    outcome = nightly(key=key)
    assert "is not tonight's key" in outcome["refused"] and ran == []
    assert not client.exists(lock_key(swarm, key)) and not client.exists(attempts_key(swarm, key))
    assert night_outcome(db_session, key) is None
    keeper = claim(swarm, key, "w1")  # so that night still runs when it comes
    assert keeper is not None
    keeper.stop()


def test_tonights_key_runs(client, db_session, nightly_env):
    swarm, ran = nightly_env
    key = night_key(swarm_today())
    assert key != night_key(utcnow().date())
    outcome = nightly()  # beat sends no key: tonight's, in the swarm's time zone
    assert outcome["key"] == key and ran == [key] and "refused" not in outcome
    assert outcomes(client, swarm, key) == ["ran"]
    assert night_outcome(db_session, key)["run_id"] == outcome["run_id"]
