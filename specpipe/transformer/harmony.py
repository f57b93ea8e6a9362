"""gpt-oss's chat format, harmony: which tokenizers speak it, and a reply split into channels.

A harmony conversation is messages `<|start|>{role}<|channel|>{channel}<|message|>{text}` each
ended by `<|end|>`, the last of a reply by `<|return|>` (or `<|call|>` for a tool call). The
prompt is the checkpoint's own chat template, ending with `<|start|>assistant`; the model then
writes its reasoning in the `analysis` channel and its answer in `final`:

    <|channel|>analysis<|message|>The user asks…<|end|>
    <|start|>assistant<|channel|>final<|message|>Paris.<|return|>

(one line; broken here for reading). `split_reply` takes that text (decoded with its special
tokens, as jobs keep it) and gives the reasoning and the answer apart, as OpenAI-compatible
servers return them (`reasoning_content` and `content`). It reads a reply still being written
too: what each channel holds so far.

A tool call is a message addressed to the function, in the `commentary` channel, its arguments
JSON and its end `<|call|>`; the address comes after the channel or before it:

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city":"Paris"}<|call|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{…}<|call|>

`split_reply` gives each call to a function apart (`Reply.calls`); a message addressed to anyone
is never part of the answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
RETURN, CALL = "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, RETURN, CALL)
# What ends generation: the reply's last message, or a tool call.
STOP_MARKERS = (RETURN, CALL)
REASONING_CHANNELS = ("analysis",)
FUNCTIONS = "functions."  # the namespace of the caller's function tools
_ENDS = re.compile("|".join(re.escape(m) for m in (END, RETURN, CALL)))
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
RECIPIENT_START = "to="  # how a header that names its recipient before the channel begins


def speaks_harmony(token_id) -> bool:
    """Whether a tokenizer (its `token_id(text)`) has harmony's markers as single tokens."""
    return all(token_id(marker) is not None for marker in MARKERS)


@dataclass(frozen=True)
class ToolCall:
    """A call of one of the caller's functions, as the model wrote it (so far)."""

    name: str  # the function's name, without the `functions.` namespace
    arguments: str  # the arguments' JSON text as written
    done: bool = True  # the message has ended (`<|call|>`); False while it is being written


@dataclass(frozen=True)
class Reply:
    """An assistant's reply, its channels apart."""

    reasoning: str  # the analysis channel's messages
    content: str  # the final answer (and any other channel's messages to no one in particular)
    calls: tuple[ToolCall, ...] = ()  # its calls of functions, in order


def split_reply(text: str) -> Reply:
    """The reasoning, the answer and the calls in `text`, a reply as generated after the
    prompt's `<|start|>assistant`. A reply without any header (a model that did not follow the
    format) is all answer; a message whose header is not finished yet contributes nothing yet,
    and neither does a reply that begins with a recipient (` to=…`) whose header goes on."""
    if CHANNEL not in text and MESSAGE not in text:
        stripped = text.lstrip()
        if stripped.startswith(RECIPIENT_START) or RECIPIENT_START.startswith(stripped):
            return Reply("", "")  # perhaps the header of a call, still being written
        return Reply("", _strip_markers(text))
    reasoning, content, calls = [], [], []
    for segment in text.split(START):
        header, found, body = segment.partition(MESSAGE)
        if not found:  # no message, or a header still being written
            continue
        parts = _ENDS.split(body, maxsplit=1)
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            name = recipient.group(1)
            if name.startswith(FUNCTIONS):
                calls.append(ToolCall(name[len(FUNCTIONS) :], parts[0], len(parts) > 1))
            continue
        channel = header.partition(CHANNEL)[2].split(" ", 1)[0].split("<|", 1)[0].strip()
        (reasoning if channel in REASONING_CHANNELS else content).append(parts[0])
    return Reply("\n".join(reasoning), "".join(content), tuple(calls))


def _strip_markers(text: str) -> str:
    for marker in MARKERS:
        text = text.replace(marker, "")
    return text
