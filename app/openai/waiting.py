"""Waiting for a job by reading its row, which the coordinator updates after every round."""

from __future__ import annotations

import time
from collections.abc import Iterator

from sqlalchemy.orm import Session

from app.openai.errors import OpenAIError
from models.jobs import Job

KEEP_ALIVE_S = 1.0  # a stream sends a comment this often while it waits: a gone client shows


def job_updates(
    session: Session, job_id: int, poll_s: float, wait_s: float, idle_s: float | None = None
) -> Iterator[Job | None]:
    """The job each time its stored progress changed, and once more when it has finished; with
    `idle_s`, None after that many seconds without a change.

    Each look reads the row afresh (a new transaction, so a snapshot never hides a round).
    Raises TimeoutError after `wait_s` seconds without the job finishing."""
    deadline = time.monotonic() + wait_s
    seen, last_change = None, time.monotonic()
    while True:
        session.rollback()  # ends the read transaction: the next look sees the latest round
        job = session.get(Job, job_id, populate_existing=True)
        state = (job.status, len(job.output_ids or []), job.output_text)
        if state != seen or job.finished:
            seen, last_change = state, time.monotonic()
            yield job
        elif idle_s is not None and time.monotonic() - last_change >= idle_s:
            last_change = time.monotonic()
            yield None
        if job.finished:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"job {job_id} did not finish within {wait_s:g} s")
        # Hand the connection back to the pool while asleep: many waiting requests must not
        # hold all of its few connections, nor keep the pages waiting for one.
        session.rollback()
        time.sleep(poll_s)


def cancel_job(session: Session, job_id: int) -> None:
    """Ask the coordinator to stop the job, unless it has finished meanwhile."""
    session.rollback()
    job = session.get(Job, job_id, populate_existing=True)
    if job is not None and job.request_cancel():
        session.commit()


def failure(job: Job) -> OpenAIError:
    """The error a job that did not finish well answers: cancelled (409) or failed (500)."""
    if job.status == "cancelled":
        return OpenAIError(409, f"job {job.id} was cancelled", code="cancelled")
    return OpenAIError(
        500, f"job {job.id} failed: {job.error or 'no reason given'}", kind="server_error"
    )
