"""The app's job submitter: made once per app from its configuration, read by the views that
check and submit jobs (the form, the JSON API and the OpenAI-compatible API)."""

from __future__ import annotations

from flask import Flask, current_app

from specpipe.settings import JobLimits
from workers.submission import Submitter

EXTENSION = "specpipe.submitter"


def init_app(app: Flask) -> None:
    """Give `app` a submitter publishing to its coordinator queue under its job limits."""
    limits = JobLimits(
        app.config["MAX_PROMPT_CHARS"],
        app.config["MAX_NEW_TOKENS"],
        app.config["MAX_DRAFT_K"],
        app.config["MAX_ACTIVE_JOBS"],
    )
    app.extensions[EXTENSION] = Submitter.connect(
        app.config["REDIS_URL"], app.config["MODEL"], limits, app.config["COORDINATOR_QUEUE"]
    )


def submitter() -> Submitter:
    """The app's job submitter: checks requests and hands jobs to the coordinator."""
    return current_app.extensions[EXTENSION]
