"""Creating a job from checked parameters and handing it to the coordinator."""

from __future__ import annotations

from flask import current_app
from sqlalchemy.orm import Session

from app.queue import enqueue_job
from models.jobs import Job
from specpipe.stopping import MAX_STOP_CHARS, MAX_STOP_STRINGS
from workers import queue
from workers.queue import QueueUnavailable

__all__ = ["QueueUnavailable", "limits", "rerun_params", "submit_job"]


def limits() -> dict[str, int]:
    """The app's limits on job requests."""
    config = current_app.config
    return {
        "max_prompt_chars": config["MAX_PROMPT_CHARS"],
        "max_new_tokens": config["MAX_NEW_TOKENS"],
        "max_draft_k": config["MAX_DRAFT_K"],
        "max_stop_strings": MAX_STOP_STRINGS,
        "max_stop_chars": MAX_STOP_CHARS,
    }


def submit_job(session: Session, params: dict) -> Job:
    """Store a queued job for `params` on the app's model and enqueue it (QueueUnavailable)."""
    return queue.submit_job(session, params, current_app.config["MODEL"], enqueue_job)


def rerun_params(job: Job) -> dict:
    """The parameters that reproduce `job`: same prompt, settings and seed."""
    return {"prompt": job.prompt, **job.params()}
