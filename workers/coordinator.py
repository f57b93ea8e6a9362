"""The coordinator: one job's generation loop over the swarm.

The Celery task `workers.coordinator.generate(job_id)` (queue `coordinator`) takes a per-job
Redis lock (a duplicate delivery never runs a job twice at once), reads the job, builds the ring
from the live node inventory (the stages must cover every layer exactly once, in order, or the
job fails with the layers nobody serves), records a generation run with a snapshot of that ring,
resets the session and runs rounds: n-gram drafts, one trip around the ring, the equality accept
loop. The committed token ids and the stats are stored every round, so the web app shows
progress and a coordinator re-run after a crash resumes from what was committed; because every
token is sampled from the uniform keyed by its position, the output is the one an undisturbed
run gives. The beat task `workers.coordinator.resume_stalled` re-enqueues running jobs whose
coordinator died. A cancel request stops the job at its next round. Any failure ends the job
with a one-line reason, except the store's own (unreachable, locked): the job then stays running,
as after a crash, and is resumed once the store is back.

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

import base64
import json
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from functools import partial
from typing import Protocol

import redis
from celery import shared_task
from celery.signals import worker_ready
from sqlalchemy import select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from models import Job
from models.db import utcnow
from models.runs import start_run
from specpipe.core.ring import GapError, Ring
from specpipe.core.sampling import SamplingParams, TokenLogprob
from specpipe.core.stopping import GenerationText
from specpipe.decoding.generation import Generation
from specpipe.decoding.target import Target, context_error, open_target
from specpipe.settings import Settings, default_model, stalled_after_s
from specpipe.swarm import inventory
from specpipe.swarm.inventory import RouteError
from specpipe.swarm.kvbudget import Reservations, Room, room_name
from specpipe.swarm.redact import one_line_reason, redact_url
from specpipe.swarm.redis_ring import HopLostError, RedisRing, RingError
from workers.celery_app import DbTask
from workers.locks import LockKeeper
from workers.names import COORDINATOR_QUEUE, GENERATE_TASK, RESUME_STALLED_TASK
from workers.node_sync import sync_inventory
from workers.turns import fair_order

log = logging.getLogger("specpipe.coordinator")

ROOM_POLL_S = 0.2  # how often a job waiting for its stages' room asks again
QUEUED_GRACE_S = 30.0  # a queued job younger than this may still be on its way to the broker
UNACKED_KEY = "unacked"  # where Celery's Redis transport keeps delivered, unacked messages
# A job is started at most this often: a coordinator that dies on it every time (a crash it
# triggers, a machine that keeps going away) does not make it run forever.
MAX_ATTEMPTS = 3
FAILOVER_WAIT_S = 10.0  # the longest a failed round waits to learn which hop died


# (job, its ring, the tokens of cache it needs) -> a callable giving the room back (on the route
# the ring has when it is called), once the job may start; None when it must not start (cancelled
# while waiting, or its lock was lost).
Admit = Callable[[Job, Ring, int], Callable[[], None] | None]


class Codec(Protocol):
    """Text to token ids and back: what the coordinator needs of a tokenizer."""

    def prompt_ids(self, prompt: str, raw: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def run_job(
    session: Session,
    job_id: int,
    make_ring: Callable[[Job], Ring],
    codec: Codec,
    eos_ids: Iterable[int] = (),
    keep_alive: Callable[[], bool] | None = None,
    admit: Admit | None = None,
) -> str | None:
    """Run (or resume) one job to its end and return its status; None when there is no job.

    `keep_alive` is called every round (it refreshes the job's lock); when it returns False
    another coordinator owns the job, and this one stops without touching it further.
    `admit` (see `Admit`) waits, the job still queued, until its stages have room for its
    cache; the room goes back when the job ends, however it ends."""
    eos = set(eos_ids)
    job, outcome = _pending(session, job_id)
    if job is None:
        return outcome
    if job.cancel_requested:
        return _finish(session, job, "cancelled")
    if job.attempts >= MAX_ATTEMPTS:
        reason = f"gave up after {job.attempts} attempts: its coordinator stopped each time"
        return _finish(session, job, "failed", reason)

    # A name of its own per attempt: rounds a dead coordinator left in flight may still reach
    # the stages after this attempt's reset, and must not write into this attempt's caches.
    ring_session = f"job-{job.id}-{secrets.token_hex(4)}"
    ring = None
    release: Callable[[], None] | None = None
    try:
        ring = make_ring(job)
        prompt_ids = job_prompt_ids(codec, job)
        reason = context_error_of(codec, len(prompt_ids), job.max_new_tokens)
        if reason is not None:
            return _finish(session, job, "failed", reason)
        if admit is not None:
            release = admit(job, ring, len(prompt_ids) + job.max_new_tokens)
            if release is None:  # cancelled while it waited, or another coordinator has it
                session.refresh(job, ["cancel_requested", "status"])
                return _finish(session, job, "cancelled") if job.cancel_requested else job.status
        job.status, job.error, job.attempts = "running", None, job.attempts + 1
        job.started_at = job.started_at or utcnow()
        session.commit()
        if job.run is None:
            job.run = _start_run(session, job, ring)
            session.commit()
        job.prompt_tokens = len(prompt_ids)
        params = SamplingParams(
            temp=job.temp,
            top_p=job.top_p,
            top_k=job.top_k,
            seed=job.seed,
            logprobs=job.logprobs,
            sampler=job.sampler,
        )
        stored_logprobs = list(job.output_logprobs or [])[: len(job.output_ids or [])]
        resume = list(job.output_ids or [])
        accepted = list(job.accepted_drafts or [])
        # The time already spent, so tok/s after a resume still counts the whole job.
        spent_s = len(resume) / job.tok_s if resume and job.tok_s else 0.0
        output = GenerationText(codec.decode, eos, job.stop or [])

        generation = Generation(
            ring,
            ring_session,
            prompt_ids,
            params,
            max_new_tokens=job.max_new_tokens,
            draft_k=job.draft_k,  # the most a round sends: each round's K is chosen
            adaptive=True,
            eos_ids=eos,
            resume=resume,  # a re-run continues from what was stored
            should_stop=output.should_stop,
        )
        status, counted = "done", 0
        for _ in generation.rounds():
            accepted.append(generation.stats.accepted - counted)
            counted = generation.stats.accepted
            ids = generation.generated
            text, _ = output.cut(ids)
            logprobs = None
            if job.logprobs is not None:
                logprobs = stored_logprobs + [logprob_entry(lp) for lp in generation.logprobs]
            job.record_progress(ids, text, accepted, spent_s + generation.stats.seconds, logprobs)
            session.commit()
            session.refresh(job, ["cancel_requested"])  # the web app may have asked
            if job.cancel_requested:
                status = "cancelled"
                break
            if keep_alive is not None and not keep_alive():
                log.warning("job %s: lost its lock to another coordinator; stopping", job.id)
                return job.status
        return _finish(session, job, status)
    except (RouteError, RingError, GapError, ValueError) as exc:
        return _finish(session, job, "failed", exc)
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
        return _finish(session, session.get(Job, job_id), "failed", exc)
    finally:
        if ring is not None:
            _drop_quietly(ring, ring_session)
        if release is not None:
            _release_quietly(release)


def context_error_of(codec: Codec, prompt_tokens: int, max_new_tokens: int) -> str | None:
    """Why the job cannot fit the model's context (when the codec is a Target that knows it)."""
    if not isinstance(codec, Target):
        return None
    return context_error(codec, prompt_tokens, max_new_tokens)


def _release_quietly(release: Callable[[], None]) -> None:
    try:
        release()
    except redis.RedisError as exc:  # the room comes back anyway once the job's lock lapses
        log.warning("could not give back a job's KV room: %s", exc)


def job_prompt_ids(codec: Codec, job: Job) -> list[int]:
    """The ids the job's prompt is fed as: its chat's messages through the chat template, its
    prompt as it is (raw), or its prompt as one user message."""
    if job.messages:
        if getattr(codec, "chat_ids", None) is None:
            raise ValueError(f"model {job.model!r} cannot take a chat's messages")
        try:
            return codec.chat_ids(job.messages)
        except Exception as exc:  # a template that refuses the messages: one line on the job
            raise ValueError(f"the chat template refused the messages: {exc}") from None
    if job.raw_prompt:
        return codec.prompt_ids(job.prompt, raw=True)
    return codec.prompt_ids(job.prompt)


def logprob_entry(logprob: TokenLogprob) -> list:
    """A token's log-probabilities as a job stores them: `[logprob, [[id, logprob], ...]]`."""
    return [logprob.logprob, [[i, a] for i, a in logprob.top]]


def _pending(session: Session, job_id: int) -> tuple[Job | None, str | None]:
    """(job, None) while job `job_id` has work left; else (None, what the task returns): None
    for a job that does not exist, the status of a finished one."""
    job = session.get(Job, job_id)
    if job is None:
        log.warning("job %s does not exist", job_id)
        return None, None
    if job.finished:
        return None, job.status
    return job, None


def _start_run(session: Session, job: Job, ring: Ring):
    """A generation run for `job`, its node snapshot cut down to the ring the job runs on."""
    hosts = [hop.host for hop in getattr(ring, "route", ())]
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


def _finish(
    session: Session, job: Job, status: str, error: str | BaseException | None = None
) -> str:
    """End the job with `status`; an error is stored as one redacted line."""
    job.status, job.finished_at = status, utcnow()
    job.error = None if error is None else one_line_reason(error)
    if job.run is not None and job.run.kind == "generation":
        job.run.finished_at = job.finished_at
    session.commit()
    return status


def _rollback_quietly(session: Session) -> None:
    try:
        session.rollback()
    except Exception as exc:  # a connection gone mid-transaction; the next use reconnects
        log.warning("rollback failed: %s", exc)


def _drop_quietly(ring: Ring, session_name: str) -> None:
    try:
        ring.drop(session_name)
    except Exception as exc:  # the job's outcome is stored; a stale cache only costs memory
        log.warning("could not drop %s on the ring: %s", session_name, exc)
    close = getattr(ring, "close", None)
    if close is not None:
        close()


@worker_ready.connect
def open_default_model(**_) -> None:
    """Open the swarm's model (its tokenizer, its layer count) as the coordinator starts, so the
    first job starts at once instead of after the seconds that opening takes."""
    try:
        open_target(default_model())
    except Exception as exc:  # a job on that model fails with the reason; the worker still serves
        log.warning("could not open model %r at start: %s", default_model(), exc)


class CheckedRing:
    """A job's ring, checked against the inventory when a hop goes quiet or answers `gap`.

    Failover: two stages may serve the same layers. While a round waits, the ring's watchdog
    asks `lost_hops` whether a hop of the route has lapsed (stopped heartbeating: killed, cut
    off), left or serves other layers *and* the inventory holds a route around it; then the
    ring is built again without those hosts and the job replays on the spare at once (a
    `GapError` to the generation loop), without waiting for the dead host. A stage that could
    not pass a round on (its next hop's Redis is gone with its host) fails the round at once;
    the ring then waits up to the route's lapse time for the inventory to say which hop died.
    Without a spare nothing changes: the round waits, and a restarted stage answers gap.

    A stage that restarted has lost its caches and answers gap, and the job replays its tokens
    from position 0. If the stage came back serving other layers than the ring's route has it
    for (the model was split again), replaying on the same route would run those layers on the
    wrong hidden states: the route on the wire names hosts, not layers, so no stage would notice
    and the job would end with other tokens. So after a gap, when any hop of the route serves
    other layers now, the ring is built again from the inventory before the replay: the job
    re-routes, or fails with a RouteError naming the layers no online stage serves.

    `on_reroute`, when set, is called with the new route each time the ring is built again, before
    the replay: the job's KV room follows the route (`room_keeper`)."""

    def __init__(
        self,
        build: Callable[..., Ring],
        layers_now: Callable[[], dict[str, tuple[int, int]]],
        lost_hops: Callable[[tuple], list[str]] | None = None,
    ) -> None:
        # `build()` makes the ring; `build(avoid=hosts)` one around those hosts (failover).
        self.build, self.layers_now, self.lost_hops = build, layers_now, lost_hops
        self.ring = self._watched(build())
        self.rebuilt = 0
        self.failovers = 0
        self.on_reroute: Callable[[tuple], None] | None = None

    @property
    def route(self) -> tuple:
        return tuple(getattr(self.ring, "route", ()))

    def reset(self, session: str, params: SamplingParams) -> None:
        self.ring.reset(session, params)

    def reseed(self, session: str, params: SamplingParams) -> None:
        self.ring.reseed(session, params)

    def round(
        self, session: str, tokens, start_pos: int, n_draft: int, head_k: int = 0
    ) -> list[int]:
        try:
            return self.ring.round(session, tokens, start_pos, n_draft, head_k)
        except HopLostError as exc:
            self._fail_over(session, self._lost() or [], str(exc))
            raise GapError(f"re-routed around a lost stage: {exc}") from None
        except GapError:
            if self._route_changed():
                old, self.ring = self.ring, None
                _drop_quietly(old, session)
                self.ring = self._watched(self.build())  # RouteError: the model is not covered
                self.rebuilt += 1
                self._rerouted()
                hosts = " -> ".join(hop.host for hop in self.route)
                log.warning(
                    "session %s: a stage serves other layers now; new ring %s", session, hosts
                )
            raise
        except RingError as exc:
            lost = self._await_lost()
            if not lost:
                raise
            self._fail_over(session, lost, str(exc))
            raise GapError(f"re-routed around a lost stage: {exc}") from None

    def drop(self, session: str) -> None:
        if self.ring is not None:
            self.ring.drop(session)

    def close(self) -> None:
        close = getattr(self.ring, "close", None)
        if close is not None:
            close()

    def _watched(self, ring: Ring) -> Ring:
        """`ring`, whose late rounds ask whether a hop of its route is lost (where it can)."""
        if self.lost_hops is not None and hasattr(ring, "watchdog"):
            ring.watchdog = self._lost_reason
        return ring

    def _lost(self) -> list[str]:
        """The hosts of the route that are gone while a route around them exists."""
        if self.lost_hops is None:
            return []
        try:
            return self.lost_hops(self.route)
        except (redis.RedisError, RouteError) as exc:  # cannot tell: keep waiting
            log.warning("cannot check the route's stages: %s", exc)
            return []

    def _lost_reason(self) -> str | None:
        lost = self._lost()
        return f"{', '.join(lost)} stopped heartbeating" if lost else None

    def _await_lost(self) -> list[str]:
        """The lost hosts of the route, waiting for as long as a dead hop takes to lapse."""
        lapse_s = max((getattr(hop, "lapse_s", lambda: 0.0)() for hop in self.route), default=0.0)
        give_up_at = time.monotonic() + min(lapse_s, FAILOVER_WAIT_S)
        while True:
            lost = self._lost()
            if lost or time.monotonic() >= give_up_at:
                return lost
            time.sleep(0.25)

    def _fail_over(self, session: str, lost: list[str], why: str) -> None:
        """Build the ring again around the `lost` hosts; the caller replays on it."""
        old, self.ring = self.ring, None
        try:
            old.drop(session, skip=lost)  # the lost hosts' Redis may be gone with them
        except Exception as exc:  # only costs the survivors some memory until they idle out
            log.warning("could not drop %s on the old ring: %s", session, exc)
        close = getattr(old, "close", None)
        if close is not None:
            close()
        self.ring = self._watched(self.build(avoid=frozenset(lost)))
        self.failovers += 1
        self._rerouted()
        hosts = " -> ".join(hop.host for hop in self.route)
        log.warning(
            "session %s: %s lost (%s); failed over to %s",
            session,
            ", ".join(lost),
            one_line_reason(why),
            hosts,
        )

    def _rerouted(self) -> None:
        if self.on_reroute is not None:
            self.on_reroute(self.route)

    def _route_changed(self) -> bool:
        try:
            layers = self.layers_now()
        except redis.RedisError as exc:  # cannot tell: replay on the ring as it is
            log.warning("cannot read the inventory after a gap: %s", exc)
            return False
        return any(
            layers.get(hop.host) != (hop.layer_start, hop.layer_end)
            for hop in self.route
            if hasattr(hop, "layer_start")
        )


def served_layers(settings: Settings) -> dict[str, tuple[int, int]]:
    """Each stage host's layer range as the swarm's inventory has it now."""
    return {n.host: (n.layer_start, n.layer_end) for n in _inventory_now(settings)}


def lost_with_spare(settings: Settings, model: str, n_layers: int) -> Callable[[tuple], list[str]]:
    """For a CheckedRing: the hosts of a route that the inventory no longer vouches for
    (`inventory.lost_hops`), when the online stages still cover the model without them; none
    while there is no spare (the job then waits for the stage to come back)."""

    def lost(route: tuple) -> list[str]:
        nodes, now = _inventory_now(settings, timeout_s=2), time.time()
        gone = inventory.lost_hops(route, nodes, now)
        if not gone:
            return []
        try:
            inventory.route(nodes, n_layers, model=model, now=now, avoid=gone)
        except RouteError:
            return []
        return gone

    return lost


def _inventory_now(settings: Settings, timeout_s: float = 5) -> list[inventory.NodeInfo]:
    client = redis.Redis.from_url(
        settings.redis_url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s
    )
    try:
        return inventory.load(client, settings.swarm, settings.accepted_swarm_keys)
    finally:
        client.close()


def lock_key(swarm: str, job_id: int) -> str:
    """The Redis key of a job's lock, held while a coordinator runs it."""
    return f"specpipe:{swarm}:job-lock:{job_id}"


@shared_task(name=GENERATE_TASK, bind=True, base=DbTask, ignore_result=True)
def generate(self, job_id: int) -> str | None:
    """Celery task: run a job over the swarm the inventory describes.

    The delivery of a queued job is a turn rather than that job's own: it runs the queued job
    whose turn it is (`fair_order`), which may be another user's. Every queued job has one
    delivery, and each delivery runs one queued job while any is left, so every job runs once,
    and a user with many jobs waiting does not keep another's single job waiting behind them.
    The delivery of a running job (beat resuming it) runs that job."""
    session: Session = self.session
    job, outcome = _pending(session, job_id)
    if job is None:
        return outcome
    settings = Settings.from_env()
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=5)
    candidates = fair_order(session) if job.status == "queued" else [job_id]
    try:
        chosen = _lock_first(client, settings.swarm, candidates)
    except redis.RedisError as exc:
        client.close()
        where = redact_url(settings.redis_url)
        return _finish(session, job, "failed", f"cannot reach Redis at {where}: {exc}")
    if chosen is None:
        if job.status == "queued":
            log.info("job %s: every queued job is taken; this delivery is done", job_id)
        else:
            log.warning("job %s is already running elsewhere; this delivery is dropped", job_id)
        client.close()
        return "running"
    job_id, keeper = chosen
    try:
        return _run_locked(session, session.get(Job, job_id), settings, keeper)
    finally:
        keeper.stop()
        client.close()


