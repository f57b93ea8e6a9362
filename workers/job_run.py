"""Running one job: its prompt through the tokenizer, rounds over its ring, every round's
progress stored, and its end (done, cancelled, failed) recorded once.

A job's tokens are committed to the store every round, so a re-run after a crash resumes from
what was committed; because every token is sampled from the uniform keyed by its position, the
output is the one an undisturbed run gives. Any failure ends the job with a one-line reason,
except the store's own (unreachable, locked): the job then stays running, as after a crash, and
is resumed once the store is back.

A job with stop strings ends after the round whose decoded text first contains one of them;
its `output_text` is cut just before the earliest occurrence, while `output_ids` (and the token
count and tok/s that follow from them) keep every token committed up to and including that
round, so a few ids past the stop may be stored.

A job's `draft_k` is the most drafts a round sends: each round's K is chosen from the
session's recent acceptance and round times (`specpipe/drafting/length.py`), so speculation never
costs a job more than plain decoding would. Its `accepted_drafts` lists the drafts accepted in
each round (0 … draft_k); tokens committed per round are those plus the target's own token
(`Job.tokens_per_round`).
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import redis
from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from models import Job
from models.db import utcnow
from models.jobs import ACTIVE_STATUSES, sampling_params
from models.runs import Run, start_run
from specpipe.core.ring import GapError, Ring
from specpipe.core.sampling import TokenLogprob
from specpipe.core.stopping import GenerationText
from specpipe.decoding.generation import Generation
from specpipe.decoding.target import Target, context_error, open_target
from specpipe.settings import Settings, prefix_reuse
from specpipe.swarm.failover import (
    CheckedRing,
    drop_quietly,
    lost_with_spare,
    restarted_stages,
    served_layers,
)
from specpipe.swarm.inventory import RouteError
from specpipe.swarm.kvbudget import Reservations
from specpipe.swarm.prefix_directory import Prefilling, PrefixDirectory
from specpipe.swarm.redact import one_line_reason
from specpipe.swarm.redis_ring import ROUND_TIMEOUT_S, RedisRing, RingError
from workers.attempt import Attempt, Superseded
from workers.job_lock import lock_key
from workers.locks import LockKeeper
from workers.node_sync import sync_inventory
from workers.prefix_reuse import PrefixReuse, let_go_quietly
from workers.room import release_quietly, room_keeper

log = logging.getLogger("specpipe.coordinator")

# A job is started at most this often in a row without storing a round: a coordinator that dies
# on it every time (a crash it triggers, a machine that keeps going away) does not make it run
# forever, while outages that resume a job which goes on making progress cost it nothing.
MAX_ATTEMPTS = 3

# What a column's type raises on a stored value it cannot parse (SQLite keeps any value in any
# column: bad JSON, a date that is not one, text in an integer column).
UNREADABLE = (ValueError, TypeError, LookupError)

R = TypeVar("R", bound=Ring)


class Codec(Protocol):
    """Text to token ids and back: what a job's run needs of a tokenizer."""

    # (messages, tools=None): a chat's messages, and the functions it may call, through the
    # chat template; None for a model without one.
    chat_ids: Callable[..., list[int]] | None

    def prompt_ids(self, prompt: str, raw: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def run_job(
    session: Session,
    job_id: int,
    make_ring: Callable[[Job], R],
    codec: Codec,
    eos_ids: Iterable[int] = (),
    keep_alive: Callable[[], bool] | None = None,
    admit: Callable[[Job, R, int], Callable[[], None] | None] | None = None,
    prefixes: PrefixReuse | None = None,
) -> str | None:
    """Run (or resume) one job to its end and return its status; None when there is no job.

    `keep_alive` is called before the job starts and every round (it says whether this
    coordinator still holds the job's lock); when it returns False another coordinator owns the
    job, and this one stops without touching it further. Every write is fenced
    (`workers.attempt`): an attempt that a newer one superseded (its lock lost in a registry
    outage) stops at its next write without making it, and returns the job's status as it is
    then. `admit` (see `workers.room.Admit`) waits, the job still queued, until
    its stages have room for its cache; the room goes back when the job ends, however it ends.
    With `prefixes`, the job starts from a cache an earlier job kept where its tokens start with
    that job's, and keeps its own when it ends (`workers.prefix_reuse`)."""
    eos = set(eos_ids)
    job, outcome = pending(session, job_id)
    if job is None:
        return outcome
    attempt = Attempt.seen(job)
    refusal = _refusal(job)
    if refusal is not None:
        return finish(session, attempt, *refusal)

    # A name of its own per attempt: rounds a dead coordinator left in flight may still reach
    # the stages after this attempt's reset, and must not write into this attempt's caches.
    ring_session = f"job-{job.id}-{secrets.token_hex(4)}"
    ring = None
    release: Callable[[], None] | None = None
    took = StartTimes()
    leaving = Leaving(prefixes)
    try:
        ring = make_ring(job)
        took.mark("ring")
        prompt_ids = job_prompt_ids(codec, job)
        reason = context_error_of(codec, len(prompt_ids), job.max_new_tokens)
        if reason is not None:
            return finish(session, attempt, "failed", reason)
        admitted, release = _take_room(admit, job, ring, len(prompt_ids), took)
        if not admitted:  # cancelled while it waited, or another coordinator has it
            return _not_admitted(session, job, attempt)
        if keep_alive is not None and not keep_alive():
            # Its lock lapsed while it got ready, and another coordinator took the job: that
            # one runs it. Starting here too would only race it.
            log.warning(
                "job %s: lost its lock before it started; another coordinator runs it", job.id
            )
            return job.status
        attempt = _start_attempt(session, job, len(prompt_ids), took)
        _open_run(session, job, attempt, ring)
        return _generate(
            session, job, attempt, ring, ring_session, prompt_ids, codec, eos, keep_alive, leaving
        )
    except Superseded:
        return superseded(session, attempt)
    except (RouteError, RingError, GapError, ValueError) as exc:
        return finish(session, attempt, "failed", exc)
    except OperationalError as exc:
        # The store is unreachable or locked: what it holds is consistent up to the last round
        # stored, and marking the job failed would be a write that may just as well succeed.
        # It stays running; once its lock lapses, beat's `resume_stalled` resumes it.
        log.warning("job %s: the store failed (%s); left for resume_stalled", job_id, exc)
        _rollback_quietly(session)
        return "running"
    except Exception as exc:  # whatever else went wrong, the job ends rather than stays running
        log.exception("job %s failed", job_id)
        session.rollback()  # a failed flush or commit leaves the session unusable until then
        return finish(session, attempt, "failed", exc)
    finally:
        _let_go(ring, ring_session, release, leaving)


def _refusal(job: Job) -> tuple[str, str | None] | None:
    """The status (and the reason) a job ends with before it starts: cancelled, or started
    too often without progress; None when it may start."""
    if job.cancel_requested:
        return "cancelled", None
    if job.starts_since_progress >= MAX_ATTEMPTS:
        reason = (
            f"gave up after {job.starts_since_progress} attempts: its coordinator stopped each time"
        )
        return "failed", reason
    return None


def _take_room(
    admit: Callable[[Job, R, int], Callable[[], None] | None] | None,
    job: Job,
    ring: R,
    prompt_tokens: int,
    took: StartTimes,
) -> tuple[bool, Callable[[], None] | None]:
    """Wait until the job's stages have room for its cache (`admit`; None: no room to wait
    for): whether it got it, and what gives it back."""
    if admit is None:
        return True, None
    release = admit(job, ring, prompt_tokens + job.max_new_tokens)
    took.mark("room")
    return release is not None, release


def _not_admitted(session: Session, job: Job, attempt: Attempt) -> str | None:
    """The status of a job that got no room: cancelled if it was while it waited; else
    another coordinator has it, and it is left as it is."""
    session.refresh(job, ["cancel_requested", "status"])
    if job.cancel_requested:
        return finish(session, attempt, "cancelled")
    return job.status


def _start_attempt(session: Session, job: Job, prompt_tokens: int, took: StartTimes) -> Attempt:
    """This attempt, started as the job's latest (its start reported when it was slow)."""
    # The lock's holder starts the job over whichever attempt started it since it was read:
    # one that lost the lock meanwhile stops at its next write, instead of this one.
    session.refresh(job, ["attempts"])
    attempt = Attempt.seen(job).start(session, prompt_tokens)
    took.mark("store")
    took.report(job.id)
    return attempt


def _open_run(session: Session, job: Job, attempt: Attempt, ring: Ring) -> None:
    """Read the job as this attempt resumes it, and record its generation run if it has none."""
    # What this attempt resumes from: the row as it was when no older attempt could write.
    session.refresh(job)
    if job.run is None:
        attempt.run_started(session, _start_run(session, job, ring))


@dataclass
class Leaving:
    """What an attempt's session leaves on its stages: nothing, or (with prefix reuse, once its
    rounds ended as they should) its committed tokens' cache, kept as a prefix for later jobs."""

    prefixes: PrefixReuse | None
    prefilling: Prefilling | None = None  # jobs with the same first tokens wait on its prefill
    dropped: bool = False  # the session was ended (its cache kept) already

    def prefilled(self, job: Job, generation: Generation, ring: Ring, ring_session: str) -> None:
        """The generation's first round is done, so its prompt is in the caches: share it with
        the jobs waiting on its prefill, if it claimed one."""
        if self.prefixes is not None and self.prefilling is not None:
            prefilling, self.prefilling = self.prefilling, None
            self.prefixes.shared(
                job, prefilling, ring, ring_session, generation.tokens, generation.cached
            )

    def ended(self, job: Job, generation: Generation, ring: Ring, ring_session: str) -> None:
        """The generation's rounds ended (done or cancelled): end its session, keeping what its
        caches hold, and record it, before the job's end is stored and a next turn can come."""
        if self.prefixes is not None:
            self.dropped = self.prefixes.keep(
                job, ring, ring_session, generation.tokens, generation.cached
            )


def _let_go(
    ring: Ring | None,
    ring_session: str,
    release: Callable[[], None] | None,
    leaving: Leaving,
) -> None:
    """End the attempt's session on its ring, unless its end kept its cache already, and give
    its room back, whichever it got to."""
    if ring is not None:
        if leaving.dropped:
            ring.close()
        else:
            drop_quietly(ring, ring_session)
    if release is not None:
        release_quietly(release)
    if leaving.prefilling is not None:  # ended before its prefill did: the waiting go on
        let_go_quietly(leaving.prefilling)


class StartTimes:
    """How long each step of a job's start took, reported when the start was slow: a job that
    waits for room says so itself, but a slow ring or store otherwise goes unnoticed."""

    SLOW_S = 2.0

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.steps: dict[str, float] = {}

    def mark(self, step: str) -> None:
        now = time.monotonic()
        self.steps[step] = now - self.last
        self.last = now

    def report(self, job_id: int) -> None:
        total = sum(self.steps.values())
        if total >= self.SLOW_S:
            parts = ", ".join(f"{step} {s:.1f} s" for step, s in self.steps.items())
            log.warning("job %s took %.1f s to start (%s)", job_id, total, parts)


def _generate(
    session: Session,
    job: Job,
    attempt: Attempt,
    ring: Ring,
    ring_session: str,
    prompt_ids: list[int],
    codec: Codec,
    eos: set[int],
    keep_alive: Callable[[], bool] | None,
    leaving: Leaving,
) -> str | None:
    """The job's rounds, each stored as it ends, until it is done, cancelled or taken over."""
    params = sampling_params(job)
    stored_logprobs = list(job.output_logprobs or [])[: len(job.output_ids or [])]
    resume = list(job.output_ids or [])
    accepted = list(job.accepted_drafts or [])
    # The time already spent, so tok/s after a resume still counts the whole job.
    spent_s = len(resume) / job.tok_s if resume and job.tok_s else 0.0
    output = GenerationText(codec.decode, eos, job.stop or [])

    start = None
    if leaving.prefixes is not None:
        route = [hop.host for hop in ring.route]
        start, leaving.prefilling = leaving.prefixes.start(job, prompt_ids + resume, route)
    generation = Generation(
        ring,
        ring_session,
        prompt_ids,
        params,
        prefix=start,  # the cache an earlier job kept of the same first tokens, if any
        max_new_tokens=job.max_new_tokens,
        draft_k=job.draft_k,  # the most a round sends: each round's K is chosen
        adaptive=True,
        trees=True,  # the head's proposals are trees, sized as they pay
        eos_ids=eos,
        resume=resume,  # a re-run continues from what was stored
        should_stop=output.should_stop,
    )
    status, counted = "done", 0
    for _ in generation.rounds():
        leaving.prefilled(job, generation, ring, ring_session)
        accepted.append(generation.stats.accepted - counted)
        counted = generation.stats.accepted
        ids = generation.generated
        text, _ = output.cut(ids)
        logprobs = None
        if job.logprobs is not None:
            logprobs = stored_logprobs + [logprob_entry(lp) for lp in generation.logprobs]
        attempt.progress(session, ids, text, accepted, spent_s + generation.stats.seconds, logprobs)
        session.refresh(job, ["cancel_requested"])  # the web app may have asked
        if job.cancel_requested:
            status = "cancelled"
            break
        if keep_alive is not None and not keep_alive():
            log.warning("job %s: lost its lock to another coordinator; stopping", job.id)
            return job.status
    leaving.ended(job, generation, ring, ring_session)
    return finish(session, attempt, status)


def run_on_swarm(session: Session, job: Job, settings: Settings, keeper: LockKeeper) -> str | None:
    """Run `job`, whose lock `keeper` holds, over the swarm the inventory describes, once its
    stages have room for it: a `CheckedRing` of `RedisRing`s, its KV room kept by `room_keeper`."""
    try:
        target = open_target(job.model)
        reuse = prefix_reuse()
    except ValueError as exc:
        return finish(session, Attempt.seen(job), "failed", str(exc))
    except Exception as exc:  # a model that breaks its reader: still one line on the job
        reason = f"cannot open model {job.model!r}: {exc}"
        return finish(session, Attempt.seen(job), "failed", reason)

    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=5, socket_timeout=5)
    prefixes = PrefixReuse(PrefixDirectory(client, settings.swarm), reuse)

    def build_ring(prefer: list[str], avoid: frozenset[str] = frozenset()) -> RedisRing:
        ring = RedisRing.from_inventory(
            settings,
            target.name,
            target.n_layers,
            avoid=avoid,
            prefer=prefer,
            outage_s=ROUND_TIMEOUT_S,
        )
        sync_inventory(session, list(ring.route))  # the run's snapshot is the ring as it is now
        # At once: a write left open until the round after the replay would hold SQLite's
        # write lock that long, and every other job's round (and failover) would wait on it.
        session.commit()
        return ring

    def make_ring(job: Job) -> CheckedRing:
        # The hosts keeping the job's longest kept prefix, if any: its ring prefers them, so a
        # conversation's next turn finds its cache where the last turn left it. (The prompt is
        # tokenized again by run_job: a few milliseconds beside a ring's build.)
        prefer = prefixes.keeper(job, job_prompt_ids(target, job) + list(job.output_ids or []))
        lost = lost_with_spare(settings, target.name, target.n_layers)
        return CheckedRing(
            functools.partial(build_ring, prefer),
            lambda: served_layers(settings),
            lost,
            restarted_stages(settings),
        )

    admit = room_keeper(
        session,
        Reservations(client, settings.swarm),
        lock_key(settings.swarm, job.id),
        keeper.owned,
    )
    try:
        return run_job(
            session, job.id, make_ring, target, target.eos_ids, keeper.owned, admit, prefixes
        )
    finally:
        client.close()


