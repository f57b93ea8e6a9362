"""Celery settings: broker, serialisation, queues and routes, and the beat schedule.

Read by the workers' Celery app and by the web app's client. The broker URL is not set here:
each entry point takes it from `specpipe.settings` (REDIS_URL, or the Redis `specpipe up`
started).
"""

from celery.schedules import crontab

from specpipe.settings import nightly_schedule, swarm_timezone
from workers.names import (
    COORDINATOR_QUEUE,
    GENERATE_TASK,
    NIGHTLY_QUEUE,
    NIGHTLY_TASK,
    RESUME_STALLED_TASK,
    SYNC_NODES_TASK,
)

# JSON only: a message is data, never code (no pickle anywhere).
task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]

broker_connection_retry_on_startup = True
task_ignore_result = True
# The nightly's crontab is read in the swarm's time zone, the one its night keys are dated in.
timezone = swarm_timezone().key

# One job at a time per coordinator process; a job whose worker dies is taken up again.
worker_prefetch_multiplier = 1
task_acks_late = True
task_reject_on_worker_lost = True
# Celery's consumer, but one that survives its broker Redis dying while jobs run.
worker_consumer = "workers.consumer:Consumer"

task_default_queue = COORDINATOR_QUEUE
task_routes = {
    **{
        name: {"queue": COORDINATOR_QUEUE}
        for name in (GENERATE_TASK, RESUME_STALLED_TASK, SYNC_NODES_TASK)
    },
    NIGHTLY_TASK: {"queue": NIGHTLY_QUEUE},
}

_minute, _hour = nightly_schedule()
beat_schedule = {
    "nightly-lossless-regression": {
        "task": NIGHTLY_TASK,
        "schedule": crontab(minute=_minute, hour=_hour),
    },
    # A coordinator whose threads are all busy with jobs: checks it could not run in time are
    # dropped rather than piling up behind the jobs.
    "resume-stalled-jobs": {
        "task": RESUME_STALLED_TASK,
        "schedule": 5.0,
        "options": {"expires": 4.5},
    },
    "sync-node-inventory": {
        "task": SYNC_NODES_TASK,
        "schedule": 10.0,
        "options": {"expires": 9.0},
    },
}
