"""The nightly regression's state for every page: a banner while the newest nightly failed."""

from __future__ import annotations

from flask import Flask
from sqlalchemy import select

from app.db import get_session
from models.runs import Run


def latest_nightly() -> Run | None:
    """The newest finished nightly run, if any."""
    return (
        get_session()
        .scalars(
            select(Run)
            .where(Run.kind == "nightly", Run.verdict.in_(("pass", "fail", "error")))
            .order_by(Run.created_at.desc(), Run.id.desc())
            .limit(1)
        )
        .first()
    )


def init_app(app: Flask) -> None:
    """Give every template `failed_nightly`: the newest nightly run when it did not pass."""

    @app.context_processor
    def nightly_state() -> dict:
        try:
            run = latest_nightly()
        except Exception:  # a page must render even when the store is down (e.g. error pages)
            run = None
        return {"failed_nightly": run if run is not None and run.verdict != "pass" else None}
