"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every answer
under /v1."""

from __future__ import annotations

from flask import Response, jsonify


class OpenAIError(Exception):
    """A request answered with an error in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind, self.retry_after = kind, retry_after

    def body(self) -> dict:
        """The error object of OpenAI's shape."""
        return {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}

    def response(self) -> Response:
        response = jsonify({"error": self.body()})
        response.status_code = self.status
        if self.retry_after is not None:
            response.headers["Retry-After"] = str(self.retry_after)
        if self.status == 401:
            response.headers["WWW-Authenticate"] = 'Bearer realm="specpipe"'
        return response


def error_response(status: int, message: str, retry_after: int | None = None) -> Response:
    """An error for any request under /v1 (the app's handlers call this for those paths)."""
    kinds = {401: "invalid_request_error", 404: "invalid_request_error", 429: "requests"}
    kind = kinds.get(status, "invalid_request_error" if status < 500 else "server_error")
    code = "rate_limit_exceeded" if status == 429 else None
    return OpenAIError(status, message, code=code, kind=kind, retry_after=retry_after).response()


def too_many(message: str, retry_after_s: int) -> OpenAIError:
    """A 429 that says when to try again."""
    return OpenAIError(
        429, message, code="rate_limit_exceeded", kind="requests", retry_after=retry_after_s
    )
