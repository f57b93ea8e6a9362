"""The Celery queue and task names, and the nightly's keys, in one place.

The workers register their tasks under these names, `celery_config` routes and schedules by
them, and the clients (the web app, the CLI) send tasks by name without importing task code.
"""

import re
import uuid
from datetime import date

COORDINATOR_QUEUE = "coordinator"
# The nightly regression's own lane: its own queue and worker, so it neither waits behind a
# queue of user jobs nor takes one of their sessions.
NIGHTLY_QUEUE = "nightly"

GENERATE_TASK = "workers.coordinator.generate"
RESUME_STALLED_TASK = "workers.coordinator.resume_stalled"
NIGHTLY_TASK = "workers.regression.nightly"
SYNC_NODES_TASK = "workers.nodes.sync"

# The key a nightly run answers (`Run.night`): beat's nights are their date in the swarm's time
# zone, `specpipe regression run` sends a fresh manual key.
NIGHT_KEY = re.compile(r"night-[0-9]{4}-[0-9]{2}-[0-9]{2}")
MANUAL_KEY = re.compile(r"manual-[0-9a-f]{12}")


def night_key(day: date) -> str:
    """The key of the night dated `day`."""
    return f"night-{day.isoformat()}"


def manual_key() -> str:
    """A fresh key for one run asked for by hand."""
    return f"manual-{uuid.uuid4().hex[:12]}"
