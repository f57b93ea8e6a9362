"""Rate limits (Flask-Limiter), counted in the swarm's Redis so every web process shares them.

Two limits: job submissions per user (`SUBMIT_RATE`: the form, a re-run, the API and the
OpenAI-compatible completions draw on one allowance) and login attempts per client address
(`LOGIN_RATE`). A request over a limit is answered 429 with `Retry-After` (`app.errors`). The
cap on a user's queued and running jobs is not a rate: the submission path checks it
(`workers.submission`).

Each app has its own `Limiter` (as it has its own metrics registry), which wraps the limited
views once the blueprints are registered, so several apps in one process never share state.
"""

from __future__ import annotations

import time

from flask import Flask, current_app, g
from flask_limiter import Limiter
from flask_limiter.util import get_remote_address

SUBMISSION_ENDPOINTS = (
    "jobs.submit",
    "jobs.rerun",
    "api.create_job",
    "openai.chat_completions",
    "openai.completions",
)
LOGIN_ENDPOINT = "auth.login"


def storage_uri(redis_url: str) -> str:
    """The limits library's name for a Redis URL (it spells a unix socket `redis+unix://`)."""
    if redis_url.startswith("unix://"):
        return "redis+unix://" + redis_url[len("unix://") :]
    return redis_url


def _user_key() -> str:
    return f"user-{g.user.id}"


def init_app(app: Flask) -> None:
    """Limit the submission and login views; call after the blueprints are registered.

    Counts go to the app's Redis unless `RATELIMIT_STORAGE_URI` says otherwise."""
    app.config.setdefault("RATELIMIT_STORAGE_URI", storage_uri(app.config["REDIS_URL"]))
    app.config.setdefault("RATELIMIT_KEY_PREFIX", "specpipe-limits")
    limiter = Limiter(
        get_remote_address,
        app=app,
        strategy="moving-window",
        headers_enabled=False,  # Retry-After is set on a 429 only (app.errors)
        # A Redis that stops answering must not stop the app: count in memory until it is back.
        in_memory_fallback_enabled=True,
    )
    submissions = limiter.shared_limit(
        lambda: app.config["SUBMIT_RATE"], scope="submit", key_func=_user_key, methods=["POST"]
    )
    for endpoint in SUBMISSION_ENDPOINTS:
        app.view_functions[endpoint] = submissions(app.view_functions[endpoint])
    logins = limiter.shared_limit(
        lambda: app.config["LOGIN_RATE"],
        scope="login",
        key_func=get_remote_address,
        methods=["POST"],
    )
    app.view_functions[LOGIN_ENDPOINT] = logins(app.view_functions[LOGIN_ENDPOINT])
    app.extensions["specpipe.limiter"] = limiter


def retry_after_s() -> int:
    """Seconds until the limit this request broke lets another request through (at least 1)."""
    current = current_app.extensions["specpipe.limiter"].current_limit
    if current is None:
        return 1
    return max(1, int(current.reset_at - time.time()))
