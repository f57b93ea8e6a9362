"""Checking the body of a /v1/completions or /v1/chat/completions request into a job's
parameters and how to answer it."""

from __future__ import annotations

from dataclasses import dataclass

from flask import request

from app.openai.errors import OpenAIError
from app.submitting import submitter
from specpipe.core.sampling import MAX_TOP_LOGPROBS
from workers.job_request import JobRequestError

CHAT_ROLES = ("system", "user", "assistant")
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


def served_model() -> str:
    """The model this swarm's jobs run on."""
    return submitter().model


def check_model(model: object) -> None:
    """Raise OpenAIError unless `model` names the served model (400 not a name, 404 another)."""
    if not isinstance(model, str) or not model:
        raise OpenAIError(400, "model must be the name of a model", param="model")
    if model != served_model():
        raise OpenAIError(
            404,
            f"the model {model!r} is not served here; this swarm serves {served_model()!r}",
            param="model",
            code="model_not_found",
        )


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
    check_model(body.get("model"))
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
