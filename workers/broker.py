"""What the Celery broker holds of the coordinator's messages, and the queued jobs it lost."""

from __future__ import annotations

import base64
import json
import logging
from datetime import timedelta

import redis
from sqlalchemy import select
from sqlalchemy.orm import Session

from models import Job
from models.db import utcnow
from workers.names import GENERATE_TASK

log = logging.getLogger("specpipe.coordinator")

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
    acknowledged, as Celery's Redis transport keeps them (a list per queue, a hash `unacked`).
    An entry that is not a generate message of ours, however malformed, is skipped and logged:
    one bad entry must not stop the recovery of every other job."""
    entries = [(m, False) for m in client.lrange(queue, 0, -1)]
    entries += [(m, True) for m in client.hvals(UNACKED_KEY)]
    ids, skipped = set(), 0
    for raw, unacked in entries:
        try:
            job_id = message_job_id(raw, unacked)
        except MalformedEntry:
            skipped += 1
            continue
        if job_id is not None:
            ids.add(job_id)
    if skipped:
        log.warning("skipped %d malformed broker entries in %r and %r", skipped, queue, UNACKED_KEY)
    return ids


class MalformedEntry(ValueError):
    """A broker entry that is not a Celery message as its Redis transport writes them."""


def message_job_id(raw: bytes | str, unacked: bool = False) -> int | None:
    """The job id of one broker entry, None for a message of another task. `unacked` entries
    are `[message, exchange, routing key]`. Raises MalformedEntry for anything else."""
    try:
        message = json.loads(raw)
        if unacked:
            message = message[0]
        if message["headers"]["task"] != GENERATE_TASK:
            return None
        job_id = json.loads(base64.b64decode(message["body"], validate=True))[0][0]
        if isinstance(job_id, bool) or not isinstance(job_id, int):
            raise MalformedEntry(f"job id {job_id!r} is not an integer")
        return job_id
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise MalformedEntry(str(exc)) from None
