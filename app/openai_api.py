"""The OpenAI-compatible API under /v1: chat and raw completions, and the model the swarm serves.

Every request is an ordinary job of the bearer token's owner, made by the one submission path
(`workers.submission.Submitter`); the request then waits for the job by reading its row, which
the coordinator updates after every round. What it accepts and answers (fields, streaming,
log-probabilities, errors): docs/api.md.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from flask import Blueprint, Flask, Response, current_app, g, jsonify, request
from sqlalchemy.orm import Session
from werkzeug.exceptions import ClientDisconnected

from app.auth import current_user, user_from_token
from app.db import get_session
from app.replies import job_target, speaks_harmony
from app.submitting import submitter
from app.waits import TooManyOpen, open_completions
from models.db import utcnow
from models.jobs import Job
from models.nodes import ring_nodes
from specpipe import __version__
from specpipe.core.sampling import MAX_TOP_LOGPROBS
from specpipe.core.stopping import GenerationText, hold_back_stop_prefix
from specpipe.transformer.harmony import Reply, split_reply
from workers.submission import JobRequestError, QueueUnavailable, TooManyActiveJobs

bp = Blueprint("openai", __name__, url_prefix="/v1")

CHAT_ROLES = ("system", "user", "assistant")
KEEP_ALIVE_S = 1.0  # a stream sends a comment this often while it waits: a gone client shows
# Our job fields by the OpenAI names that set them.
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "temp": "temperature"}
# The defaults OpenAI's API documents for its own fields (temperature 1, top_p 1): a client that
# leaves them out samples here as it would anywhere else. Every other field a request leaves out
# takes the job defaults (`JOB_DEFAULTS`), as on the form and the JSON API.
OPENAI_DEFAULTS = {"temp": 1.0, "top_p": 1.0}
# Known fields this server cannot honour, with the value that asks for nothing.
UNSUPPORTED = {
    "echo": False,
    "best_of": 1,
    "suffix": None,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": None,
    "tools": None,
    "functions": None,
}


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


# ---------------------------------------------------------------------------------------------
# Models


def served_model() -> str:
    """The model this swarm's jobs run on."""
    return submitter().model


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
    _check_model(model)
    return jsonify(_model_entry())


def _check_model(model: object) -> None:
    if not isinstance(model, str) or not model:
        raise OpenAIError(400, "model must be the name of a model", param="model")
    if model != served_model():
        raise OpenAIError(
            404,
            f"the model {model!r} is not served here; this swarm serves {served_model()!r}",
            param="model",
            code="model_not_found",
        )


# ---------------------------------------------------------------------------------------------
# Requests


@dataclass
class Completion:
    """A checked request: the job's parameters and how to answer."""

    chat: bool
    params: dict
    stream: bool
    include_usage: bool
    logprobs: int | None


def _body() -> dict:
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise OpenAIError(400, "the body must be a JSON object (Content-Type: application/json)")
    return body


def _optional(body: dict, name: str, kinds: tuple[type, ...], what: str):
    value = body.get(name)
    if value is None:
        return None
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise OpenAIError(400, f"{name} must be {what}", param=name)
    return value


def _content(message: dict, index: int) -> str:
    content = message.get("content")
    param = f"messages[{index}].content"
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise OpenAIError(400, "only text content parts are supported", param=param)
            parts.append(part["text"])
        return "".join(parts)
    raise OpenAIError(400, "content must be text or a list of text parts", param=param)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "messages must be a non-empty list", param="messages")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise OpenAIError(
                400,
                f"each message needs a role: one of {', '.join(CHAT_ROLES)}",
                param=f"messages[{i}].role",
            )
        clean.append({"role": message["role"], "content": _content(message, i)})
    return clean


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt, list):
        raise OpenAIError(
            400, "prompt must be one string (a list of one string will do)", param="prompt"
        )
    if not isinstance(prompt, str):
        raise OpenAIError(400, "prompt must be text", param="prompt")
    return prompt


def _max_tokens(body: dict) -> tuple[object, str]:
    """The token budget asked for and the field that asked (either name will do)."""
    given = [
        (body[name], name)
        for name in ("max_tokens", "max_completion_tokens")
        if body.get(name) is not None
    ]
    if len(given) == 2 and (type(given[0][0]), given[0][0]) != (type(given[1][0]), given[1][0]):
        raise OpenAIError(400, "max_tokens and max_completion_tokens disagree", param="max_tokens")
    return given[0] if given else (None, "max_tokens")


