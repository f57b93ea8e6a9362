"""Enqueueing jobs: the app's Celery client, which sends the coordinator task by name.

The web app imports no task code: `workers.queue` publishes `workers.coordinator.generate`
with the job id to the coordinator queue, JSON-serialised, and the coordinator does the rest.
"""

from __future__ import annotations

from celery import Celery
from flask import Flask, current_app

from workers.queue import GENERATE_TASK, make_client, send_generate

__all__ = ["GENERATE_TASK", "enqueue_job", "init_app"]


def init_app(app: Flask) -> None:
    """Make the app's Celery client from `celery_config`, on the app's Redis."""
    app.extensions["specpipe.celery"] = make_client(app.config["REDIS_URL"])


def enqueue_job(job_id: int) -> str:
    """Publish the generate task for `job_id`; returns the task id, raises when unreachable."""
    client: Celery = current_app.extensions["specpipe.celery"]
    return send_generate(client, job_id, current_app.config["COORDINATOR_QUEUE"])
