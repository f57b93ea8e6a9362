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
_ENDS = re.compile("|".join(re.escape(m) for m in (END, RETURN, CALL)))


def speaks_harmony(token_id) -> bool:
    """Whether a tokenizer (its `token_id(text)`) has harmony's markers as single tokens."""
    return all(token_id(marker) is not None for marker in MARKERS)


@dataclass(frozen=True)
class Reply:
    """An assistant's reply, its channels apart."""

    reasoning: str  # the analysis channel's messages
    content: str  # the final answer (and any other channel's messages)


def split_reply(text: str) -> Reply:
    """The reasoning and the answer in `text`, a reply as generated after the prompt's
    `<|start|>assistant`. A reply without any header (a model that did not follow the format)
    is all answer; a message whose header is not finished yet contributes nothing yet."""
    if CHANNEL not in text and MESSAGE not in text:
        return Reply("", _strip_markers(text))
    reasoning, content = [], []
    for segment in text.split(START):
        if not segment:
            continue
        header, found, body = segment.partition(MESSAGE)
        if not found:  # a header still being written
            continue
        body = _ENDS.split(body, maxsplit=1)[0]
        channel = header.partition(CHANNEL)[2].split(" ", 1)[0].split("<|", 1)[0].strip()
        (reasoning if channel in REASONING_CHANNELS else content).append(body)
    return Reply("\n".join(reasoning), "".join(content))


def _strip_markers(text: str) -> str:
    for marker in MARKERS:
        text = text.replace(marker, "")
    return text