def _logprobs(body: dict, chat: bool) -> int | None:
    if chat:
        wanted = _optional(body, "logprobs", (bool,), "true or false")
        top = _optional(body, "top_logprobs", (int,), "a whole number")
        if top is not None and not wanted:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        count, param = (top or 0) if wanted else None, "top_logprobs"
    else:
        count, param = _optional(body, "logprobs", (int,), "a whole number"), "logprobs"
    if count is not None and not 0 <= count <= MAX_TOP_LOGPROBS:
        raise OpenAIError(400, f"{param} must be between 0 and {MAX_TOP_LOGPROBS}", param=param)
    return count


def parse_request(chat: bool) -> Completion:
    """Check an OpenAI request; raises OpenAIError naming the first bad field."""
    body = _body()
    _check_model(body.get("model"))
    n = _optional(body, "n", (int,), "a whole number")
    if n is not None and n != 1:
        raise OpenAIError(400, "n must be 1: this server makes one choice per request", param="n")
    for name, nothing in UNSUPPORTED.items():
        if body.get(name) not in (None, nothing, {}, []):
            raise OpenAIError(400, f"{name} is not supported by this server", param=name)
    stream = _optional(body, "stream", (bool,), "true or false") or False
    options = _optional(body, "stream_options", (dict,), "an object") or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise OpenAIError(400, "include_usage must be true or false", param="stream_options")
    _optional(body, "user", (str,), "text")
    max_tokens, max_tokens_name = _max_tokens(body)
    raw = {
        "max_new_tokens": max_tokens,
        "temp": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "seed": body.get("seed"),
        "draft_k": body.get("draft_k"),
        "stop": body.get("stop"),
        "sampler": body.get("sampler"),
    }
    raw = {**OPENAI_DEFAULTS, **{name: value for name, value in raw.items() if value is not None}}
    extra: dict = {"raw_prompt": not chat, "messages": None}
    if chat:
        messages = _messages(body)
        if len(messages) == 1 and messages[0]["role"] == "user":
            raw["prompt"] = messages[0]["content"]  # a plain job: as `specpipe generate` runs it
        else:
            raw["prompt"] = "\n\n".join(f"{m['role']}: {m['content']}" for m in messages)
            extra["messages"] = messages
    else:
        raw["prompt"] = _prompt(body)
    logprobs = _logprobs(body, chat)
    try:
        params = submitter().check(raw, prompt_form=extra)
    except JobRequestError as exc:
        name, reason = next(iter(exc.errors.items()))
        names = {**OPENAI_NAMES, "max_new_tokens": max_tokens_name}
        param = names.get(name, "messages" if chat and name == "prompt" else name)
        raise OpenAIError(400, f"{param} {reason}", param=param) from None
    return Completion(chat, {**params, "logprobs": logprobs}, stream, include_usage, logprobs)


def _too_many(message: str, retry_after_s: int) -> OpenAIError:
    return OpenAIError(
        429, message, code="rate_limit_exceeded", kind="requests", retry_after=retry_after_s
    )


def _submit(completion: Completion) -> Job:
    try:
        return submitter().submit(get_session(), completion.params, current_user())
    except TooManyActiveJobs as exc:
        raise _too_many(str(exc), exc.retry_after_s) from None
    except QueueUnavailable as exc:
        raise OpenAIError(
            503, f"job {exc.job.id} could not be queued: {exc}", kind="server_error"
        ) from None


# ---------------------------------------------------------------------------------------------
# Waiting for the job


def job_updates(
    session: Session, job_id: int, poll_s: float, wait_s: float, idle_s: float | None = None
) -> Iterator[Job | None]:
    """The job each time its stored progress changed, and once more when it has finished; with
    `idle_s`, None after that many seconds without a change.

    Each look reads the row afresh (a new transaction, so a snapshot never hides a round).
    Raises TimeoutError after `wait_s` seconds without the job finishing."""
    deadline = time.monotonic() + wait_s
    seen, last_change = None, time.monotonic()
    while True:
        session.rollback()  # ends the read transaction: the next look sees the latest round
        job = session.get(Job, job_id, populate_existing=True)
        state = (job.status, len(job.output_ids or []), job.output_text)
        if state != seen or job.finished:
            seen, last_change = state, time.monotonic()
            yield job
        elif idle_s is not None and time.monotonic() - last_change >= idle_s:
            last_change = time.monotonic()
            yield None
        if job.finished:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"job {job_id} did not finish within {wait_s:g} s")
        # Hand the connection back to the pool while asleep: many waiting requests must not
        # hold all of its few connections, nor keep the pages waiting for one.
        session.rollback()
        time.sleep(poll_s)


def _cancel(session: Session, job_id: int) -> None:
    session.rollback()
    job = session.get(Job, job_id, populate_existing=True)
    if job is not None and job.request_cancel():
        session.commit()


