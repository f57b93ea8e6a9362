"""The coordinator's Celery tasks: one job's generation over the swarm, and beat's resume.

`workers.coordinator.generate(job_id)` (queue `coordinator`) takes a per-job Redis lock (a
duplicate delivery never runs a job twice at once, `workers/job_lock.py`) and runs the job
(`workers/job_run.py`): the ring is built from the live node inventory (the stages must cover
every layer exactly once, in order, or the job fails with the layers nobody serves), re-routed
around lost stages (`specpipe/swarm/failover.py`), and the job starts once its stages have room
for its cache (`workers/room.py`). A cancel request stops the job at its next round. The beat
task `workers.coordinator.resume_stalled` re-enqueues running jobs whose coordinator died and
queued jobs the broker lost (`workers/broker.py`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import redis
from celery import shared_task
from celery.signals import worker_ready
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from specpipe.decoding.target import open_target
from specpipe.settings import Settings, default_model, stalled_after_s
from specpipe.swarm.redact import redact_url
from workers import job_run
from workers.broker import stranded_jobs
from workers.celery_app import DbTask
from workers.job_lock import lock_first_through_outage, stalled_jobs
from workers.job_run import pending
from workers.names import COORDINATOR_QUEUE, GENERATE_TASK, RESUME_STALLED_TASK
from workers.turns import fair_order

log = logging.getLogger("specpipe.coordinator")

REDIS_OUTAGE_S = 30.0  # how long a delivery waits for a restarting Redis before leaving its job
STARTS_PER_DELIVERY = 3  # how often a delivery takes one job it could not start…
RESTART_PAUSE_S = 1.0  # …and how long it waits before taking it again


@worker_ready.connect
def open_default_model(**_) -> None:
    """Open the swarm's model (its tokenizer, its layer count) as the coordinator starts, so the
    first job starts at once instead of after the seconds that opening takes."""
    try:
        open_target(default_model())
    except Exception as exc:  # a job on that model fails with the reason; the worker still serves
        log.warning("could not open model %r at start: %s", default_model(), exc)


@shared_task(name=GENERATE_TASK, bind=True, base=DbTask, ignore_result=True)
def generate(self, job_id: int) -> str | None:
    """Celery task: run jobs over the swarm the inventory describes, one after another, until
    no queued job is left that another coordinator does not hold.

    A delivery is a turn rather than its job's own: it runs the queued job whose turn it is
    (`fair_order`), which may be another user's, then the next, so a user with many jobs
    waiting does not keep another's single job waiting behind them. Every queued job has a
    delivery, and a delivery ends only when it finds no queued job it can take, so a queued job
    is never left without one: a delivery whose job another coordinator ran or took over meanwhile
    (a lock that lapsed under load, a duplicate, a job that ended as it was chosen) goes on to
    the next job instead of ending with that job's turn unused, and one that finds every job it
    read taken reads the queue again before it ends (a job queued meanwhile may be the one whose
    delivery took the job this delivery read). The delivery of a running job
    (beat resuming it) runs that job first, or, when another coordinator holds it, takes turns
    like the others.

    A job the delivery took and could not start (the store refused the start's write: locked
    by a busy writer, or away) is still queued with nobody to run it; the delivery tries it
    again after a pause, up to `STARTS_PER_DELIVERY` times, rather than leave it for beat."""
    session: Session = self.session
    job, outcome = pending(session, job_id)
    own = [job_id] if job is not None and job.status == "running" else []
    outcome = outcome if job is None else job.status
    settings = Settings.from_env()
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=5)
    # A job it took is taken again only while it is still queued and free: one it lost is
    # another's (its lock held), one it ran is not queued any more.
    tries: Counter[int] = Counter()
    try:
        while True:
            candidates = [i for i in own + next_turns(session) if tries[i] < STARTS_PER_DELIVERY]
            if not candidates:
                break
            try:
                chosen = lock_first_through_outage(
                    client, settings.swarm, candidates, REDIS_OUTAGE_S
                )
            except redis.RedisError as exc:
                # The jobs are left as they are, not failed: beat sends them again once Redis is
                # back (a queued job the broker no longer holds, a running job whose lock lapsed).
                where = redact_url(settings.redis_url)
                log.warning("delivery of job %s: cannot reach Redis at %s (%s)", job_id, where, exc)
                break
            if chosen is None:
                # Jobs queued since the list was read may have no delivery left: the one of the
                # job that another took, meanwhile, may have taken one of them instead of its own.
                fresh = {i for i in next_turns(session) if tries[i] < STARTS_PER_DELIVERY}
                if fresh - set(candidates):
                    own = []
                    continue
                # Worth a warning when the job itself is running: two deliveries of one running job.
                say = log.warning if own else log.info
                say("delivery of job %s: every job it could run is taken; it is done", job_id)
                break
            chosen_id, keeper = chosen
            if tries[chosen_id]:
                log.warning("job %s: not started by this delivery; trying again", chosen_id)
                time.sleep(RESTART_PAUSE_S)
            tries[chosen_id] += 1
            own = []
            try:
                job, outcome = pending(session, chosen_id)
                if job is not None:
                    outcome = job_run.run_on_swarm(session, job, settings, keeper)
            finally:
                keeper.stop()
    finally:
        client.close()
    return outcome


def next_turns(session: Session) -> list[int]:
    """`fair_order`, or none while the store cannot be read: the queued jobs are left to beat,
    which sends a queued job whose delivery is gone again."""
    try:
        return fair_order(session)
    except OperationalError as exc:
        log.warning("cannot read the queued jobs (%s); beat sends them again", exc)
        session.rollback()
        return []


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
