"""The coordinator: one job's generation loop over the swarm.

The Celery task `workers.coordinator.generate(job_id)` (queue `coordinator`) reads the job,
builds the ring from the live node inventory (the stages must cover every layer exactly once,
in order, or the job fails with the layers nobody serves), resets the session and runs rounds:
n-gram drafts, one trip around the ring, the equality accept loop. The committed token ids and
the stats are stored every round, so the web app shows progress and a coordinator re-run after a
crash resumes from what was committed; because every token is sampled from the uniform keyed by
its position, the output is the one an undisturbed run gives. A cancel request stops the job at
its next round. Any failure ends the job with a one-line reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Protocol

from celery import shared_task
from sqlalchemy.orm import Session, sessionmaker

from models import Job
from models.db import make_session_factory, utcnow
from specpipe.generation import Generation
from specpipe.inventory import RouteError
from specpipe.redis_ring import RedisRing, RingError
from specpipe.ring import GapError, Ring, SamplingParams
from specpipe.settings import Settings

log = logging.getLogger("specpipe.coordinator")

GENERATE_TASK = "workers.coordinator.generate"


class Codec(Protocol):
    """Text to token ids and back: what the coordinator needs of a tokenizer."""

    def prompt_ids(self, prompt: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def run_job(
    sessions: sessionmaker[Session],
    job_id: int,
    make_ring: Callable[[Job], Ring],
    codec: Codec,
    eos_ids: Iterable[int] = (),
) -> str | None:
    """Run (or resume) one job to its end and return its status; None when there is no job."""
    eos = set(eos_ids)
    with sessions() as session:
        job = session.get(Job, job_id)
        if job is None:
            log.warning("job %s does not exist", job_id)
            return None
        if job.finished:
            return job.status
        if job.cancel_requested:
            return _finish(session, job, "cancelled")
        job.status, job.error = "running", None
        job.started_at = job.started_at or utcnow()
        session.commit()

        ring = None
        try:
            ring = make_ring(job)
            prompt_ids = codec.prompt_ids(job.prompt)
            job.prompt_tokens = len(prompt_ids)
            params = SamplingParams(temp=job.temp, top_p=job.top_p, top_k=job.top_k, seed=job.seed)
            accepted = list(job.accepted_per_round or [])
            generation = Generation(
                ring,
                f"job-{job.id}",
                prompt_ids,
                params,
                max_new_tokens=job.max_new_tokens,
                draft_k=job.draft_k,
                eos_ids=eos,
                resume=list(job.output_ids or []),  # a re-run continues from what was stored
            )
            status, counted = "done", 0
            for _ in generation.rounds():
                accepted.append(generation.stats.accepted - counted)
                counted = generation.stats.accepted
                ids = generation.generated
                text = codec.decode([t for t in ids if t not in eos])
                job.record_progress(ids, text, accepted, generation.stats.seconds)
                session.commit()
                session.refresh(job, ["cancel_requested"])  # the web app may have asked
                if job.cancel_requested:
                    status = "cancelled"
                    break
            return _finish(session, job, status)
        except (RouteError, RingError, GapError, ValueError) as exc:
            return _finish(session, job, "failed", f"{type(exc).__name__}: {exc}")
        finally:
            if ring is not None:
                _drop_quietly(ring, f"job-{job.id}")


def _finish(session: Session, job: Job, status: str, error: str | None = None) -> str:
    job.status, job.error, job.finished_at = status, error, utcnow()
    session.commit()
    return status


def _drop_quietly(ring: Ring, session_name: str) -> None:
    try:
        ring.drop(session_name)
    except Exception as exc:  # the job's outcome is stored; a stale cache only costs memory
        log.warning("could not drop %s on the ring: %s", session_name, exc)
    close = getattr(ring, "close", None)
    if close is not None:
        close()


class _ModelCodec:
    """A checkpoint's tokenizer as the coordinator's Codec."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def prompt_ids(self, prompt: str) -> list[int]:
        return self.tokenizer.prompt_ids(prompt)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


@shared_task(name=GENERATE_TASK, ignore_result=True)
def generate(job_id: int) -> str | None:
    """Celery task: run job `job_id` over the swarm the inventory describes."""
    settings = Settings.from_env()
    sessions = make_session_factory(settings.database_url)
    with sessions() as session:
        job = session.get(Job, job_id)
        model = job.model if job is not None else None
    if model is None:
        log.warning("job %s does not exist", job_id)
        return None
    try:
        # The model package is needed only here, for the tokenizer and the layer count.
        from specpipe.model.resolve import load_tokenizer, open_checkpoint

        checkpoint = open_checkpoint(model)
        tokenizer = load_tokenizer(checkpoint)
    except Exception as exc:
        return _fail(sessions, job_id, f"cannot open model {model!r}: {exc}")
    if not settings.redis_url or not settings.swarm_key:
        return _fail(sessions, job_id, "the swarm is not configured: REDIS_URL and "
                                       "SPECPIPE_SWARM_KEY must be set")  # fmt: skip
    eos = set(checkpoint.config.eos_token_ids)
    eos_token = getattr(tokenizer, "eos_token", None)
    if eos_token and tokenizer.token_id(eos_token) is not None:
        eos.add(tokenizer.token_id(eos_token))

    def make_ring(_job: Job) -> RedisRing:
        return RedisRing.from_inventory(
            settings.redis_url,
            settings.swarm,
            settings.swarm_key.encode(),
            n_layers=checkpoint.config.n_layers,
        )

    return run_job(sessions, job_id, make_ring, _ModelCodec(tokenizer), eos)


def _fail(sessions: sessionmaker[Session], job_id: int, reason: str) -> str | None:
    with sessions() as session:
        job = session.get(Job, job_id)
        if job is None or job.finished:
            return None if job is None else job.status
        return _finish(session, job, "failed", reason)
