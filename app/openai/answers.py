"""The JSON of an answer: a whole completion, a stream's chunks, usage and log-probabilities.

A request's answer has a choice per job (`n` of them), in index order; its id and creation time
are its first job's.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

from app.openai.requests import Completion
from app.openai.tools import answer_calls
from app.replies import job_target, speaks_harmony
from models.jobs import Job
from specpipe import __version__
from specpipe.core.stopping import GenerationText
from specpipe.transformer.harmony import Reply, split_reply


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


def chat_finish_reason(completion: Completion, job: Job, target, reply: Reply | None) -> str:
    """`tool_calls` when the reply of a chat that offered tools holds a call and ended on its
    own (not at the token budget), else `finish_reason`."""
    reason = finish_reason(job, target)
    if reason == "stop" and completion.tools_offered and reply is not None and reply.calls:
        return "tool_calls"
    return reason


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


@dataclass(frozen=True)
class Answer:
    """The jobs that answer one request, a choice each, in index order."""

    job_ids: tuple[int, ...]
    created: int  # the first job's, in seconds

    @classmethod
    def of(cls, jobs: Sequence[Job]) -> Answer:
        """The answer of `jobs`, the first choice's first."""
        first = jobs[0]
        created = int(first.created_at.timestamp()) if first.created_at else int(time.time())
        return cls(tuple(job.id for job in jobs), created)


def usage(jobs: Sequence[Job]) -> dict:
    """The tokens of the prompt, counted once as every choice is fed the same, and of the
    completions of all choices together."""
    prompt = max(job.prompt_tokens or 0 for job in jobs)
    completion = sum(len(job.output_ids or []) for job in jobs)
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


def _extensions(jobs: Sequence[Job]) -> dict:
    """The answer's extension object: the first choice's, and with several choices each
    choice's in `choices`, in index order."""
    first = _extension(jobs[0])
    if len(jobs) == 1:
        return first
    return {**first, "choices": [_extension(job) for job in jobs]}


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


def logprobs_of(completion: Completion, job: Job, start: int, end: int, target, offset: int):
    """The log-probabilities of output tokens `start` to `end`, in the shape of the endpoint;
    None when not asked for."""
    if completion.logprobs is None:
        return None
    ids = list(job.output_ids or [])[start:end]
    entries = list(job.output_logprobs or [])[start:end]
    if completion.chat:
        return _chat_logprobs(entries, ids, target)
    return _completion_logprobs(entries, ids, target, offset)


def head(completion: Completion, answer: Answer, job: Job, chunk: bool) -> dict:
    """The fields every answer and chunk starts with; `job` the one it tells of."""
    if completion.chat:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
        prefix = "chatcmpl"
    else:
        kind, prefix = "text_completion", "cmpl"
    return {
        "id": f"{prefix}-{answer.job_ids[0]}",
        "object": kind,
        "created": answer.created,
        "model": job.model,
        "system_fingerprint": fingerprint(job),
    }


def whole_answer(completion: Completion, jobs: Sequence[Job]) -> dict:
    """The non-streamed response for finished jobs, a choice each."""
    return {
        **head(completion, Answer.of(jobs), jobs[0], False),
        "choices": [_choice(completion, job, index) for index, job in enumerate(jobs)],
        "usage": usage(jobs),
        "specpipe": _extensions(jobs),
    }


def _choice(completion: Completion, job: Job, index: int) -> dict:
    """A whole answer's choice: the output of its finished job."""
    target = job_target(job)
    text = job.output_text or ""
    logprobs = logprobs_of(completion, job, 0, len(job.output_ids or []), target, 0)
    choice: dict = {
        "index": index,
        "finish_reason": finish_reason(job, target),
        "logprobs": logprobs,
    }
    if completion.chat and speaks_harmony(target):
        reply = split_reply(text)
        choice["message"] = _harmony_message(completion, reply)
        choice["finish_reason"] = chat_finish_reason(completion, job, target, reply)
    elif completion.chat:
        choice["message"] = {"role": "assistant", "content": text, "refusal": None}
    else:
        choice["text"] = text
    return choice


def _harmony_message(completion: Completion, reply: Reply) -> dict:
    """A harmony reply as the answer's message: its reasoning, its answer and, where tools were
    offered, its calls (the content then null unless the reply also said something)."""
    message = {
        "role": "assistant",
        "content": reply.content,
        "reasoning_content": reply.reasoning,
        "refusal": None,
    }
    if completion.tools_offered and reply.calls:
        message["tool_calls"] = answer_calls(reply.calls)
        message["content"] = reply.content or None
    return message


def stream_chunk(completion: Completion, answer: Answer, job: Job, choice: dict) -> dict:
    """One chunk of a stream, of the choice whose job is `job` (`chunk_choice`)."""
    return {**head(completion, answer, job, True), "choices": [choice], "specpipe": _extension(job)}


def chunk_choice(
    completion: Completion,
    index: int,
    text: str | None,
    logprobs,
    finish: str | None,
    first: bool = False,
    reasoning: str | None = None,
    tool_calls: list[dict] | None = None,
) -> dict:
    """A chunk's choice: new text (a chat's reasoning and calls apart), or the finish."""
    choice: dict = {"index": index, "logprobs": logprobs, "finish_reason": finish}
    if completion.chat:
        delta: dict = {"role": "assistant", "content": ""} if first else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return choice
