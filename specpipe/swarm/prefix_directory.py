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
import time
from collections.abc import Callable, Sequence

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
        self._record_kept(ring, session, namespace, tokens, kept)
        return kept

    def share(
        self, ring: Ring, session: str, namespace: str, tokens: Sequence[int], length: int
    ) -> Prefix:
        """As `keep`, the session going on: its stages keep a copy of its first `length`
        positions now (its prefill done, for jobs waiting on it: `Prefilling`)."""
        kept = Prefix(new_name(), length)
        ring.keep(session, kept)
        self._record_kept(ring, session, namespace, tokens, kept)
        return kept

    def _record_kept(
        self, ring: Ring, session: str, namespace: str, tokens: Sequence[int], kept: Prefix
    ) -> None:
        try:
            self.record(namespace, tokens, kept, [hop.host for hop in ring.route])
        except redis.RedisError as exc:
            log.warning("%s: could not record its kept prefix (%s)", session, exc)

    def prefilling(self, namespace: str, tokens: Sequence[int]) -> Prefilling | None:
        """The claim on prefilling `tokens`' whole blocks (short of their last token) that jobs
        with the same tokens share; None when they fill no block."""
        blocks = block_hashes(namespace, tokens[: len(tokens) - 1])
        if not blocks:
            return None
        return Prefilling(self.client, f"specpipe:{self.swarm}:prefilling:{blocks[-1]}")

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


class Prefilling:
    """Jobs whose tokens start the same (a request's choices, one prompt sent twice at once)
    prefill them once: the first to `claim` them prefills, and when done (`end`) its stages
    keep a copy (`PrefixDirectory.share`) if anyone `wait`ed; the others wait, then start from
    it. A claim lapses after `WAIT_S` (its job died, or prefills slowly): a job that waited
    that long prefills itself, slower, never different."""

    WAIT_S = 60.0
    POLL_S = 0.05

    def __init__(self, client: redis.Redis, key: str) -> None:
        self.client, self.key, self.waiting = client, key, f"{key}:waiting"

    def claim(self) -> bool:
        """Whether this job prefills the tokens (no other job is prefilling them now)."""
        return bool(self.client.set(self.key, "1", nx=True, px=int(self.WAIT_S * 1000)))

    def wait(self, clock: Callable[[], float] = time.monotonic) -> None:
        """Wait, counted among the waiters, while another job prefills the tokens (its claim
        ends or lapses)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.incr(self.waiting).pexpire(self.waiting, int(self.WAIT_S * 1000)).execute()
        give_up_at = clock() + self.WAIT_S
        while self.client.exists(self.key) and clock() < give_up_at:
            time.sleep(self.POLL_S)

    def end(self, share: Callable[[], object]) -> None:
        """The claimed prefill is done: `share` it when a job waits for it, then let them go."""
        if int(self.client.get(self.waiting) or 0) > 0:
            share()
        self.release()

    def release(self) -> None:
        """Let the claim go (its job ended before its prefill did, or after sharing it)."""
        self.client.delete(self.key, self.waiting)


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
