"""Waiting for a request's jobs (one per choice) by reading their rows, which the coordinator
updates after every round."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.openai.errors import OpenAIError
from models.jobs import Job

KEEP_ALIVE_S = 1.0  # a stream sends a comment this often while it waits: a gone client shows


def job_updates(
    session: Session,
    job_ids: Sequence[int],
    poll_s: float,
    wait_s: float,
    idle_s: float | None = None,
) -> Iterator[Job | None]:
    """Each of the jobs each time its stored progress changed, and once more when it has
    finished, in the order of `job_ids` within a look; with `idle_s`, None after that many
    seconds without a change to any of them. Ends once every job has finished.

    Each look reads the unfinished jobs' rows afresh (a new transaction, so a snapshot never
    hides a round), in one query. Raises TimeoutError after `wait_s` seconds without all of
    them finishing."""
    deadline = time.monotonic() + wait_s
    seen: dict[int, tuple] = {}
    waiting, last_change = list(job_ids), time.monotonic()
    while True:
        session.rollback()  # ends the read transaction: the next look sees the latest round
        jobs = _read(session, waiting)
        changed = [job for job in jobs if _state(job) != seen.get(job.id) or job.finished]
        waiting = [job.id for job in jobs if not job.finished]
        for job in changed:
            seen[job.id], last_change = _state(job), time.monotonic()
            yield job
        if not changed and idle_s is not None and time.monotonic() - last_change >= idle_s:
            last_change = time.monotonic()
            yield None
        if not waiting:
            return
        if time.monotonic() >= deadline:
            which = ("job " if len(waiting) == 1 else "jobs ") + ", ".join(map(str, waiting))
            raise TimeoutError(f"{which} did not finish within {wait_s:g} s")
        # Hand the connection back to the pool while asleep: many waiting requests must not
        # hold all of its few connections, nor keep the pages waiting for one.
        session.rollback()
        time.sleep(poll_s)


def _read(session: Session, job_ids: list[int]) -> list[Job]:
    """The jobs as stored now, in the order of `job_ids`."""
    if len(job_ids) == 1:  # the common case: one read by primary key
        job = session.get(Job, job_ids[0], populate_existing=True)
        return [job] if job is not None else []
    rows = session.scalars(
        select(Job).where(Job.id.in_(job_ids)).execution_options(populate_existing=True)
    )
    by_id = {job.id: job for job in rows}
    return [by_id[i] for i in job_ids if i in by_id]


def _state(job: Job) -> tuple:
    """What of a job a reader is told about when it changes."""
    return (job.status, len(job.output_ids or []), job.output_text)


def cancel_job(session: Session, job_id: int) -> None:
    """Ask the coordinator to stop the job, unless it has finished meanwhile."""
    session.rollback()
    job = session.get(Job, job_id, populate_existing=True)
    if job is not None and job.request_cancel():
        session.commit()


def cancel_jobs(session: Session, job_ids: Iterable[int]) -> None:
    """Ask the coordinator to stop each of the jobs that has not finished meanwhile."""
    for job_id in job_ids:
        cancel_job(session, job_id)


def failure(job: Job) -> OpenAIError:
    """The error a job that did not finish well answers: cancelled (409) or failed (500)."""
    if job.status == "cancelled":
        return OpenAIError(409, f"job {job.id} was cancelled", code="cancelled")
    return OpenAIError(
        500, f"job {job.id} failed: {job.error or 'no reason given'}", kind="server_error"
    )
