"""The Celery app with the toy target registered: `celery -A tests.regression.celery_toy worker`."""

import tests.regression.toy_target  # noqa: F401  (registers the `toy` target)
from workers.celery_app import celery

__all__ = ["celery"]
