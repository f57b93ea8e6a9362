"""Celery app and tasks: the coordinator, the stage worker process, the nightly regression."""
