"""Error pages: JSON under /api/, OpenAI's error shape under /v1/, a friendly page elsewhere.
Nothing reaches the user as a 500 traceback; unexpected errors are logged and answered with a
short message."""

from __future__ import annotations

from flask import Flask, current_app, jsonify, render_template, request
from flask_limiter.errors import RateLimitExceeded
from flask_wtf.csrf import CSRFError
from werkzeug.exceptions import HTTPException, InternalServerError

from app.openai.errors import error_response


def _wants_json() -> bool:
    return request.path.startswith("/api/")


def _openai() -> bool:
    return request.path.startswith("/v1/")


def json_error(status: int, error: str, **extra):
    """A JSON error response: {"error": ..., **extra}."""
    response = jsonify({"error": error, **extra})
    response.status_code = status
    return response


def init_app(app: Flask) -> None:
    """Register the handlers."""
    app.register_error_handler(CSRFError, _csrf_error)
    app.register_error_handler(RateLimitExceeded, _rate_limited)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(Exception, _unexpected)


def _csrf_error(exc: CSRFError):
    return render_template("error.html", code=400, message=exc.description), 400


def _rate_limited(exc: RateLimitExceeded):
    from app.limits import retry_after_s

    retry = retry_after_s()
    reason = f"too many requests (at most {exc.description}): try again in {retry} s"
    if _openai():
        return error_response(429, reason, retry_after=retry)
    if _wants_json():
        response = json_error(429, reason, retry_after=retry)
    else:
        response = current_app.make_response(_refused_page(reason))
    response.headers["Retry-After"] = str(retry)
    return response


def _refused_page(reason: str):
    """The page a refused request gets: its own form where it has one, with the reason."""
    if request.endpoint == "jobs.submit":
        from app.jobs import posted_values, render_form

        return render_form(posted_values(), {}, 429, reason)
    if request.endpoint == "auth.login":
        from app.auth import LoginForm, render_login

        return render_login(LoginForm(), reason, 429)
    return render_template("error.html", code=429, message=reason), 429


def _http_error(exc: HTTPException):
    if not (_openai() or _wants_json()):
        return render_template("error.html", code=exc.code, message=exc.description), exc.code
    answer = error_response if _openai() else json_error
    response = answer(exc.code or 500, exc.description or exc.name)
    if exc.code == 405 and exc.valid_methods:
        response.headers["Allow"] = ", ".join(exc.valid_methods)
    return response


def _unexpected(exc: Exception):
    current_app.logger.exception("unhandled error on %s", request.path)
    if isinstance(exc, HTTPException):
        return _http_error(exc)
    if _openai():
        return error_response(500, "internal error")
    if _wants_json():
        return json_error(500, "internal error")
    message = InternalServerError.description
    return render_template("error.html", code=500, message=message), 500
