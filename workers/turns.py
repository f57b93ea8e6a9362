"""Whose turn it is: the order in which coordinators take queued jobs, and a job's place in it.

Users take turns rather than jobs: the next job to run is one of the user with the fewest jobs
running, among those the user served longest ago, then the oldest job. One user alone gets
every session; a user who queued fifty jobs does not keep another's single job waiting behind
them. The coordinator runs jobs in this order; the job page and the API show a queued job's place
in it, which may change as other users' jobs arrive.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from models import Job
from models.db import as_utc

log = logging.getLogger("specpipe.coordinator")


def fair_order(session: Session) -> list[int]:
    """The ids of the queued jobs, the next to run first."""
    queued = session.execute(
        select(Job.id, Job.user_id).where(Job.status == "queued").order_by(Job.id)
    ).all()
    owners = {user_id for _, user_id in queued}
    running = dict(
        session.execute(
            select(Job.user_id, func.count())
            .where(Job.status == "running", Job.user_id.in_(owners))
            .group_by(Job.user_id)
        ).all()
    )
    last_start = _last_starts(session, owners)
    never = datetime.min.replace(tzinfo=UTC)

    def turn(row) -> tuple:
        job_id, user_id = row
        return running.get(user_id, 0), as_utc(last_start.get(user_id)) or never, job_id

    return [job_id for job_id, _ in sorted(queued, key=turn)]


def _last_starts(session: Session, owners: set[int]) -> dict[int, datetime]:
    """When each of `owners` last had a job started. A user whose start times cannot be read
    (a stored value that is not a date) counts as never served, rather than stopping every
    coordinator from choosing the next job."""

    def query(users):
        return (
            select(Job.user_id, func.max(Job.started_at))
            .where(Job.user_id.in_(users), Job.started_at.is_not(None))
            .group_by(Job.user_id)
        )

    try:
        return dict(session.execute(query(owners)).all())
    except (ValueError, TypeError) as exc:
        log.warning("job start times that cannot be read (%s): reading them user by user", exc)
    starts = {}
    for user_id in owners:
        try:
            starts.update(session.execute(query([user_id])).all())
        except (ValueError, TypeError):
            log.warning("user %s: job start times cannot be read; counted as never served", user_id)
    return starts


def queue_place(session: Session, job: Job) -> dict | None:
    """A queued job's place in line, `{"position": 1-based, "queued": all queued}`; None for a
    job that is not queued."""
    if job.status != "queued":
        return None
    order = fair_order(session)
    if job.id not in order:  # it left the queue since it was read
        return None
    return {"position": order.index(job.id) + 1, "queued": len(order)}
