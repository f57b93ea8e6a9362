"""Checking the body of a /v1/completions or /v1/chat/completions request into a job's
parameters and how to answer it."""

from __future__ import annotations

from dataclasses import dataclass

from flask import request

from app.openai import tools as tooling
from app.openai.errors import OpenAIError
from app.submitting import submitter
from specpipe.core.sampling import MAX_SEED, MAX_TOP_LOGPROBS
from workers.job_request import FIELD_BY_NAME, JOB_FIELDS, JobRequestError

CHAT_ROLES = ("system", "user", "assistant", "tool")
# The most choices (`n`) one request may ask for: each is a job of its own, and all of them
# count against the user's active jobs (`JobLimits.max_active_jobs`) together.
MAX_CHOICES = 8
# `response_format` types that ask for output held to JSON: this server has no constrained
# decoding to honour them with.
CONSTRAINED_FORMATS = ("json_object", "json_schema")
# Known fields this server cannot honour, with the value that asks for nothing.
UNSUPPORTED = {
    "echo": False,
    "best_of": 1,
    "suffix": None,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": None,
    "functions": None,
    "function_call": None,
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
    tools_offered: bool = False  # the answer gives the reply's calls of them apart
    n: int = 1  # choices: a job each

    def choice_params(self) -> list[dict]:
        """Each choice's job parameters, in index order: seeds seed, seed+1, ... where the
        request gave one, else each job draws its own."""
        seed = self.params.get("seed")
        return [{**self.params, "seed": None if seed is None else seed + i} for i in range(self.n)]


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
    """The chat's messages as the chat template takes them (`app.openai.tools` for an
    assistant's calls and a tool's results)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "messages must be a non-empty list", param="messages")
    clean, calls = [], {}  # calls: each earlier call's id and function
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise OpenAIError(
                400,
                f"each message needs a role: one of {', '.join(CHAT_ROLES)}",
                param=f"messages[{i}].role",
            )
        role = message["role"]
        checked = {"role": role, "content": _content(message, i)}
        if role == "assistant":
            checked.update(tooling.assistant_calls(message, f"messages[{i}]", calls))
        elif role == "tool":
            checked.update(tooling.tool_result(message, f"messages[{i}]", calls))
        clean.append(checked)
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
    _refuse_unsupported(body, chat)
    _check_response_format(body.get("response_format"))
    n = _choices(body)
    stream, include_usage = _streaming(body)
    _optional(body, "user", (str,), "text")
    max_tokens, max_tokens_name = _max_tokens(body)
    raw = _job_fields(body, max_tokens)
    raw["prompt"], prompt_form = _prompt_and_form(body, chat)
    logprobs = _logprobs(body, chat)
    try:
        params = submitter().check(raw, prompt_form=prompt_form)
    except JobRequestError as exc:
        name, reason = next(iter(exc.errors.items()))
        param = _param(name, chat, max_tokens_name)
        raise OpenAIError(400, f"{param} {reason}", param=param) from None
    _check_seeds(params["seed"], n)
    offered = bool(prompt_form.get("tools"))
    params = {**params, "logprobs": logprobs}
    return Completion(chat, params, stream, include_usage, logprobs, offered, n)


def _choices(body: dict) -> int:
    """`n`, the choices asked for: 1 to `MAX_CHOICES`, and no more than a user may have jobs
    queued or running (more could never be taken)."""
    n = _optional(body, "n", (int,), "a whole number")
    most = min(MAX_CHOICES, submitter().limits.max_active_jobs)
    if n is not None and not 1 <= n <= most:
        raise OpenAIError(400, f"n must be between 1 and {most}", param="n")
    return 1 if n is None else n


def choices_asked() -> int:
    """The `n` of the request being served where it is one this server takes, else 1: what
    the request costs of its user's submission rate (`app.limits`), a job per choice."""
    body = request.get_json(silent=True)
    n = body.get("n") if isinstance(body, dict) else None
    return n if type(n) is int and 1 <= n <= MAX_CHOICES else 1


def _check_seeds(seed: int | None, n: int) -> None:
    """A 400 where the choices' seeds, seed to seed+n-1, would pass the largest seed."""
    if seed is not None and seed + n - 1 > MAX_SEED:
        raise OpenAIError(
            400,
            f"seed must be at most {MAX_SEED - n + 1} with n={n}: "
            "the choices take the seeds seed, seed+1, ..., seed+n-1",
            param="seed",
        )


def _check_response_format(response_format: object) -> None:
    """`response_format`: only text, the default; output held to JSON (`json_object`,
    `json_schema`) needs constrained decoding, which this server does not offer."""
    if response_format is None:
        return
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind in CONSTRAINED_FORMATS:
        raise OpenAIError(
            400,
            f"response_format {kind!r} is not supported: this server does not offer "
            'constrained decoding, so it cannot hold the output to JSON; use {"type": "text"} '
            "and ask for JSON in the prompt",
            param="response_format",
        )
    if kind != "text" or set(response_format) != {"type"}:
        raise OpenAIError(400, 'response_format must be {"type": "text"}', param="response_format")


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """OpenAIError for a feature this server does not have (`echo`, `best_of`, ...)."""
    unsupported = UNSUPPORTED if chat else {**UNSUPPORTED, "tools": None, "tool_choice": None}
    for name, nothing in unsupported.items():
        if body.get(name) not in (None, nothing, {}, []):
            raise OpenAIError(400, f"{name} is not supported by this server", param=name)


def _streaming(body: dict) -> tuple[bool, bool]:
    """Whether to stream, and whether a stream ends with the usage."""
    stream = _optional(body, "stream", (bool,), "true or false") or False
    options = _optional(body, "stream_options", (dict,), "an object") or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise OpenAIError(400, "include_usage must be true or false", param="stream_options")
    return stream, include_usage


def _job_fields(body: dict, max_tokens: object) -> dict:
    """The job fields besides the prompt, by their OpenAI names (`workers.job_request`), else
    the defaults OpenAI documents; a field left out of both takes the job default."""
    raw: dict = {}
    for field in JOB_FIELDS:
        if field.name == "prompt":
            continue
        value = max_tokens if field.name == "max_new_tokens" else body.get(field.openai_param)
        value = field.openai_default if value is None else value
        if value is not None:
            raw[field.name] = value
    return raw


def _prompt_and_form(body: dict, chat: bool) -> tuple[str, dict]:
    """The job's prompt, and how it is fed (`raw_prompt`, `messages`, `tools`: see
    `models.jobs`)."""
    if not chat:
        return _prompt(body), {"raw_prompt": True, "messages": None}
    messages = _messages(body)
    tools = _tools(body, messages)
    form: dict = {"raw_prompt": False, "messages": None, "tools": tools or None}
    if len(messages) == 1 and messages[0]["role"] == "user" and not tools:
        return messages[0]["content"], form  # a plain job: as `specpipe generate` runs it
    transcript = "\n\n".join(_transcript_line(m) for m in messages)
    return transcript, {**form, "messages": messages}


def _tools(body: dict, messages: list[dict]) -> list[dict]:
    """The tools rendered into the chat's prompt (`tool_choice` says which); a 400 where the
    request offers tools, or its messages hold calls, and the model does not take them."""
    _optional(body, "parallel_tool_calls", (bool,), "true or false")
    tools = tooling.check_tools(body.get("tools"))
    used = next(
        (
            f"messages[{i}]"
            for i, m in enumerate(messages)
            if m["role"] == "tool" or m.get("tool_calls")
        ),
        None,
    )
    if (tools or used) and not tooling.takes_tools(submitter().target()):
        raise tooling.refuse_tools("tools" if tools else used)
    return tooling.offered(tools, body.get("tool_choice"))


def _transcript_line(message: dict) -> str:
    """A message as the job's readable prompt shows it."""
    role, content = message["role"], message["content"]
    if role == "tool":
        return f"tool {message['name']}: {content}"
    calls = "".join(f"\n-> {tooling.call_text(call)}" for call in message.get("tool_calls", []))
    return f"{role}: {content}{calls}" if content else f"{role}:{calls}"


def _param(field: str, chat: bool, max_tokens_name: str) -> str:
    """The request's name for a job field, as an error names it."""
    if field == "max_new_tokens":
        return max_tokens_name
    if field == "prompt" and chat:
        return "messages"
    return FIELD_BY_NAME[field].openai_param
