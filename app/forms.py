"""Form plumbing: CSRF protection, the raw UTF-8 check, and template filters."""

from __future__ import annotations

import json
from urllib.parse import unquote_to_bytes

from flask import Flask, g, request
from flask_wtf.csrf import CSRFProtect

from models.db import as_utc
from specpipe.swarm.redact import redact_url

csrf = CSRFProtect()


def init_app(app: Flask) -> None:
    """Check raw form bytes before anything parses them, then enable CSRF."""
    app.before_request(_find_bad_utf8)
    csrf.init_app(app)


def _find_bad_utf8() -> None:
    # Werkzeug decodes form fields with errors="replace", which would hide invalid bytes;
    # look at the raw body first (it stays cached for the form parser).
    g.bad_utf8_fields = set()
    if request.method != "POST" or request.mimetype != "application/x-www-form-urlencoded":
        return
    for pair in request.get_data(cache=True).split(b"&"):
        name, _, value = pair.partition(b"=")
        try:
            unquote_to_bytes(value.replace(b"+", b" ")).decode("utf-8")
        except UnicodeDecodeError:
            g.bad_utf8_fields.add(unquote_to_bytes(name).decode("utf-8", "replace"))


def bad_utf8_fields() -> set[str]:
    """Names of form fields in this request whose bytes are not valid UTF-8."""
    return g.get("bad_utf8_fields", set())


def _when(moment) -> str:
    moment = as_utc(moment)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC") if moment else "—"


def _num(value, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _excerpt(text: str, length: int = 80) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= length else text[: length - 1] + "…"


def _bytes(value) -> str:
    if value is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(value)


def _quoted(text: str) -> str:
    # Quotes and escapes make a stop string's spaces and newlines visible.
    return json.dumps(text, ensure_ascii=False)


FILTERS = {
    "when": _when,
    "num": _num,
    "excerpt": _excerpt,
    "bytes": _bytes,
    "quoted": _quoted,
    "redact_url": redact_url,
}
