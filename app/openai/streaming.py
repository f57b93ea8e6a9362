"""A streamed answer: the job's new text as Server-Sent Events while it runs."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from flask import Flask
from sqlalchemy.orm import Session

from app.openai.answers import chat_finish_reason, head, logprobs_of, stream_chunk, usage
from app.openai.errors import OpenAIError
from app.openai.requests import Completion
from app.openai.tools import call_deltas
from app.openai.waiting import KEEP_ALIVE_S, cancel_job, failure, job_updates
from app.replies import job_target, speaks_harmony
from models.jobs import Job
from specpipe.core.stopping import hold_back_stop_prefix
from specpipe.transformer.harmony import Reply, split_reply


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
    sent = _Sent(completion)
    try:
        for job in job_updates(session, job_id, poll_s, wait_s, idle_s=KEEP_ALIVE_S):
            if job is None:  # nothing new for a while: a comment shows whether anyone listens
                yield ": waiting\n\n"
                continue
            if job.finished and job.status != "done":
                yield _event({"error": failure(job).body()})
                done = True
                return
            text = stable_text(job)
            if not text.startswith(sent.text):
                continue  # a rare decoder whose text changed behind the shown part: wait
            yield from sent.news(job, text)
            if job.finished:
                yield from _ending(completion, job, sent)
                done = True
                return
    except TimeoutError as exc:
        yield _event({"error": OpenAIError(504, str(exc), kind="timeout").body()})
    finally:
        if not done:  # the client went away, or the wait ran out: the job is not wanted
            cancel_job(session, job_id)
        session.close()


@dataclass
class _Sent:
    """What a stream has sent of its job's text and tokens, and the model that reads them."""

    completion: Completion
    text: str = ""
    ids: int = 0
    first: bool = True
    target: object = None
    opened: bool = False
    reply: Reply = field(default_factory=lambda: Reply("", ""))  # with harmony: each channel
    call_ids: list[str] = field(default_factory=list)  # the id of each call sent

    def news(self, job: Job, text: str) -> Iterator[str]:
        """A chunk for what of `text`, the job's stable text, and its tokens was not sent yet."""
        completion = self.completion
        n_ids = len(job.output_ids or [])
        # The model is opened once: one that cannot open stays so.
        if not self.opened and (completion.chat or completion.logprobs is not None or job.finished):
            self.target, self.opened = job_target(job), True
        logprobs = logprobs_of(completion, job, self.ids, n_ids, self.target, len(self.text))
        if text == self.text and not self.first and not logprobs:
            return
        new_text, reasoning, calls = self._new_parts(text)
        if new_text or reasoning or calls or self.first or logprobs:  # markers alone show nothing
            chunk = stream_chunk(
                completion, job, new_text, logprobs, None, self.first, reasoning, calls
            )
            yield _event(chunk)
        self.text, self.ids, self.first = text, n_ids, False

    def _new_parts(self, text: str) -> tuple[str, str | None, list[dict]]:
        """The answer's new text and, with harmony, the reasoning's and the calls' (where tools
        were offered)."""
        if not (self.completion.chat and speaks_harmony(self.target)):
            return text[len(self.text) :], None, []
        reply = split_reply(text)
        new_text = reply.content[len(self.reply.content) :]
        reasoning = reply.reasoning[len(self.reply.reasoning) :]
        calls = []
        if self.completion.tools_offered:
            calls = call_deltas(self.reply.calls, reply.calls, self.call_ids)
        self.reply = reply
        return new_text, reasoning, calls

    def finish_reason(self, job: Job) -> str:
        """The finish of the stream's job: `tool_calls` when its calls were sent."""
        reply = self.reply if speaks_harmony(self.target) else None
        return chat_finish_reason(self.completion, job, self.target, reply)


def _ending(completion: Completion, job: Job, sent: _Sent) -> Iterator[str]:
    """The finish chunk, the usage when asked for, and the end of the stream."""
    yield _event(stream_chunk(completion, job, None, None, sent.finish_reason(job)))
    if completion.include_usage:
        yield _event({**head(completion, job, True), "choices": [], "usage": usage(job)})
    yield _event("[DONE]")


def closing(events: Iterator[str], close: Callable[[], None]) -> Iterator[str]:
    """`events`, then `close` once they end, however they end."""
    try:
        yield from events
    finally:
        close()