def _lock_first(client: redis.Redis, swarm: str, job_ids: list[int]):
    """(job id, its started LockKeeper) for the first of `job_ids` no coordinator holds."""
    for job_id in job_ids:
        # Not thread-local: the keeper's thread refreshes the token this thread took.
        lock = client.lock(lock_key(swarm, job_id), timeout=stalled_after_s(), thread_local=False)
        keeper = LockKeeper(lock)
        if keeper.start():
            return job_id, keeper
    return None


def _run_locked(session: Session, job: Job, settings: Settings, keeper: LockKeeper) -> str | None:
    """Run `job`, whose lock `keeper` holds, once its stages have room for it."""
    try:
        target = open_target(job.model)
    except ValueError as exc:
        return _finish(session, job, "failed", str(exc))
    except Exception as exc:  # a model that breaks its reader: still one line on the job
        return _finish(session, job, "failed", f"cannot open model {job.model!r}: {exc}")

    def build_ring(avoid: frozenset[str] = frozenset()) -> RedisRing:
        ring = RedisRing.from_inventory(settings, target.name, target.n_layers, avoid=avoid)
        sync_inventory(session, list(ring.route))  # the run's snapshot is the ring as it is now
        return ring

    def make_ring(_job: Job) -> CheckedRing:
        lost = lost_with_spare(settings, target.name, target.n_layers)
        return CheckedRing(build_ring, lambda: served_layers(settings), lost)

    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=5, socket_timeout=5)
    admit = room_keeper(
        session,
        Reservations(client, settings.swarm),
        lock_key(settings.swarm, job.id),
        keeper.owned,
    )
    try:
        return run_job(session, job.id, make_ring, target, target.eos_ids, keeper.owned, admit)
    finally:
        client.close()


