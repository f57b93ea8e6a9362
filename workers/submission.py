"""Submitting a job, one path for the web form, the JSON API and the CLI.

`Submitter.check` validates a request against the job request's fields and limits
(`workers.job_request`) and the model's context, `Submitter.submit` stores the queued job and
hands its id to the coordinator: the generate task is published by name with a light Celery
client (no task code imported), JSON-serialised, to the coordinator queue. A job whose hand-off
fails is marked failed, so the store never holds a queued job nobody will run.

A missing or blank seed is drawn at random and recorded, so every job can be run again exactly.

Every job has an owner: the user who submitted it (the built-in admin when none is given, as for
`specpipe generate`). A user with `JobLimits.max_active_jobs` jobs queued or running gets
TooManyActiveJobs instead of another. Several jobs asked for together (an OpenAI request's `n`
choices) are submitted all or none: counted against that cap together, stored in one commit,
and failed together when one of them cannot be handed over.

A job whose prompt tokens plus `max_new_tokens` pass the model's context length is refused
(a `max_new_tokens` field error). Counting the prompt's tokens needs the model's tokenizer,
opened once per process with `open_target` (its tokenizer and configuration, never its
weights); where the model cannot be opened here, the coordinator makes the same check and fails
the job at once with the reason.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from celery import Celery
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from models.db import utcnow
from models.jobs import ACTIVE_STATUSES, Job
from models.users import User, builtin_admin
from specpipe.core.sampling import random_seed
from specpipe.decoding.target import Target, context_error, open_target
from specpipe.settings import JOB_DEFAULTS, JobLimits
from workers.job_request import JobRequestError, parse_job_request
from workers.names import COORDINATOR_QUEUE, GENERATE_TASK

log = logging.getLogger(__name__)


class TooManyActiveJobs(RuntimeError):
    """The user already has as many queued and running jobs as allowed; nothing was stored."""

    retry_after_s = 10  # a hint: jobs finish, or can be cancelled, meanwhile

    def __init__(self, limit: int, active: int | None = None, wanted: int = 1):
        if wanted == 1:
            held = f"you already have {limit} jobs queued or running, the most allowed"
        else:
            held = (
                f"you have {active} jobs queued or running and asked for {wanted} more, "
                f"but at most {limit} are allowed"
            )
        super().__init__(f"{held}: wait for some to finish (or cancel some) and submit again")
        self.limit = limit


class QueueUnavailable(RuntimeError):
    """The job was stored but could not be handed to the coordinator; `jobs` are all those
    submitted together (the first is `job`), every one of them failed."""

    def __init__(self, job: Job, reason: str, jobs: list[Job] | None = None):
        super().__init__(reason)
        self.job = job
        self.jobs = jobs or [job]


def make_client(broker_url: str) -> Celery:
    """A Celery client on `broker_url` with the project's settings (JSON only)."""
    client = Celery("specpipe-client", set_as_current=False)
    client.config_from_object("celery_config")
    client.conf.update(broker_url=broker_url, broker_connection_timeout=2)
    return client


