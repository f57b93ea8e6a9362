"""The Celery queue and task names, in one place.

The workers register their tasks under these names, `celery_config` routes and schedules by
them, and the clients (the web app, the CLI) send tasks by name without importing task code.
"""

COORDINATOR_QUEUE = "coordinator"
# The nightly regression's own lane: its own queue and worker, so it neither waits behind a
# queue of user jobs nor takes one of their sessions.
NIGHTLY_QUEUE = "nightly"

GENERATE_TASK = "workers.coordinator.generate"
RESUME_STALLED_TASK = "workers.coordinator.resume_stalled"
NIGHTLY_TASK = "workers.regression.nightly"
SYNC_NODES_TASK = "workers.nodes.sync"
