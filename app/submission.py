"""Creating a job from checked parameters and handing it to the coordinator."""

from __future__ import annotations

import logging
import secrets

from flask import current_app
from sqlalchemy.orm import Session

from app.queue import enqueue_job
from models.db import utcnow
from models.jobs import Job

log = logging.getLogger(__name__)


class QueueUnavailable(RuntimeError):
    """The job was stored but could not be handed to the coordinator."""

    def __init__(self, job: Job, reason: str):
        super().__init__(reason)
        self.job = job


def limits() -> dict[str, int]:
    """The app's limits on job requests."""
    config = current_app.config
    return {
        "max_prompt_chars": config["MAX_PROMPT_CHARS"],
        "max_new_tokens": config["MAX_NEW_TOKENS"],
        "max_draft_k": config["MAX_DRAFT_K"],
    }


def submit_job(session: Session, params: dict) -> Job:
    """Store a queued job for `params` (seed drawn when None) and enqueue it.

    Raises QueueUnavailable, with the job marked failed, when the broker cannot be reached.
    """
    seed = params.get("seed")
    job = Job(
        prompt=params["prompt"],
        model=current_app.config["MODEL"],
        max_new_tokens=params["max_new_tokens"],
        temp=params["temp"],
        top_p=params["top_p"],
        top_k=params["top_k"],
        seed=secrets.randbits(64) if seed is None else seed,
        seed_was_random=seed is None,
        draft_k=params["draft_k"],
        status="queued",
    )
    session.add(job)
    session.commit()
    try:
        job.task_id = enqueue_job(job.id)
    except Exception as exc:  # kombu and redis raise several types; all mean the same here
        log.warning("could not enqueue job %s: %s", job.id, exc)
        job.status = "failed"
        job.error = f"could not reach the job queue: {exc}"
        job.finished_at = utcnow()
        session.commit()
        raise QueueUnavailable(job, job.error) from exc
    session.commit()
    return job


def rerun_params(job: Job) -> dict:
    """The parameters that reproduce `job`: same prompt, settings and seed."""
    return {"prompt": job.prompt, **job.params()}
