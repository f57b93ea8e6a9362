"""KV admission: a job starts once every stage of its route has room for its cache, and the
room follows the route while the job runs.

The room is reserved in Redis (`specpipe/swarm/kvbudget.py`) for as long as the job's lock
lives, so the room of a coordinator that died comes back with its lock's lapse.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from functools import partial

import redis
from sqlalchemy.orm import Session

from models import Job
from specpipe.core.ring import Hop, ReroutingRing
from specpipe.swarm.kvbudget import Reservations, Room, room_name

log = logging.getLogger("specpipe.coordinator")

ROOM_POLL_S = 0.2  # how often a job waiting for its stages' room asks again

# (job, its ring, the tokens of cache it needs) -> a callable giving the room back (on the route
# the ring has when it is called), once the job may start; None when it must not start (cancelled
# while waiting, or its lock was lost).
Admit = Callable[[Job, ReroutingRing, int], Callable[[], None] | None]


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
    ever hold raises NeverFits, which fails it with the reason. The room follows the ring's
    route (`Room.follow`, via `on_reroute`) while the job runs."""

    def admit(job: Job, ring: ReroutingRing, need: int) -> Callable[[], None] | None:
        route = list(ring.route)
        name, attempt = room_name(job.id), secrets.token_hex(4)
        waiting = False
        try:
            while True:
                try:
                    full = reservations.reserve(route, name, need, holder, attempt)
                    if full is None:
                        room = Room(reservations, route, name, need, holder, attempt)
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


def release_quietly(release: Callable[[], None]) -> None:
    """Give back a job's room; a Redis error is logged (the room lapses with the job's lock)."""
    try:
        release()
    except redis.RedisError as exc:  # the room comes back anyway once the job's lock lapses
        log.warning("could not give back a job's KV room: %s", exc)


def _follow_quietly(job_id: int, room: Room, route: Sequence[Hop]) -> None:
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