def room_keeper(
    session: Session,
    reservations: Reservations,
    holder: str,
    owned: Callable[[], bool],
    poll_s: float = ROOM_POLL_S,
) -> Admit:
    """An `Admit` that reserves a job's cache on its route's stages, waiting while they are
    full (the job stays queued; a cancel request or a lost lock ends the wait). The reservation
    lives while the key `holder` (the job's lock) does. A job that no stage of its route could
    ever hold raises NeverFits, which fails it with the reason. When the ring is a CheckedRing,
    the room follows its route (`Room.follow`, via `on_reroute`) while the job runs."""

    def admit(job: Job, ring: Ring, need: int) -> Callable[[], None] | None:
        route = list(getattr(ring, "route", ()))
        name, attempt = room_name(job.id), secrets.token_hex(4)
        waiting = False
        try:
            while True:
                try:
                    full = reservations.reserve(route, name, need, holder, attempt)
                    if full is None:
                        room = Room(reservations, route, name, need, holder, attempt)
                        if hasattr(ring, "on_reroute"):
                            ring.on_reroute = partial(_follow_quietly, job.id, room)
                        return room.release
                    if not waiting:
                        log.info(
                            "job %s waits for room: stage %s holds %d of %d tokens, it needs %d",
                            job.id,
                            full.host,
                            full.used,
                            full.budget,
                            need,
                        )
                        reservations.mark_waiting(name, holder, full, need)
                        waiting = True
                except redis.RedisError as exc:
                    # Redis restarting: wait it out as a round does; a lock that lapses
                    # meanwhile ends the wait, and the job is resumed from the store.
                    log.warning("job %s: cannot reserve its room yet: %s", job.id, exc)
                session.refresh(job, ["cancel_requested"])
                session.commit()  # no transaction stays open while it waits
                if job.cancel_requested or not owned():
                    return None
                time.sleep(poll_s)
        finally:
            if waiting:
                try:
                    reservations.clear_waiting(name)
                except redis.RedisError:  # the marker lapses with its holder's lock
                    pass

    return admit


