"""The directory of kept prefixes (real Redis): a prompt finds the longest kept prefix of its own
namespace that its route keeps, matched in whole blocks, never its last token."""

from __future__ import annotations

import redis

from specpipe.core.ring import Prefix
from specpipe.swarm.prefix_directory import BLOCK_TOKENS, PrefixDirectory, block_hashes

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
