"""Operations endpoints: `/healthz` (database and Redis reachable) and `/metrics` (Prometheus,
see `app.metrics`)."""

from __future__ import annotations

import redis
from flask import Blueprint, Response, current_app, jsonify
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4
from sqlalchemy import text

from app.db import get_session
from app.metrics import exposition

bp = Blueprint("ops", __name__)


@bp.get("/healthz")
def healthz():
    """200 when the database and Redis answer, else 503 naming what failed."""
    checks = {}
    try:
        get_session().execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:  # any driver error means unreachable
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        client = redis.Redis.from_url(
            current_app.config["REDIS_URL"], socket_connect_timeout=1, socket_timeout=1
        )
        client.ping()
        client.close()
        checks["redis"] = "ok"
    except Exception as exc:  # any client error means unreachable
        checks["redis"] = f"error: {type(exc).__name__}"
    healthy = all(v == "ok" for v in checks.values())
    return jsonify({"status": "ok" if healthy else "error", **checks}), 200 if healthy else 503


@bp.get("/metrics")
def metrics():
    """Prometheus text exposition: jobs by status, tokens, tok/s, acceptance, nodes, nightly."""
    # The plain text format, version 0.0.4, is what `exposition` writes (CONTENT_TYPE_LATEST
    # announces 1.0.0, which prometheus_client itself only sends when a scraper asks for it).
    return Response(exposition(), content_type=CONTENT_TYPE_PLAIN_0_0_4)