@dataclass
class Submitter:
    """Checks job requests and hands stored jobs to the coordinator on `queue`."""

    client: Celery
    model: str  # the model jobs run on
    limits: JobLimits
    queue: str = COORDINATOR_QUEUE

    @classmethod
    def connect(
        cls, broker_url: str, model: str, limits: JobLimits, queue: str = COORDINATOR_QUEUE
    ) -> Submitter:
        """A submitter whose Celery client publishes to the broker at `broker_url`."""
        return cls(make_client(broker_url), model, limits, queue)

    def check(
        self,
        raw: Mapping[str, object],
        *,
        from_text: bool = False,
        prompt_form: Mapping[str, object] | None = None,
    ) -> dict:
        """Clean values for `raw`; raises JobRequestError listing every bad field.

        `from_text` accepts form strings for the numbers, and stop strings one per line.
        `prompt_form` says how the prompt is fed (`raw_prompt`, `messages`; see `models.jobs`),
        as the caller made it: kept in the values, and the prompt's tokens counted so."""
        params = parse_job_request(raw, self.limits, from_text)
        return self.check_context({**params, **(prompt_form or {})})

    def check_context(self, params: dict) -> dict:
        """`params` when the prompt's tokens (fed as `raw_prompt` and `messages` say, with the
        chat's `tools`) and `max_new_tokens` fit the model's context; else JobRequestError on
        `max_new_tokens`, or on `prompt` for a chat the chat template refuses."""
        target = self.target()
        if target is not None:
            prompt_ids = _prompt_ids(target, params)
            reason = context_error(target, len(prompt_ids), params["max_new_tokens"])
            if reason is not None:
                raise JobRequestError({"max_new_tokens": reason})
        return params

    def target(self) -> Target | None:
        """The served model's tokenizer and context length in this process; None where it
        cannot be opened here."""
        return _target_here(self.model)

    def submit(
        self, session: Session, params: Mapping[str, object], owner: User | None = None
    ) -> Job:
        """Store a queued job for checked `params`, owned by `owner` (else the built-in admin),
        and enqueue it. Besides the checked fields, `params` may say how the prompt is fed
        (`raw_prompt`, `messages`, `tools`) and ask for `logprobs` (see `models.jobs`).

        Raises TooManyActiveJobs, storing nothing, when the owner is at the active-jobs cap, and
        QueueUnavailable, with the job marked failed, when the broker cannot be reached.
        """
        return self.submit_all(session, [params], owner)[0]

    def submit_all(
        self,
        session: Session,
        requests: Sequence[Mapping[str, object]],
        owner: User | None = None,
    ) -> list[Job]:
        """Store a queued job for each of `requests` (checked params, as `submit` takes them)
        in one commit, and enqueue them in order: all or none.

        Raises TooManyActiveJobs, storing nothing, when the owner has no room for all of them,
        and QueueUnavailable when one cannot be handed over: then every one of them is failed,
        or cancelled where a coordinator took it meanwhile (it takes queued jobs in turn,
        whichever message it was handed)."""
        owner = owner or builtin_admin(session)
        self.check_active(session, owner, len(requests))
        jobs = [self._queued_job(owner, params) for params in requests]
        session.add_all(jobs)
        session.commit()
        try:
            for job in jobs:
                job.task_id = self.enqueue(job.id)
        except Exception as exc:  # kombu and redis raise several types; all mean the same here
            log.warning("could not enqueue job %s: %s", job.id, exc)
            reason = f"could not reach the job queue: {exc}"
            _fail_all(session, jobs, reason)
            raise QueueUnavailable(jobs[0], reason, jobs) from exc
        session.commit()
        return jobs

    def _queued_job(self, owner: User, params: Mapping[str, object]) -> Job:
        """A queued job of `owner` for checked `params`, its seed drawn where none was given."""
        seed = params.get("seed")
        return Job(
            user_id=owner.id,
            prompt=params["prompt"],
            model=self.model,
            max_new_tokens=params["max_new_tokens"],
            temp=params["temp"],
            top_p=params["top_p"],
            top_k=params["top_k"],
            seed=random_seed() if seed is None else seed,
            seed_was_random=seed is None,
            draft_k=params["draft_k"],
            stop=list(params.get("stop") or []),
            sampler=params.get("sampler") or JOB_DEFAULTS["sampler"],
            raw_prompt=bool(params.get("raw_prompt", False)),
            messages=params.get("messages"),
            tools=params.get("tools") or None,
            logprobs=params.get("logprobs"),
            status="queued",
        )

    def check_active(self, session: Session, owner: User, wanted: int = 1) -> None:
        """Raise TooManyActiveJobs when `owner` has no room for `wanted` more jobs.

        The owner's row is locked until the caller commits (on PostgreSQL), so two submissions
        racing each other are counted one after the other."""
        session.scalar(select(User.id).where(User.id == owner.id).with_for_update())
        active = session.scalar(
            select(func.count())
            .select_from(Job)
            .where(Job.user_id == owner.id, Job.status.in_(ACTIVE_STATUSES))
        )
        if active + wanted > self.limits.max_active_jobs:
            session.rollback()
            raise TooManyActiveJobs(self.limits.max_active_jobs, active, wanted)

    def enqueue(self, job_id: int) -> str:
        """Publish the generate task for `job_id`; returns the task id, raises when unreachable."""
        result = self.client.send_task(
            GENERATE_TASK,
            args=[job_id],
            queue=self.queue,
            retry=True,
            retry_policy=ENQUEUE_RETRY,
        )
        return result.id


# A broker that is restarting (refusing connections, then loading its append-only file for a
# few seconds) is waited out, 4.5 s in all; one down for longer fails the job at once after.
ENQUEUE_RETRY = {"max_retries": 6, "interval_start": 0, "interval_step": 0.5, "interval_max": 1.0}

_TARGETS: dict[str, Target | None] = {}
_TARGETS_LOCK = threading.Lock()


def _target_here(model: str) -> Target | None:
    """The model's tokenizer and context length in this process, None where it cannot be
    opened (the coordinator checks the context then); tried once per model and process."""
    with _TARGETS_LOCK:
        if model not in _TARGETS:
            try:
                _TARGETS[model] = open_target(model)
            except Exception as exc:  # a missing or broken model is the coordinator's to report
                log.info("cannot open model %r to check prompts' length here: %s", model, exc)
                _TARGETS[model] = None
        return _TARGETS[model]


def _fail_all(session: Session, jobs: list[Job], reason: str) -> None:
    """Fail the jobs of a submission that could not all be handed over. A job still queued
    fails at once, whether or not its own message went out (a coordinator skips a finished
    job); one a coordinator started meanwhile is asked to stop at its next round."""
    session.rollback()
    ids = [job.id for job in jobs]
    session.execute(
        update(Job)
        .where(Job.id.in_(ids), Job.status == "queued")
        .values(status="failed", error=reason, finished_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    session.commit()
    for job in jobs:
        session.refresh(job)
        if job.status in ACTIVE_STATUSES and job.request_cancel():
            session.commit()


def _prompt_ids(target: Target, params: Mapping[str, object]) -> list[int]:
    """The ids a job of `params` is fed, as the coordinator feeds them
    (`workers.job_run.job_prompt_ids`)."""
    messages, tools = params.get("messages"), params.get("tools")
    if not messages or target.chat_ids is None:
        return target.prompt_ids(params["prompt"], raw=bool(params.get("raw_prompt", False)))
    try:
        return target.chat_ids(messages, tools=tools) if tools else target.chat_ids(messages)
    except Exception as exc:  # a template that refuses the messages fails in many ways
        reason = f"the chat template refused the messages: {exc}"
        raise JobRequestError({"prompt": reason}) from None


def rerun_params(job: Job) -> dict:
    """The parameters that reproduce `job`: same prompt (fed the same way), settings and seed."""
    return {"prompt": job.prompt, **job.params(), **job.prompt_form()}
