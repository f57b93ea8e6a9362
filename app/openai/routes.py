"""The /v1 blueprint: the key check, the models, and the two completion endpoints."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from flask import Blueprint, Response, current_app, g, jsonify, request
from werkzeug.exceptions import ClientDisconnected

from app.auth import current_user, user_from_token
from app.db import get_session
from app.openai.answers import Answer, whole_answer
from app.openai.errors import OpenAIError, too_many
from app.openai.requests import Completion, check_model, parse_request, served_model
from app.openai.streaming import closing, stream_answer
from app.openai.waiting import KEEP_ALIVE_S, cancel_jobs, failure, job_updates
from app.submitting import submitter
from app.waits import TooManyOpen, open_completions
from models.db import utcnow
from models.jobs import Job
from models.nodes import ring_nodes
from workers.submission import QueueUnavailable, TooManyActiveJobs

bp = Blueprint("openai", __name__, url_prefix="/v1")


@bp.errorhandler(OpenAIError)
def openai_error(exc: OpenAIError) -> Response:
    return exc.response()


@bp.before_request
def require_key():
    """`Authorization: Bearer <token>`: the same tokens as /api/v1, acting as their owner."""
    user = user_from_token()
    if user is None:
        raise OpenAIError(
            401,
            "a valid API key is required (Authorization: Bearer <token>)",
            code="invalid_api_key",
        )
    g.user = user


def _model_entry() -> dict:
    now = utcnow()
    ring = [
        {
            "host": n.host,
            "role": n.role,
            "layer_start": n.layer_start,
            "layer_end": n.layer_end,
            "status": n.status(now),
            "software_version": n.software_version,
        }
        for n in ring_nodes(get_session())
    ]
    return {
        "id": served_model(),
        "object": "model",
        "created": 0,
        "owned_by": "specpipe",
        "ring": ring,
    }


@bp.get("/models")
def list_models():
    """The model the swarm serves, with the ring of stages serving it."""
    return jsonify({"object": "list", "data": [_model_entry()]})


@bp.get("/models/<path:model>")
def get_model(model: str):
    """One model: the one served, else 404."""
    check_model(model)
    return jsonify(_model_entry())


def _submit(completion: Completion) -> list[Job]:
    """A job per choice, submitted together: all or none."""
    try:
        return submitter().submit_all(get_session(), completion.choice_params(), current_user())
    except TooManyActiveJobs as exc:
        raise too_many(str(exc), exc.retry_after_s) from None
    except QueueUnavailable as exc:
        ids = ", ".join(str(job.id) for job in exc.jobs)
        which = f"job {ids}" if len(exc.jobs) == 1 else f"jobs {ids}"
        raise OpenAIError(503, f"{which} could not be queued: {exc}", kind="server_error") from None


def _open(user_id: int) -> Callable[[], None]:
    """A place among the open completions (`app.waits`), or a 429 in OpenAI's shape."""
    try:
        return open_completions().open(user_id)
    except TooManyOpen as exc:
        raise too_many(str(exc), exc.retry_after_s) from None


def _answer(chat: bool):
    completion = parse_request(chat)
    close = _open(current_user().id)
    try:
        answer = Answer.of(_submit(completion))
    except BaseException:
        close()
        raise
    if completion.stream:
        app = current_app._get_current_object()
        events = closing(stream_answer(app, completion, answer), close)
        response = Response(events, mimetype="text/event-stream")
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Accel-Buffering"] = "no"
        response.call_on_close(close)  # also for a stream the server closes before it starts
        return response
    try:
        return jsonify(whole_answer(completion, _finished(answer.job_ids)))
    finally:
        close()


def _finished(job_ids: Sequence[int]) -> list[Job]:
    """Wait for the jobs, then give them in order, all done. A job that did not finish well
    answers its error, and a client gone meanwhile or a wait run out ends the wait: the jobs
    still running are cancelled then."""
    session, config = get_session(), current_app.config
    poll_s, wait_s = config["OPENAI_POLL_S"], config["OPENAI_WAIT_S"]
    # waitress says when the client hung up (with `channel_request_lookahead`, as `specpipe
    # web` serves); elsewhere the wait runs its course.
    gone = request.environ.get("waitress.client_disconnected", lambda: False)
    ended: dict[int, Job] = {}
    look_at = time.monotonic() + KEEP_ALIVE_S  # when to look whether the client is there
    try:
        for job in job_updates(session, job_ids, poll_s, wait_s, idle_s=KEEP_ALIVE_S):
            if job is not None and job.finished:
                ended[job.id] = job
                if job.status != "done":
                    raise failure(job)
            if time.monotonic() >= look_at:
                look_at = time.monotonic() + KEEP_ALIVE_S
                if gone():
                    raise ClientDisconnected()
    except TimeoutError as exc:
        raise OpenAIError(504, str(exc), kind="timeout") from None
    finally:
        cancel_jobs(session, [i for i in job_ids if i not in ended])
    return [ended[i] for i in job_ids]


@bp.post("/chat/completions")
def chat_completions():
    """A chat completion: the messages through the model's chat template."""
    return _answer(chat=True)


@bp.post("/completions")
def completions():
    """A completion of a raw prompt."""
    return _answer(chat=False)
