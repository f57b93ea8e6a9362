"""The directory of kept prefixes (real Redis): a prompt finds the longest kept prefix of its own
namespace that its route keeps, matched in whole blocks, never its last token."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from specpipe.core.ring import Prefix
from specpipe.swarm.prefix_directory import (
    BLOCK_TOKENS,
    Prefilling,
    PrefixDirectory,
    block_hashes,
)
from tests.waiting import wait_until

ROUTE = ("a", "b")


def directory(redis_url, swarm) -> PrefixDirectory:
    return PrefixDirectory(redis.Redis.from_url(redis_url), swarm)


def test_block_names_chain_every_token_before_them():
    tokens = list(range(3 * BLOCK_TOKENS + 5))
    names = block_hashes("user:1", tokens)
    assert len(names) == 3 and len(set(names)) == 3
    assert block_hashes("user:1", tokens[: 2 * BLOCK_TOKENS]) == names[:2]
    changed = [99, *tokens[1:]]  # one token of the first block: every later name changes
    assert not set(block_hashes("user:1", changed)) & set(names)
    assert not set(block_hashes("user:2", tokens)) & set(names)


def test_a_prompt_starts_from_the_longest_kept_prefix_its_route_keeps(redis_url, swarm):
    found = directory(redis_url, swarm)
    first_turn = list(range(100, 100 + 5 * BLOCK_TOKENS + 3))
    found.record("user:1", first_turn, Prefix("p1", len(first_turn)), ROUTE)
    # The next turn: the first turn, then more.
    next_turn = first_turn + [7] * 40
    assert found.longest("user:1", next_turn, ROUTE) == Prefix("p1", 5 * BLOCK_TOKENS)
    # Diverging in the third block: the first two blocks match.
    diverged = first_turn[: 2 * BLOCK_TOKENS + 3] + [1] * 50
    assert found.longest("user:1", diverged, ROUTE).length == 2 * BLOCK_TOKENS
    # Another user, another route, a prompt shorter than a block past its last token: none.
    assert found.longest("user:2", next_turn, ROUTE) is None
    assert found.longest("user:1", next_turn, ("a", "c")) is None
    assert found.longest("user:1", first_turn[:BLOCK_TOKENS], ROUTE) is None
    # A prompt that is exactly the kept blocks keeps its last token for the round to send.
    exact = first_turn[: 3 * BLOCK_TOKENS]
    assert found.longest("user:1", exact, ROUTE).length == 2 * BLOCK_TOKENS


def test_an_entry_that_is_not_one_is_no_match(redis_url, swarm):
    found = directory(redis_url, swarm)
    tokens = list(range(2 * BLOCK_TOKENS + 1))
    found.record("u", tokens, Prefix("p", len(tokens)), ROUTE)
    found.client.set(found._key(block_hashes("u", tokens)[1]), b"not json")
    assert found.longest("u", tokens, ROUTE).length == BLOCK_TOKENS
    assert 0 < found.client.ttl(found._key(block_hashes("u", tokens)[0])) <= found.keep_s


def test_the_keeper_is_the_route_keeping_the_longest_prefix_on_any_route(redis_url, swarm):
    found = directory(redis_url, swarm)
    tokens = list(range(4 * BLOCK_TOKENS + 1))
    assert found.keeper("u", tokens) == []
    found.record("u", tokens, Prefix("long", 4 * BLOCK_TOKENS), ("c", "b"))
    found.record("u", tokens, Prefix("short", 2 * BLOCK_TOKENS), ("a", "b"))  # its 2 blocks
    assert found.keeper("u", tokens) == ["c", "b"]
    assert found.keeper("u", tokens[: 3 * BLOCK_TOKENS]) == ["a", "b"]
    assert found.keeper("v", tokens) == []  # another namespace keeps nothing


class Hop:
    def __init__(self, host):
        self.host = host


class DroppingRing:
    """A ring that records the drops it is asked for, or fails them."""

    def __init__(self, fail=False):
        self.route, self.fail, self.drops, self.kept = [Hop("a"), Hop("b")], fail, [], []

    def keep(self, session, prefix):
        self.kept.append(prefix)

    def drop(self, session, keep=None):
        if self.fail:
            raise ConnectionError("the tail did not answer")
        self.drops.append((session, keep))


def test_keep_ends_the_session_keeping_its_cache_and_records_it(redis_url, swarm):
    found = directory(redis_url, swarm)
    tokens = list(range(3 * BLOCK_TOKENS))
    ring = DroppingRing()
    kept = found.keep(ring, "s1", "u", tokens, 2 * BLOCK_TOKENS + 5)
    assert ring.drops == [("s1", kept)] and kept.length == 2 * BLOCK_TOKENS + 5
    assert found.longest("u", tokens + [1], ROUTE) == Prefix(kept.name, 2 * BLOCK_TOKENS)


def test_a_failed_drop_records_nothing_and_a_failed_record_ends_the_session(
    redis_url, swarm, caplog
):
    found = directory(redis_url, swarm)
    tokens = list(range(2 * BLOCK_TOKENS + 1))
    with pytest.raises(ConnectionError):
        found.keep(DroppingRing(fail=True), "s1", "u", tokens, len(tokens))
    assert found.keeper("u", tokens) == []
    # The registry gone after the drop: the session ended all the same, the failure logged.
    unreachable = PrefixDirectory(redis.Redis(port=1, socket_connect_timeout=0.2), swarm)
    ring = DroppingRing()
    kept = unreachable.keep(ring, "s2", "u", tokens, len(tokens))
    assert ring.drops == [("s2", kept)]
    assert "could not record its kept prefix" in caplog.text


def test_jobs_with_the_same_tokens_wait_for_the_one_prefilling_them(redis_url, swarm):
    found = directory(redis_url, swarm)
    tokens = list(range(3 * BLOCK_TOKENS + 2))
    assert found.prefilling("u", tokens[:BLOCK_TOKENS]) is None  # no whole block: no claim
    first, second = found.prefilling("u", tokens), found.prefilling("u", tokens)
    assert first.key == second.key != found.prefilling("v", tokens).key
    assert first.claim() and not second.claim()

    ring, shared = DroppingRing(), []
    waited = threading.Event()

    def wait():
        second.wait()
        waited.set()

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_until(lambda: found.client.get(first.waiting) == b"1", 5, "the waiter to count itself")
    assert not waited.is_set()
    first.end(lambda: shared.append(found.share(ring, "s1", "u", tokens, len(tokens) - 1)))
    waiter.join(5)
    assert waited.is_set() and not found.client.exists(first.key, first.waiting)
    # What the waiter finds: the prefix kept while the session went on (no drop).
    assert ring.kept == shared and ring.drops == []
    assert found.longest("u", tokens, ROUTE) == Prefix(shared[0].name, 3 * BLOCK_TOKENS)


def test_a_prefill_nobody_waits_for_is_not_shared_and_a_claim_lapses(redis_url, swarm, monkeypatch):
    found = directory(redis_url, swarm)
    tokens = list(range(2 * BLOCK_TOKENS + 1))
    claim = found.prefilling("u", tokens)
    assert claim.claim()
    claim.end(lambda: pytest.fail("shared with nobody waiting"))
    assert not found.client.exists(claim.key) and claim.claim()  # free again
    # A claim whose job died lapses: a waiter waits no longer than WAIT_S.
    monkeypatch.setattr(Prefilling, "WAIT_S", 0.3)
    later = found.prefilling("u", tokens)
    started = time.monotonic()
    later.wait()
    assert 0.25 <= time.monotonic() - started < 3
