"""A streamed answer: its jobs' new text as Server-Sent Events while they run, the chunks of
its choices (a job each) interleaved as they come, each naming its choice's index."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from flask import Flask
from sqlalchemy.orm import Session

from app.openai.answers import (
    Answer,
    chat_finish_reason,
    chunk_choice,
    head,
    logprobs_of,
    stream_chunk,
    usage,
)
from app.openai.errors import OpenAIError
from app.openai.requests import Completion
from app.openai.tools import call_deltas
from app.openai.waiting import KEEP_ALIVE_S, cancel_jobs, failure, job_updates
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


def stream_answer(app: Flask, completion: Completion, answer: Answer) -> Iterator[str]:
    """The Server-Sent Events of a streamed answer; cancels the jobs still running if the client
    goes away, the wait runs out or one of them fails."""
    session: Session = app.extensions["specpipe.sessions"]()
    poll_s, wait_s = app.config["OPENAI_POLL_S"], app.config["OPENAI_WAIT_S"]
    stream = _Stream(completion, answer)
    try:
        for job in job_updates(session, answer.job_ids, poll_s, wait_s, idle_s=KEEP_ALIVE_S):
            yield from stream.update(job)
            if stream.over:
                return
    except TimeoutError as exc:
        yield _event({"error": OpenAIError(504, str(exc), kind="timeout").body()})
    finally:
        cancel_jobs(session, stream.unfinished())  # none once the stream has ended well
        session.close()


@dataclass
class _Stream:
    """What a stream has sent of each of its choices, and which of their jobs have finished."""

    completion: Completion
    answer: Answer
    sent: dict[int, _Sent] = field(default_factory=dict)  # by job id
    ended: dict[int, Job] = field(default_factory=dict)  # the jobs finished, by id
    over: bool = False  # the stream has sent its end, or an error

    def __post_init__(self) -> None:
        for index, job_id in enumerate(self.answer.job_ids):
            self.sent[job_id] = _Sent(self.completion, self.answer, index)

    def update(self, job: Job | None) -> Iterator[str]:
        """The events for a job's news (None: nothing new for a while), the end once every
        job has finished, or an error event for a job that did not finish well."""
        if job is None:  # nothing new for a while: a comment shows whether anyone listens
            yield ": waiting\n\n"
            return
        if job.finished and job.status != "done":
            self.ended[job.id], self.over = job, True
            yield _event({"error": failure(job).body()})
            return
        sent = self.sent[job.id]
        text = stable_text(job)
        if not text.startswith(sent.text):
            return  # a rare decoder whose text changed behind the shown part: wait
        yield from sent.news(job, text)
        if job.finished:
            self.ended[job.id] = job
            yield _event(sent.finish_chunk(job))
            if len(self.ended) == len(self.answer.job_ids):
                yield from self._ending(job)
                self.over = True

    def _ending(self, last: Job) -> Iterator[str]:
        """The usage when asked for, and the end of the stream."""
        if self.completion.include_usage:
            jobs = [self.ended[job_id] for job_id in self.answer.job_ids]
            chunk = {**head(self.completion, self.answer, last, True), "choices": []}
            yield _event({**chunk, "usage": usage(jobs)})
        yield _event("[DONE]")

    def unfinished(self) -> list[int]:
        """The jobs not seen to finish."""
        return [job_id for job_id in self.answer.job_ids if job_id not in self.ended]


@dataclass
class _Sent:
    """What a stream has sent of one choice's text and tokens, and the model that reads them."""

    completion: Completion
    answer: Answer
    index: int
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
            choice = chunk_choice(
                completion, self.index, new_text, logprobs, None, self.first, reasoning, calls
            )
            yield _event(stream_chunk(completion, self.answer, job, choice))
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

    def finish_chunk(self, job: Job) -> dict:
        """The chunk that ends the choice: its finish, `tool_calls` when its calls were sent."""
        reply = self.reply if speaks_harmony(self.target) else None
        reason = chat_finish_reason(self.completion, job, self.target, reply)
        choice = chunk_choice(self.completion, self.index, None, None, reason)
        return stream_chunk(self.completion, self.answer, job, choice)


def closing(events: Iterator[str], close: Callable[[], None]) -> Iterator[str]:
    """`events`, then `close` once they end, however they end."""
    try:
        yield from events
    finally:
        close()
