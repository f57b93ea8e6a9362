"""Submitting jobs: store a queued job and hand it to the coordinator, for the web app and CLI.

The generate task is published by name with a light Celery client (no task code imported),
JSON-serialised, to the coordinator queue. A job whose hand-off fails is marked failed, so the
store never holds a queued job nobody will run.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

from celery import Celery
from sqlalchemy.orm import Session

from models.db import utcnow
from models.jobs import Job

log = logging.getLogger(__name__)

GENERATE_TASK = "workers.coordinator.generate"
COORDINATOR_QUEUE = "coordinator"


class QueueUnavailable(RuntimeError):
    """The job was stored but could not be handed to the coordinator."""

    def __init__(self, job: Job, reason: str):
        super().__init__(reason)
        self.job = job


def make_client(broker_url: str) -> Celery:
    """A Celery client on `broker_url` with the project's settings (JSON only)."""
    client = Celery("specpipe-client", set_as_current=False)
    client.config_from_object("celery_config")
    client.conf.update(
        broker_url=broker_url,
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        broker_connection_timeout=2,
    )
    return client


def send_generate(client: Celery, job_id: int, queue: str = COORDINATOR_QUEUE) -> str:
    """Publish the generate task for `job_id`; returns the task id, raises when unreachable."""
    result = client.send_task(
        GENERATE_TASK,
        args=[job_id],
        queue=queue,
        retry=True,
        retry_policy={"max_retries": 1, "interval_start": 0, "interval_step": 0.5},
    )
    return result.id


def submit_job(session: Session, params: dict, model: str, enqueue: Callable[[int], str]) -> Job:
    """Store a queued job for checked `params` (seed drawn when None, no stop strings when
    `stop` is missing) and enqueue it.

    Raises QueueUnavailable, with the job marked failed, when the broker cannot be reached.
    """
    seed = params.get("seed")
    job = Job(
        prompt=params["prompt"],
        model=model,
        max_new_tokens=params["max_new_tokens"],
        temp=params["temp"],
        top_p=params["top_p"],
        top_k=params["top_k"],
        seed=secrets.randbits(64) if seed is None else seed,
        seed_was_random=seed is None,
        draft_k=params["draft_k"],
        stop=list(params.get("stop") or []),
        status="queued",
    )
    session.add(job)
    session.commit()
    try:
        job.task_id = enqueue(job.id)
    except Exception as exc:  # kombu and redis raise several types; all mean the same here
        log.warning("could not enqueue job %s: %s", job.id, exc)
        job.status = "failed"
        job.error = f"could not reach the job queue: {exc}"
        job.finished_at = utcnow()
        session.commit()
        raise QueueUnavailable(job, job.error) from exc
    session.commit()
    return job
