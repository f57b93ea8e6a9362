"""The Flask web app: job submission, history, proofs, nodes, the JSON API and the
OpenAI-compatible API.

`create_app` is the factory: configuration from the environment through `specpipe.settings`,
overridden by `test_config`; one database session per request; trusted proxies
(`app.proxy`), logins (`app.auth`), rate limits (`app.limits`), the bound on open completions
(`app.waits`) and security headers (`app.security`); blueprints by area.
"""

from __future__ import annotations

import secrets

from flask import Flask
from werkzeug.routing import IntegerConverter

from specpipe import settings
from workers.names import COORDINATOR_QUEUE


class IdConverter(IntegerConverter):
    """A row id in URLs: 0 … 2^31-1, so an oversized id is a 404, not a database error."""

    def __init__(self, url_map, *args, **kwargs):
        super().__init__(url_map, min=0, max=2**31 - 1)


def default_config() -> dict:
    """Configuration read from the environment."""
    limits = settings.job_limits()
    return {
        "DATABASE_URL": settings.database_url(),
        "REDIS_URL": settings.redis_url(),
        "SWARM": settings.swarm_name(),
        "SECRET_KEY": settings.secret_key(),
        "COORDINATOR_QUEUE": COORDINATOR_QUEUE,
        "MODEL": settings.default_model(),
        "MAX_PROMPT_CHARS": limits.max_prompt_chars,
        "MAX_NEW_TOKENS": limits.max_new_tokens,
        "MAX_DRAFT_K": limits.max_draft_k,
        "MAX_ACTIVE_JOBS": limits.max_active_jobs,
        "SUBMIT_RATE": settings.submit_rate(),
        "LOGIN_RATE": settings.login_rate(),
        "LOGIN_ACCOUNT_RATE": settings.login_account_rate(),
        "TRUSTED_PROXIES": settings.trusted_proxies(),
        "OPEN_COMPLETIONS": settings.open_completions(),
        "OPEN_COMPLETIONS_PER_USER": settings.open_completions_per_user(),
        "MAX_CONTENT_LENGTH": 8 << 20,  # a prompt at its bound, JSON-escaped, fits
        "HISTORY_PAGE_SIZE": 25,
        "OPENAI_POLL_S": 0.1,  # how often a /v1 request reads its job's row
        "OPENAI_WAIT_S": 600.0,  # how long it waits for the job to finish
        "SESSION_COOKIE_HTTPONLY": True,
        "SESSION_COOKIE_SAMESITE": "Lax",
        "SESSION_COOKIE_SECURE": settings.https(),
    }


def create_app(test_config: dict | None = None) -> Flask:
    """Build the app; `test_config` overrides the environment."""
    app = Flask(__name__, instance_path=str(settings.instance_dir()))
    app.url_map.converters["id"] = IdConverter
    app.config.from_mapping(default_config())
    if test_config:
        app.config.update(test_config)
    if not app.config.get("SECRET_KEY"):
        if not (app.testing or app.debug):
            raise RuntimeError(
                "SECRET_KEY is not set: export SECRET_KEY, or run `specpipe up`, "
                "which keeps one in the instance folder"
            )
        app.config["SECRET_KEY"] = secrets.token_hex(32)

    from app import (
        api,
        auth,
        db,
        errors,
        forms,
        jobs,
        metrics,
        nightly,
        nodes,
        ops,
        plots,
        proofs,
        proxy,
        runs,
        security,
        submitting,
        waits,
    )
    from app import limits as rate_limits
    from app.openai import routes as openai_routes

    proxy.init_app(app)
    db.init_app(app)
    submitting.init_app(app)
    waits.init_app(app)
    forms.init_app(app)
    auth.init_app(app)
    security.init_app(app)
    errors.init_app(app)
    nightly.init_app(app)
    metrics.init_app(app)
    plots.init_app(app)
    blueprints = (auth.bp, jobs.bp, proofs.bp, nodes.bp, runs.bp, ops.bp, api.bp, openai_routes.bp)
    for blueprint in blueprints:
        app.register_blueprint(blueprint)
    rate_limits.init_app(app)  # wraps views, so after the blueprints
    forms.csrf.exempt(api.bp)
    forms.csrf.exempt(openai_routes.bp)
    app.jinja_env.globals["site_name"] = "specpipe"
    app.jinja_env.filters.update(forms.FILTERS)
    return app
