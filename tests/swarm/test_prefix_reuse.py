"""Prefix reuse as the coordinator does it (real Redis): whose kept prefixes a job finds under
each SPECPIPE_PREFIX_REUSE mode, and a request's choices waiting on one prefill."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import redis

from specpipe.settings import prefix_reuse
from specpipe.swarm.prefix_directory import BLOCK_TOKENS, PrefixDirectory
from tests.waiting import wait_until
from workers.prefix_reuse import PrefixReuse

ROUTE = ["a", "b"]
TOKENS = list(range(4 * BLOCK_TOKENS + 3))


class Hop:
    def __init__(self, host):
        self.host = host


class RecordingRing:
    """A ring that records what it was told to keep."""

    def __init__(self):
        self.route, self.drops, self.kept = [Hop(h) for h in ROUTE], [], []

    def drop(self, session, keep=None):
        self.drops.append((session, keep))

    def keep(self, session, prefix):
        self.kept.append((session, prefix))


def job(user_id: int, job_id: int = 1):
    return SimpleNamespace(id=job_id, user_id=user_id)


@pytest.fixture
def directory(redis_url, swarm):
    client = redis.Redis.from_url(redis_url)
    yield PrefixDirectory(client, swarm)
    client.close()


@pytest.mark.parametrize(
    ("mode", "own", "other"), [("user", True, False), ("shared", True, True), ("off", False, False)]
)
def test_whose_kept_prefixes_a_job_finds_in_each_mode(directory, monkeypatch, mode, own, other):
    monkeypatch.setenv("SPECPIPE_PREFIX_REUSE", mode)
    reuse = PrefixReuse(directory, prefix_reuse())
    ring = RecordingRing()
    assert reuse.keep(job(1), ring, "s1", TOKENS, len(TOKENS) - 1) == own  # ended, kept
    assert bool(ring.drops) == own
    mine, _ = reuse.start(job(1, 2), TOKENS, ROUTE)
    theirs, _ = reuse.start(job(2, 3), TOKENS, ROUTE)
    assert (mine is not None, theirs is not None) == (own, other)
    assert reuse.keeper(job(2, 3), TOKENS) == (ROUTE if other else [])


def test_a_mode_that_is_none_of_them_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("SPECPIPE_PREFIX_REUSE", "everyone")
    with pytest.raises(ValueError, match="must be user, shared or off, got 'everyone'"):
        prefix_reuse()


def test_a_requests_choices_wait_for_one_prefill_and_start_from_it(directory):
    reuse = PrefixReuse(directory, "user")
    first, ring = job(1, 1), RecordingRing()
    start, prefilling = reuse.start(first, TOKENS, ROUTE)
    assert start is None and prefilling is not None  # it prefills, for itself and the others
    waited = {}

    def second():
        waited["start"] = reuse.start(job(1, 2), TOKENS, ROUTE)

    thread = threading.Thread(target=second)
    thread.start()
    wait_until(lambda: directory.client.get(prefilling.waiting) == b"1", 5, "the second to wait")
    assert thread.is_alive()  # it waits for the first one's prefill
    reuse.shared(first, prefilling, ring, "s1", TOKENS, len(TOKENS) - 1)
    thread.join(5)
    ((session, kept),) = ring.kept
    assert session == "s1" and ring.drops == []  # kept while the first one goes on
    assert waited["start"][0].name == kept.name and waited["start"][1] is None
    assert waited["start"][0].length == 4 * BLOCK_TOKENS
    # Another user's identical job neither waits on it nor finds it.
    assert reuse.start(job(2, 3), TOKENS, ROUTE)[0] is None
