"""A streamed answer: the job's new text as Server-Sent Events while it runs."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

from flask import Flask
from sqlalchemy.orm import Session

from app.openai.answers import finish_reason, head, logprobs_of, stream_chunk, usage
from app.openai.errors import OpenAIError
from app.openai.requests import Completion
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
    try:
        sent_text, sent_ids, first, target, opened = "", 0, True, None, False
        sent = Reply("", "")  # with harmony: what of each channel was sent
        for job in job_updates(session, job_id, poll_s, wait_s, idle_s=KEEP_ALIVE_S):
            if job is None:  # nothing new for a while: a comment shows whether anyone listens
                yield ": waiting\n\n"
                continue
            if job.finished and job.status != "done":
                yield _event({"error": failure(job).body()})
                done = True
                return
            text = stable_text(job)
            if not text.startswith(sent_text):
                continue  # a rare decoder whose text changed behind the shown part: wait
            n_ids = len(job.output_ids or [])
            if not opened and (completion.chat or completion.logprobs is not None or job.finished):
                target, opened = job_target(job), True  # once: a model that cannot open stays so
            logprobs = logprobs_of(completion, job, sent_ids, n_ids, target, len(sent_text))
            if text != sent_text or first or logprobs:
                if completion.chat and speaks_harmony(target):
                    reply = split_reply(text)
                    new_text = reply.content[len(sent.content) :]
                    reasoning = reply.reasoning[len(sent.reasoning) :]
                    sent = reply
                else:
                    new_text, reasoning = text[len(sent_text) :], None
                if new_text or reasoning or first or logprobs:  # markers alone show nothing
                    part = stream_chunk(completion, job, new_text, logprobs, None, first, reasoning)
                    yield _event(part)
                sent_text, sent_ids, first = text, n_ids, False
            if job.finished:
                yield _event(stream_chunk(completion, job, None, None, finish_reason(job, target)))
                if completion.include_usage:
                    yield _event(
                        {**head(completion, job, True), "choices": [], "usage": usage(job)}
                    )
                yield _event("[DONE]")
                done = True
                return
    except TimeoutError as exc:
        yield _event({"error": OpenAIError(504, str(exc), kind="timeout").body()})
    finally:
        if not done:  # the client went away, or the wait ran out: the job is not wanted
            cancel_job(session, job_id)
        session.close()


def closing(events: Iterator[str], close: Callable[[], None]) -> Iterator[str]:
    """`events`, then `close` once they end, however they end."""
    try:
        yield from events
    finally:
        close()
