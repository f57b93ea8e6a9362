"""Tests of the nightly regression: real Redis, real stage processes, a real Celery worker."""
