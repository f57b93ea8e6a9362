"""Operations endpoints: `/healthz` (database and Redis reachable, open to all) and `/metrics`
(Prometheus, see `app.metrics`; for a client with an API token, or one on this host when no
proxy is configured: behind one, every client would look local)."""

from __future__ import annotations

import ipaddress

import redis
from flask import Blueprint, Response, current_app, jsonify, request
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4
from sqlalchemy import text

from app.auth import user_from_token
from app.db import get_session
from app.metrics import exposition
from app.proxy import behind_proxy

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


def is_loopback(address: str | None) -> bool:
    """Whether the client's address is this host's own (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(address or "").is_loopback
    except ValueError:
        return False


@bp.get("/metrics")
def metrics():
    """Prometheus text exposition: jobs by status, tokens, tok/s, acceptance, nodes, nightly."""
    local = not behind_proxy() and is_loopback(request.remote_addr)
    if not local and user_from_token() is None:
        where = "" if behind_proxy() else " or a client on this host"
        return Response(
            f"metrics need an API token (Authorization: Bearer ...){where}\n",
            status=401,
            content_type="text/plain; charset=utf-8",
            headers={"WWW-Authenticate": 'Bearer realm="specpipe"'},
        )
    # The plain text format, version 0.0.4, is what `exposition` writes (CONTENT_TYPE_LATEST
    # announces 1.0.0, which prometheus_client itself only sends when a scraper asks for it).
    return Response(exposition(), content_type=CONTENT_TYPE_PLAIN_0_0_4)
