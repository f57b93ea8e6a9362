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

import redis
from celery import shared_task
from celery.signals import worker_ready
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
    """Celery task: run a job over the swarm the inventory describes.

    The delivery of a queued job is a turn rather than that job's own: it runs the queued job
    whose turn it is (`fair_order`), which may be another user's. Every queued job has one
    delivery, and each delivery runs one queued job while any is left, so every job runs once,
    and a user with many jobs waiting does not keep another's single job waiting behind them.
    The delivery of a running job (beat resuming it) runs that job, or, when another
    coordinator holds it, takes a turn like the others: no delivery is wasted while a job waits."""
    session: Session = self.session
    job, outcome = pending(session, job_id)
    # A running job's own delivery (beat resuming it) runs that job; any other delivery (of a
    # queued job, or of one another delivery's turn already ran) takes the next turn.
    own = [job_id] if job is not None and job.status == "running" else []
    candidates = own + fair_order(session)
    if not candidates:
        return outcome if job is None else job.status
    settings = Settings.from_env()
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=5)
    try:
        chosen = lock_first_through_outage(client, settings.swarm, candidates, REDIS_OUTAGE_S)
    except redis.RedisError as exc:
        # The jobs are left as they are, not failed: beat sends them again once Redis is back
        # (a queued job the broker no longer holds, a running job whose lock lapsed).
        client.close()
        where = redact_url(settings.redis_url)
        log.warning("delivery of job %s: cannot reach Redis at %s (%s)", job_id, where, exc)
        return outcome if job is None else job.status
    if chosen is None:
        # Worth a warning when the job itself is running: two deliveries of one running job.
        say = log.warning if own else log.info
        say("delivery of job %s: every job it could run is taken; it is done", job_id)
        client.close()
        return outcome if job is None else job.status
    job_id, keeper = chosen
    try:
        job, outcome = pending(session, job_id)
        if job is None:
            return outcome
        return job_run.run_on_swarm(session, job, settings, keeper)
    finally:
        keeper.stop()
        client.close()


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
