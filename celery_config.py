"""Celery settings: broker, queues and routes, and the beat schedule."""