def _follow_quietly(job_id: int, room: Room, route: tuple) -> None:
    """Move a running job's room onto its new route, logging the stages that go over their
    budget; a Redis error is logged and the job goes on."""
    try:
        over = room.follow(route)
    except redis.RedisError as exc:  # the job's end gives back the room on both routes
        log.warning("job %s: could not move its KV room onto its new route: %s", job_id, exc)
        return
    for full in over:
        log.warning(
            "job %s: stage %s is over its KV budget: it held %d of %d tokens and now "
            "holds the job's %d too",
            job_id,
            full.host,
            full.used,
            full.budget,
            room.need,
        )


@shared_task(name=RESUME_STALLED_TASK, bind=True, base=DbTask, ignore_result=True)
def resume_stalled(self) -> list[int]:
    """Celery beat task: re-enqueue running jobs whose coordinator stopped making progress, and
    queued jobs whose message the broker no longer holds."""
    settings = Settings.from_env()
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=5)
    try:
        resumed = stalled_jobs(self.session, client, settings.swarm, stalled_after_s())
        resumed += stranded_jobs(self.session, client, COORDINATOR_QUEUE)
    finally:
        client.close()
    for job_id in resumed:
        generate.apply_async(args=[job_id])
    if resumed:
        log.warning("re-enqueued stalled jobs %s", resumed)
    return resumed