def _failure(job: Job) -> OpenAIError:
    if job.status == "cancelled":
        return OpenAIError(409, f"job {job.id} was cancelled", code="cancelled")
    return OpenAIError(
        500, f"job {job.id} failed: {job.error or 'no reason given'}", kind="server_error"
    )


# ---------------------------------------------------------------------------------------------
# Answers


def finish_reason(job: Job, target=None) -> str:
    """`length` when the token budget ended the job, else `stop` (EOS or a stop string)."""
    ids = list(job.output_ids or [])
    if len(ids) < job.max_new_tokens:
        return "stop"
    if target is not None and (
        ids[-1] in target.eos_ids
        or GenerationText(target.decode, target.eos_ids, job.stop or []).cut(ids)[1]
    ):
        return "stop"
    return "length"


def fingerprint(job: Job) -> str:
    """The model and the ring's software versions (as its stages reported them) in 12 digits."""
    versions = sorted(
        {
            s.software_version
            for s in (job.run.node_snapshots if job.run else [])
            if s.software_version
        }
        or {__version__}
    )
    return "fp_" + hashlib.sha256(f"{job.model}|{'+'.join(versions)}".encode()).hexdigest()[:12]


def _usage(job: Job) -> dict:
    prompt, completion = job.prompt_tokens or 0, len(job.output_ids or [])
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _extension(job: Job) -> dict:
    return {
        "job_id": job.id,
        "seed": job.seed,
        "seed_was_random": job.seed_was_random,
        "draft_k": job.draft_k,
        "rounds": job.rounds,
        "tok_s": job.tok_s,
    }


def _token_text(target, token: int) -> str:
    return target.decode([token]) if target is not None else ""