def context_error_of(codec: Codec, prompt_tokens: int, max_new_tokens: int) -> str | None:
    """Why the job cannot fit the model's context (when the codec is a Target that knows it)."""
    if not isinstance(codec, Target):
        return None
    return context_error(codec, prompt_tokens, max_new_tokens)


def job_prompt_ids(codec: Codec, job: Job) -> list[int]:
    """The ids the job's prompt is fed as: its chat's messages (with its tools) through the chat
    template, its prompt as it is (raw), or its prompt as one user message."""
    if job.messages:
        if codec.chat_ids is None:
            raise ValueError(f"model {job.model!r} cannot take a chat's messages")
        try:
            if job.tools:
                return codec.chat_ids(job.messages, tools=job.tools)
            return codec.chat_ids(job.messages)
        except Exception as exc:  # a template that refuses the messages: one line on the job
            raise ValueError(f"the chat template refused the messages: {exc}") from None
    if job.raw_prompt:
        return codec.prompt_ids(job.prompt, raw=True)
    return codec.prompt_ids(job.prompt)


def logprob_entry(logprob: TokenLogprob) -> list:
    """A token's log-probabilities as a job stores them: `[logprob, [[id, logprob], ...]]`."""
    return [logprob.logprob, [[i, a] for i, a in logprob.top]]


