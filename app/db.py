"""One database session per request, closed when the request ends."""

from __future__ import annotations

from flask import Flask, current_app, g
from sqlalchemy.orm import Session

from models.db import make_session_factory


def init_app(app: Flask) -> None:
    """Bind a session factory to the app's database and close sessions on teardown."""
    app.extensions["specpipe.sessions"] = make_session_factory(app.config["DATABASE_URL"])
    app.teardown_appcontext(close_session)


def get_session() -> Session:
    """This request's session, opened on first use."""
    if "db_session" not in g:
        g.db_session = current_app.extensions["specpipe.sessions"]()
    return g.db_session


def close_session(error: BaseException | None = None) -> None:
    """Roll back anything uncommitted and close the request's session."""
    session = g.pop("db_session", None)
    if session is not None:
        if error is not None:
            session.rollback()
        session.close()
