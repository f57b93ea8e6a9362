"""Enqueueing jobs: a Celery client that sends the coordinator task by name.

The web app never imports the workers' code: it publishes `workers.coordinator.generate`
with the job id to the coordinator queue, JSON-serialised, and the coordinator does the rest.
"""

from __future__ import annotations

from celery import Celery
from flask import Flask, current_app

GENERATE_TASK = "workers.coordinator.generate"


def init_app(app: Flask) -> None:
    """Make the app's Celery client from `celery_config`, on the app's Redis."""
    client = Celery("specpipe-web", set_as_current=False)
    client.config_from_object("celery_config")
    client.conf.update(
        broker_url=app.config["REDIS_URL"],
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        broker_connection_timeout=2,
    )
    app.extensions["specpipe.celery"] = client


def enqueue_job(job_id: int) -> str:
    """Publish the generate task for `job_id`; returns the task id, raises when unreachable."""
    client: Celery = current_app.extensions["specpipe.celery"]
    result = client.send_task(
        GENERATE_TASK,
        args=[job_id],
        queue=current_app.config["COORDINATOR_QUEUE"],
        retry=True,
        retry_policy={"max_retries": 1, "interval_start": 0, "interval_step": 0.5},
    )
    return result.id
