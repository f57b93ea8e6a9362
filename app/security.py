"""Security headers on every response, set in one after-request hook.

The pages load scripts and styles only from `/static` (no inline script or style), so the
Content-Security-Policy allows nothing else; no other site may frame them.
"""

from __future__ import annotations

from flask import Flask, Response, current_app

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


def init_app(app: Flask) -> None:
    """Add the headers to every response, error pages and static files included."""
    app.after_request(add_headers)


def add_headers(response: Response) -> Response:
    """The security headers, plus HSTS when the app is served over HTTPS."""
    response.headers.update(HEADERS)
    if current_app.config.get("SESSION_COOKIE_SECURE"):
        response.headers["Strict-Transport-Security"] = "max-age=31536000"
    return response
