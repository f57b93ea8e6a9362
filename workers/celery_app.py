"""The Celery app the coordinator and beat run (`celery -A workers.celery_app …`).

Shaped like Flask's `celery_init_app`, with one difference: workers never import the web app.
The Task base class gives each task run its own database session from `models/` and closes it
after, so a task takes ids and plain values and loads what it needs.
"""

from __future__ import annotations

import threading

from celery import Celery, Task
from sqlalchemy.orm import Session

from models.db import make_session_factory
from specpipe.settings import database_url, redis_url


class DbTask(Task):
    """A task with `self.session`: opened before the run, closed after, whatever happens.

    The coordinator runs several jobs at once on threads, all through one task object: each
    thread's run has a session of its own."""

    abstract = True
    _local = threading.local()

    @property
    def session(self) -> Session | None:
        return getattr(self._local, "session", None)

    def __call__(self, *args, **kwargs):
        self._local.session = make_session_factory(database_url())()
        try:
            return super().__call__(*args, **kwargs)
        finally:
            self._local.session.close()
            self._local.session = None


def make_celery() -> Celery:
    """The app: settings from `celery_config`, the broker from the environment."""
    app = Celery("specpipe", task_cls=DbTask)
    app.config_from_object("celery_config")
    app.conf.broker_url = redis_url()
    app.conf.include = ["workers.coordinator", "workers.node_sync", "workers.regression"]
    return app


celery = make_celery()
