"""What the Celery broker holds of the coordinator's messages, and the queued jobs it lost."""

from __future__ import annotations

import base64
import json
from datetime import timedelta

import redis
from sqlalchemy import select
from sqlalchemy.orm import Session

from models import Job
from models.db import utcnow
from workers.names import GENERATE_TASK

QUEUED_GRACE_S = 30.0  # a queued job younger than this may still be on its way to the broker
UNACKED_KEY = "unacked"  # where Celery's Redis transport keeps delivered, unacked messages


def stranded_jobs(session: Session, client: redis.Redis, queue: str) -> list[int]:
    """Queued jobs older than `QUEUED_GRACE_S` whose generate message the broker holds nowhere:
    not waiting in `queue`, not taken by a worker (a Redis that lost its data, a publish that
    never arrived). Sending them again is safe: a job runs once whatever its deliveries."""
    cutoff = utcnow() - timedelta(seconds=QUEUED_GRACE_S)
    queued = session.scalars(
        select(Job.id).where(Job.status == "queued", Job.created_at < cutoff).order_by(Job.id)
    ).all()
    if not queued:
        return []
    on_broker = broker_job_ids(client, queue)
    return [job_id for job_id in queued if job_id not in on_broker]


def broker_job_ids(client: redis.Redis, queue: str) -> set[int]:
    """The job ids of the generate messages waiting in `queue` or delivered and not yet
    acknowledged, as Celery's Redis transport keeps them (a list per queue, a hash `unacked`)."""
    raw = [json.loads(m) for m in client.lrange(queue, 0, -1)]
    raw += [json.loads(m)[0] for m in client.hvals(UNACKED_KEY)]
    ids = set()
    for message in raw:
        try:
            if message["headers"]["task"] != GENERATE_TASK:
                continue
            args = json.loads(base64.b64decode(message["body"]))[0]
            ids.add(int(args[0]))
        except (KeyError, IndexError, TypeError, ValueError):
            continue  # not a message of ours
    return ids