def pending(session: Session, job_id: int) -> tuple[Job | None, str | None]:
    """(job, None) while job `job_id` has work left; else (None, what the task returns): None
    for a job that does not exist, the status of a finished one. The job is read afresh, as
    the store holds it now, however long the session has lived."""
    try:
        job = session.get(Job, job_id, populate_existing=True)
    except UNREADABLE as exc:
        return None, set_aside(session, job_id, exc)
    if job is None:
        log.warning("job %s does not exist", job_id)
        return None, None
    if job.finished:
        return None, job.status
    return job, None


def set_aside(session: Session, job_id: int, exc: Exception) -> str | None:
    """Fail a job whose stored row cannot be read (a column its type cannot parse: a hand edit,
    a damaged file) in one UPDATE that reads none of it, so that no delivery or beat task trips
    on it again; the job's status as it is then."""
    _rollback_quietly(session)
    reason = f"its stored row cannot be read ({one_line_reason(exc)}); it was set aside"
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_(ACTIVE_STATUSES))
        .values(status="failed", finished_at=utcnow(), error=reason)
        .execution_options(synchronize_session=False)
    )
    session.commit()
    log.warning("job %s: %s", job_id, reason)
    return session.scalar(select(Job.status).where(Job.id == job_id))


def finish(
    session: Session, attempt: Attempt, status: str, error: str | BaseException | None = None
) -> str | None:
    """End the job with `status` (an error stored as one redacted line) and return it; the
    job's current status instead when a newer attempt holds it."""
    try:
        attempt.finish(session, status, error)
    except Superseded:
        return superseded(session, attempt)
    return status