def _chat_logprobs(entries: list, ids: list[int], target) -> dict:
    def one(token: int, logprob: float) -> dict:
        text = _token_text(target, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token, (logprob, top) in zip(ids, entries, strict=False):
        content.append({**one(token, logprob), "top_logprobs": [one(i, lp) for i, lp in top]})
    return {"content": content}


def _completion_logprobs(entries: list, ids: list[int], target, offset: int) -> dict:
    tokens, logprobs, tops, offsets = [], [], [], []
    for token, (logprob, top) in zip(ids, entries, strict=False):
        text = _token_text(target, token)
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        logprobs.append(logprob)
        tops.append({_token_text(target, i): lp for i, lp in top})
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _logprobs_of(completion: Completion, job: Job, start: int, end: int, target, offset: int):
    if completion.logprobs is None:
        return None
    ids = list(job.output_ids or [])[start:end]
    entries = list(job.output_logprobs or [])[start:end]
    if completion.chat:
        return _chat_logprobs(entries, ids, target)
    return _completion_logprobs(entries, ids, target, offset)


def _head(completion: Completion, job: Job, chunk: bool) -> dict:
    if completion.chat:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
        prefix = "chatcmpl"
    else:
        kind, prefix = "text_completion", "cmpl"
    created = int(job.created_at.timestamp()) if job.created_at else int(time.time())
    return {
        "id": f"{prefix}-{job.id}",
        "object": kind,
        "created": created,
        "model": job.model,
        "system_fingerprint": fingerprint(job),
    }


def whole_answer(completion: Completion, job: Job) -> dict:
    """The non-streamed response for a finished job."""
    target = job_target(job)
    text = job.output_text or ""
    logprobs = _logprobs_of(completion, job, 0, len(job.output_ids or []), target, 0)
    choice: dict = {"index": 0, "finish_reason": finish_reason(job, target), "logprobs": logprobs}
    if completion.chat and speaks_harmony(target):
        reply = split_reply(text)
        choice["message"] = {
            "role": "assistant",
            "content": reply.content,
            "reasoning_content": reply.reasoning,
            "refusal": None,
        }
    elif completion.chat:
        choice["message"] = {"role": "assistant", "content": text, "refusal": None}
    else:
        choice["text"] = text
    return {
        **_head(completion, job, False),
        "choices": [choice],
        "usage": _usage(job),
        "specpipe": _extension(job),
    }


def _chunk(
    completion: Completion,
    job: Job,
    text: str | None,
    logprobs,
    finish: str | None,
    first: bool = False,
    reasoning: str | None = None,
) -> dict:
    choice: dict = {"index": 0, "logprobs": logprobs, "finish_reason": finish}
    if completion.chat:
        delta: dict = {"role": "assistant", "content": ""} if first else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {**_head(completion, job, True), "choices": [choice], "specpipe": _extension(job)}


def _event(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def stable_text(job: Job) -> str:
    """What of a running job's text can no longer change: its text without an ending that may
    still become a stop string or a whole UTF-8 character."""
    text = job.output_text or ""
    if job.finished:
        return text
    text = hold_back_stop_prefix(text, job.stop or [])
    return text.rstrip("\ufffd")


def stream_answer(app: Flask, completion: Completion, job_id: int) -> Iterator[str]:
    """The Server-Sent Events of a streamed answer; cancels the job if the client goes away."""
    session: Session = app.extensions["specpipe.sessions"]()
    poll_s, wait_s = app.config["OPENAI_POLL_S"], app.config["OPENAI_WAIT_S"]
    done = False
    try:
        sent_text, sent_ids, first, target, opened = "", 0, True, None, False
        sent = Reply("", "")  # with harmony: what of each channel was sent
        for job in job_updates(session, job_id, poll_s, wait_s, idle_s=KEEP_ALIVE_S):
            if job is None:  # nothing new for a while: a comment shows whether anyone listens
                yield ": waiting\n\n"
                continue
            if job.finished and job.status != "done":
                yield _event({"error": _failure(job).body()})
                done = True
                return
            text = stable_text(job)
            if not text.startswith(sent_text):
                continue  # a rare decoder whose text changed behind the shown part: wait
            n_ids = len(job.output_ids or [])
            if not opened and (completion.chat or completion.logprobs is not None or job.finished):
                target, opened = job_target(job), True  # once: a model that cannot open stays so
            logprobs = _logprobs_of(completion, job, sent_ids, n_ids, target, len(sent_text))
            if text != sent_text or first or logprobs:
                if completion.chat and speaks_harmony(target):
                    reply = split_reply(text)
                    new_text = reply.content[len(sent.content) :]
                    reasoning = reply.reasoning[len(sent.reasoning) :]
                    sent = reply
                else:
                    new_text, reasoning = text[len(sent_text) :], None
                if new_text or reasoning or first or logprobs:  # markers alone show nothing
                    chunk = _chunk(completion, job, new_text, logprobs, None, first, reasoning)
                    yield _event(chunk)
                sent_text, sent_ids, first = text, n_ids, False
            if job.finished:
                yield _event(_chunk(completion, job, None, None, finish_reason(job, target)))
                if completion.include_usage:
                    yield _event(
                        {**_head(completion, job, True), "choices": [], "usage": _usage(job)}
                    )
                yield _event("[DONE]")
                done = True
                return
    except TimeoutError as exc:
        yield _event({"error": OpenAIError(504, str(exc), kind="timeout").body()})
    finally:
        if not done:  # the client went away, or the wait ran out: the job is not wanted
            _cancel(session, job_id)
        session.close()


def _closing(events: Iterator[str], close: Callable[[], None]) -> Iterator[str]:
    """`events`, then `close` once they end, however they end."""
    try:
        yield from events
    finally:
        close()


def _open(user_id: int) -> Callable[[], None]:
    """A place among the open completions (`app.waits`), or a 429 in OpenAI's shape."""
    try:
        return open_completions().open(user_id)
    except TooManyOpen as exc:
        raise _too_many(str(exc), exc.retry_after_s) from None


def _answer(chat: bool):
    completion = parse_request(chat)
    close = _open(current_user().id)
    try:
        job = _submit(completion)
    except BaseException:
        close()
        raise
    if completion.stream:
        job_id = job.id
        app = current_app._get_current_object()
        events = _closing(stream_answer(app, completion, job_id), close)
        response = Response(events, mimetype="text/event-stream")
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Accel-Buffering"] = "no"
        response.call_on_close(close)  # also for a stream the server closes before it starts
        return response
    try:
        return _whole(completion, job.id)
    finally:
        close()


def _whole(completion: Completion, job_id: int) -> Response:
    """Wait for the job, then answer with all of it; a client gone meanwhile cancels it."""
    session, config = get_session(), current_app.config
    poll_s, wait_s = config["OPENAI_POLL_S"], config["OPENAI_WAIT_S"]
    # waitress says when the client hung up (with `channel_request_lookahead`, as `specpipe
    # web` serves); elsewhere the wait runs its course.
    gone = request.environ.get("waitress.client_disconnected", lambda: False)
    job = None
    try:
        for update in job_updates(session, job_id, poll_s, wait_s, idle_s=KEEP_ALIVE_S):
            if update is not None:
                job = update
            elif gone():
                _cancel(session, job_id)
                raise ClientDisconnected()
    except TimeoutError as exc:
        _cancel(session, job_id)
        raise OpenAIError(504, str(exc), kind="timeout") from None
    if job.status != "done":
        raise _failure(job)
    return jsonify(whole_answer(completion, job))


@bp.post("/chat/completions")
def chat_completions():
    """A chat completion: the messages through the model's chat template."""
    return _answer(chat=True)


@bp.post("/completions")
def completions():
    """A completion of a raw prompt."""
    return _answer(chat=False)
