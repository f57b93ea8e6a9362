"""Rate limits (Flask-Limiter), counted in the swarm's Redis so every web process shares them.

Job submissions per user (`SUBMIT_RATE`: the form, a re-run, the API and the OpenAI-compatible
completions draw on one allowance, a completion one job for each choice it asks for), and failed
logins twice over, both at the client's address: per address (`LOGIN_RATE`), whatever the names
posted, and per account name posted from that address (`LOGIN_ACCOUNT_RATE`). Neither counts one
account's failures across addresses: then a stranger posting wrong passwords for a name would
lock its owner out everywhere. Behind a trusted proxy the client address is the forwarded one
(`app.proxy`). A request over a limit is answered 429 with `Retry-After` (`app.errors`). The cap
on a user's queued and running jobs is not a rate: the submission path checks it
(`workers.submission`).

Each app has its own `Limiter` (as it has its own metrics registry), which wraps the limited
views once the blueprints are registered, so several apps in one process never share state.
"""

from __future__ import annotations

import hashlib
import time

from flask import Flask, Response, current_app, g, request
from flask_limiter import Limiter
from flask_limiter.util import get_remote_address

from app.openai.requests import choices_asked

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


def _jobs_asked() -> int:
    """What a submission costs of the allowance: the jobs it asks for, one unless it is an
    OpenAI completion asking for several choices."""
    return choices_asked() if request.blueprint == "openai" else 1


def _account_at_address_key() -> str:
    # Hashed: the posted name is anything a client sends, of any length. The address is part
    # of the key, so failures from one address never refuse the account's owner at another.
    name = request.form.get("username", "")
    material = f"{get_remote_address()}\0{name}".encode("utf-8", "surrogatepass")
    return "account-" + hashlib.sha256(material).hexdigest()[:32]


def failed_login(response: Response) -> bool:
    """Whether a login POST failed (a wrong name or password, or a bad form): only those count,
    so neither a successful login nor a refused one uses up an allowance."""
    return response.status_code == 400


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
        # A request whose count was under way in Redis as another request's failure switched
        # to memory is let through uncounted (and logged), not answered 500.
        swallow_errors=True,
    )
    submissions = limiter.shared_limit(
        lambda: app.config["SUBMIT_RATE"],
        scope="submit",
        key_func=_user_key,
        methods=["POST"],
        cost=_jobs_asked,
    )
    for endpoint in SUBMISSION_ENDPOINTS:
        app.view_functions[endpoint] = submissions(app.view_functions[endpoint])
    by_address = limiter.shared_limit(
        lambda: app.config["LOGIN_RATE"],
        scope="login",
        key_func=get_remote_address,
        methods=["POST"],
        deduct_when=failed_login,
    )
    by_account = limiter.shared_limit(
        lambda: app.config["LOGIN_ACCOUNT_RATE"],
        scope="login-account-address",
        key_func=_account_at_address_key,
        methods=["POST"],
        deduct_when=failed_login,
    )
    app.view_functions[LOGIN_ENDPOINT] = by_account(by_address(app.view_functions[LOGIN_ENDPOINT]))
    app.extensions["specpipe.limiter"] = limiter


def retry_after_s() -> int:
    """Seconds until the limit this request broke lets another request through (at least 1)."""
    current = current_app.extensions["specpipe.limiter"].current_limit
    if current is None:
        return 1
    return max(1, int(current.reset_at - time.time()))