def superseded(session: Session, attempt: Attempt) -> str | None:
    """The job's status as the store holds it, for an attempt that stops without writing."""
    _rollback_quietly(session)
    try:
        status = session.scalar(select(Job.status).where(Job.id == attempt.job_id))
    except OperationalError:  # the store went away too: the newer attempt's rows stand anyway
        _rollback_quietly(session)
        status = "running"
    log.warning(
        "job %s: attempt %d was superseded (the job is %s now); it stops without writing",
        attempt.job_id,
        attempt.number,
        status,
    )
    return status


def _start_run(session: Session, job: Job, ring: Ring) -> Run:
    """A generation run for `job`, its node snapshot cut down to the ring the job runs on."""
    hosts = [hop.host for hop in ring.route]
    method = (
        f"speculative, n-gram drafter and the tail's draft head, adaptive K<={job.draft_k}"
        if job.draft_k
        else "plain"
    )
    method += f", {job.sampler} sampler"
    run = start_run(
        session,
        "generation",
        model=job.model,
        method=method,
        topology=" -> ".join(hosts) if hosts else None,
    )
    if hosts:
        kept = [s for s in run.node_snapshots if s.host in hosts]
        kept.sort(key=lambda s: hosts.index(s.host))
        for position, snapshot in enumerate(kept):
            snapshot.position = position
        run.node_snapshots = kept
    return run


def _rollback_quietly(session: Session) -> None:
    try:
        session.rollback()
    except Exception as exc:  # a connection gone mid-transaction; the next use reconnects
        log.warning("rollback failed: %s", exc)
