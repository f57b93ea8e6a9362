"""Error pages: JSON under /api/, OpenAI's error shape under /v1/, a friendly page elsewhere.
Nothing reaches the user as a 500 traceback; unexpected errors are logged and answered with a
short message."""

from __future__ import annotations

from flask import Flask, jsonify, render_template, request
from flask_limiter.errors import RateLimitExceeded
from flask_wtf.csrf import CSRFError
from werkzeug.exceptions import HTTPException, InternalServerError


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

    @app.errorhandler(CSRFError)
    def csrf_error(exc: CSRFError):
        return render_template("error.html", code=400, message=exc.description), 400

    @app.errorhandler(RateLimitExceeded)
    def rate_limited(exc: RateLimitExceeded):
        from app.limits import retry_after_s

        retry = retry_after_s()
        reason = f"too many requests (at most {exc.description}): try again in {retry} s"
        if _openai():
            from app.openai.errors import error_response

            return error_response(429, reason, retry_after=retry)
        if _wants_json():
            response = json_error(429, reason, retry_after=retry)
        elif request.endpoint == "jobs.submit":
            from app.jobs import posted_values, render_form

            response = app.make_response(render_form(posted_values(), {}, 429, reason))
        elif request.endpoint == "auth.login":
            from app.auth import LoginForm, render_login

            response = app.make_response(render_login(LoginForm(), reason, 429))
        else:
            response = app.make_response(
                (render_template("error.html", code=429, message=reason), 429)
            )
        response.headers["Retry-After"] = str(retry)
        return response

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException):
        if _openai():
            from app.openai.errors import error_response

            response = error_response(exc.code or 500, exc.description or exc.name)
            if exc.code == 405 and exc.valid_methods:
                response.headers["Allow"] = ", ".join(exc.valid_methods)
            return response
        if _wants_json():
            response = json_error(exc.code or 500, exc.description or exc.name)
            if exc.code == 405 and exc.valid_methods:
                response.headers["Allow"] = ", ".join(exc.valid_methods)
            return response
        return render_template("error.html", code=exc.code, message=exc.description), exc.code

    @app.errorhandler(Exception)
    def unexpected(exc: Exception):
        app.logger.exception("unhandled error on %s", request.path)
        if isinstance(exc, HTTPException):
            return http_error(exc)
        message = InternalServerError.description
        if _openai():
            from app.openai.errors import error_response

            return error_response(500, "internal error")
        if _wants_json():
            return json_error(500, "internal error")
        return render_template("error.html", code=500, message=message), 500
