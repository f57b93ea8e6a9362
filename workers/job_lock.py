"""A job's Redis lock: held by the coordinator running it, and how a stalled job is told apart
from a slow one (its lock has lapsed)."""

from __future__ import annotations

import time
from datetime import timedelta

import redis
from sqlalchemy import select
from sqlalchemy.orm import Session

from models import Job
from models.db import utcnow
from specpipe.settings import stalled_after_s
from workers.locks import LockKeeper


def lock_key(swarm: str, job_id: int) -> str:
    """The Redis key of a job's lock, held while a coordinator runs it."""
    return f"specpipe:{swarm}:job-lock:{job_id}"


def lock_first(
    client: redis.Redis, swarm: str, job_ids: list[int]
) -> tuple[int, LockKeeper] | None:
    """(job id, its started LockKeeper) for the first of `job_ids` no coordinator holds."""
    for job_id in job_ids:
        # Not thread-local: the keeper's thread refreshes the token this thread took.
        lock = client.lock(lock_key(swarm, job_id), timeout=stalled_after_s(), thread_local=False)
        keeper = LockKeeper(lock)
        if keeper.start():
            return job_id, keeper
    return None


def lock_first_through_outage(
    client: redis.Redis, swarm: str, job_ids: list[int], outage_s: float
) -> tuple[int, LockKeeper] | None:
    """`lock_first`, tried again while Redis is unreachable (restarting, loading its file) for
    up to `outage_s` seconds; the last RedisError is raised if it stays away."""
    give_up = time.monotonic() + outage_s
    pause = 0.2
    while True:
        try:
            return lock_first(client, swarm, job_ids)
        except redis.RedisError:
            if time.monotonic() + pause > give_up:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 2.0)


def stalled_jobs(session: Session, client: redis.Redis, swarm: str, after_s: float) -> list[int]:
    """Running jobs without progress for `after_s` seconds whose lock has lapsed."""
    cutoff = utcnow() - timedelta(seconds=after_s)
    running = session.scalars(
        select(Job.id).where(Job.status == "running", Job.updated_at < cutoff).order_by(Job.id)
    ).all()
    # A held lock means its coordinator is alive, only slow.
    return [job_id for job_id in running if not client.exists(lock_key(swarm, job_id))]