def stalled_jobs(session: Session, client: redis.Redis, swarm: str, after_s: float) -> list[int]:
    """Running jobs without progress for `after_s` seconds whose lock has lapsed."""
    cutoff = utcnow() - timedelta(seconds=after_s)
    running = session.scalars(
        select(Job.id).where(Job.status == "running", Job.updated_at < cutoff).order_by(Job.id)
    ).all()
    # A held lock means its coordinator is alive, only slow.
    return [job_id for job_id in running if not client.exists(lock_key(swarm, job_id))]


def stranded_jobs(session: Session, client: redis.Redis, queue: str) -> list[int]:
    """Queued jobs older than `QUEUED_GRACE_S` whose generate message the broker holds nowhere:
    not waiting in `queue`, not taken by a worker (a Redis that lost its data, a publish that
    never arrived). Sending them again is safe: a job runs once whatever its deliveries."""
    cutoff = utcnow() - timedelta(seconds=QUEUED_GRACE_S)
    queued = session.scalars(
        select(Job.id).where(Job.status == "queued", Job.created_at < cutoff).order_by(Job.id)
    ).all()
    if not queued:
        return []
    on_broker = broker_job_ids(client, queue)
    return [job_id for job_id in queued if job_id not in on_broker]


def broker_job_ids(client: redis.Redis, queue: str) -> set[int]:
    """The job ids of the generate messages waiting in `queue` or delivered and not yet
    acknowledged, as Celery's Redis transport keeps them (a list per queue, a hash `unacked`)."""
    raw = [json.loads(m) for m in client.lrange(queue, 0, -1)]
    raw += [json.loads(m)[0] for m in client.hvals(UNACKED_KEY)]
    ids = set()
    for message in raw:
        try:
            if message["headers"]["task"] != GENERATE_TASK:
                continue
            args = json.loads(base64.b64decode(message["body"]))[0]
            ids.add(int(args[0]))
        except (KeyError, IndexError, TypeError, ValueError):
            continue  # not a message of ours
    return ids
