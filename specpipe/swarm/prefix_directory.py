"""Which kept prefix a prompt can start from: the coordinators' directory, on the registry, of
the prefixes the stages keep (`specpipe.swarm.stage.prefixes`).

A prompt's tokens are cut into blocks of `BLOCK_TOKENS`. Each full block is named by a hash of
its namespace, every token before it and its own (a chain, as vLLM names the blocks of its
prefix cache), so two equal names mean the same tokens from position 0 on. When a job ends, its
stages keep its cache under a fresh name, and the directory records, for each full block of
what they keep, that name, the positions up to the block's end and the route that keeps it
(`specpipe:{swarm}:prefix:{hash}`, living as long as a stage keeps an unused prefix). A new
job looks its prompt's block hashes up: its ring prefers the hosts keeping the longest match
(`keeper`), and it starts from the longest one its route keeps (`longest`).

A namespace is a user's own by default: a cache shared between users lets one time another's
prompts (a known side channel), so a user's prompt matches only that user's earlier jobs. An
operator may share one namespace among all users (`SPECPIPE_SHARED_PREFIXES`), which lets a
long system prompt be prefilled once for everybody.

The directory may be out of date (a stage restarted, forgot a prefix for room): a job that
starts from a prefix a stage no longer holds gets a gap at its first round and prefills in
full, so a wrong entry costs time, never tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
from collections.abc import Sequence

import redis

from specpipe.core.ring import Prefix, Ring

log = logging.getLogger("specpipe.prefixes")

BLOCK_TOKENS = 16  # the tokens a prefix is matched in: a match ends on a block's last token
KEEP_S = 1800  # how long an entry lives: as long as a stage keeps a prefix nobody uses


def block_hashes(namespace: str, tokens: Sequence[int]) -> list[str]:
    """The name of each full block of `tokens`, a chain from the namespace on."""
    names, digest = [], hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    for end in range(BLOCK_TOKENS, len(tokens) + 1, BLOCK_TOKENS):
        block = b"".join(int(t).to_bytes(4, "little") for t in tokens[end - BLOCK_TOKENS : end])
        digest = hashlib.blake2b(digest + block, digest_size=16).digest()
        names.append(digest.hex())
    return names


def new_name() -> str:
    """A fresh name for a prefix the stages are to keep."""
    return "prefix-" + secrets.token_hex(8)


class PrefixDirectory:
    """The swarm's directory of kept prefixes, on its registry."""

    def __init__(self, client: redis.Redis, swarm: str, keep_s: int = KEEP_S) -> None:
        self.client, self.swarm, self.keep_s = client, swarm, keep_s

    def _key(self, block: str) -> str:
        return f"specpipe:{self.swarm}:prefix:{block}"

    def record(
        self, namespace: str, tokens: Sequence[int], kept: Prefix, route: Sequence[str]
    ) -> None:
        """`route`'s stages (their hosts, in ring order) keep `tokens`' first `kept.length`
        positions as `kept.name`: each full block of them now names it."""
        blocks = block_hashes(namespace, tokens[: kept.length])
        pipe = self.client.pipeline(transaction=False)
        for i, block in enumerate(blocks):
            entry = {"name": kept.name, "length": (i + 1) * BLOCK_TOKENS, "route": list(route)}
            pipe.set(self._key(block), json.dumps(entry), ex=self.keep_s)
        pipe.execute()

    def keep(
        self, ring: Ring, session: str, namespace: str, tokens: Sequence[int], length: int
    ) -> Prefix:
        """End `session` on `ring`, its stages keeping its first `length` positions (of
        `tokens`) under a fresh name, and record them in `namespace`. A drop that fails raises
        (the session was not ended); a record that fails is only logged: the stages keep a
        prefix nobody finds, which costs later jobs their prefill, never their tokens."""
        kept = Prefix(new_name(), length)
        ring.drop(session, keep=kept)
        try:
            self.record(namespace, tokens, kept, [hop.host for hop in ring.route])
        except redis.RedisError as exc:
            log.warning("%s: could not record its kept prefix (%s)", session, exc)
        return kept

    def longest(self, namespace: str, tokens: Sequence[int], route: Sequence[str]) -> Prefix | None:
        """The longest kept prefix of `tokens` (short of their last, which a round must send)
        that `route` keeps; None when there is none."""
        for prefix, keeping in self._kept(namespace, tokens):
            if keeping == list(route):
                return prefix
        return None

    def keeper(self, namespace: str, tokens: Sequence[int]) -> list[str]:
        """The route (its hosts, in ring order) that keeps the longest kept prefix of `tokens`,
        on whichever route; [] when none is kept."""
        for _, keeping in self._kept(namespace, tokens):
            return keeping
        return []

    def _kept(self, namespace: str, tokens: Sequence[int]) -> list[tuple[Prefix, list]]:
        """Every kept prefix of `tokens` short of their last, with the route keeping it,
        longest first."""
        blocks = block_hashes(namespace, tokens[: len(tokens) - 1])
        if not blocks:
            return []
        found = self.client.mget([self._key(b) for b in blocks])
        return [entry for entry in map(_entry, reversed(found)) if entry is not None]


def _entry(raw: bytes | None) -> tuple[Prefix, list] | None:
    """A directory entry as read (the prefix, the route keeping it), None when there is none
    or it is not one."""
    if raw is None:
        return None
    try:
        entry = json.loads(raw)
        return Prefix(str(entry["name"]), int(entry["length"])), list(entry["route"])
    except (ValueError, KeyError, TypeError):
        return None
