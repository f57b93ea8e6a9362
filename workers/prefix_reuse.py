"""Prefix reuse for jobs: a job starts from the cache an earlier job kept on its route when its
tokens start with that job's (a conversation's next turn), and keeps its own when it ends.

Whose caches a job may start from is `SPECPIPE_PREFIX_REUSE` (`settings.prefix_reuse`): by
default its user's own jobs', each user a namespace of their own. The stages keep what a job
leaves under a fresh name, and the directory on the registry (`swarm.prefix_directory`) says
which block of which prompt that name holds. Reuse changes the time to the first token, never
the tokens: the kept cache is bit for bit the prefill's, and a stage that no longer holds it
answers the first round with a gap, after which the job prefills in full.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import redis

from models import Job
from specpipe.core.ring import Prefix, Ring
from specpipe.swarm.prefix_directory import BLOCK_TOKENS, Prefilling, PrefixDirectory

log = logging.getLogger("specpipe.coordinator")


class PrefixReuse:
    """Where jobs' kept prefixes are looked up and recorded, in whose namespace."""

    def __init__(self, directory: PrefixDirectory, mode: str) -> None:
        self.directory, self.mode = directory, mode

    def namespace(self, job: Job) -> str:
        """The job user's own namespace, or everyone's when prefixes are shared."""
        return "shared" if self.mode == "shared" else f"user:{job.user_id}"

    def keeper(self, job: Job, tokens: Sequence[int]) -> list[str]:
        """The hosts keeping the longest kept prefix of the job's `tokens` (its ring prefers
        them), [] when none does or the directory cannot be read."""
        if self.mode == "off":
            return []
        try:
            return self.directory.keeper(self.namespace(job), tokens)
        except redis.RedisError as exc:
            log.warning("job %s: the prefix directory did not answer (%s); no reuse", job.id, exc)
            return []

    def start(
        self, job: Job, tokens: Sequence[int], route: Sequence[str]
    ) -> tuple[Prefix | None, Prefilling | None]:
        """The kept prefix the job's `tokens` may start from on `route`, if any, and the claim
        on prefilling them when this job prefills them for others (`shared` once it has).

        When another job is prefilling the same tokens (another choice of the same request),
        this one waits for it, then starts from what it kept. A directory that cannot be read
        means no reuse, not a failed job."""
        if self.mode == "off" or not route:
            return None, None
        namespace = self.namespace(job)
        try:
            found = self.directory.longest(namespace, tokens, route)
            prefilling = self.directory.prefilling(namespace, tokens)
            whole = BLOCK_TOKENS * ((len(tokens) - 1) // BLOCK_TOKENS)  # the most a prefix gives
            if prefilling is None or (found is not None and found.length >= whole):
                return found, None
            if prefilling.claim():
                return found, prefilling
            prefilling.wait()
            return self.directory.longest(namespace, tokens, route), None
        except redis.RedisError as exc:
            log.warning("job %s: the prefix directory did not answer (%s); no reuse", job.id, exc)
            return None, None

    def shared(
        self,
        job: Job,
        prefilling: Prefilling,
        ring: Ring,
        session: str,
        tokens: Sequence[int],
        length: int,
    ) -> None:
        """The job's prefill is done: its stages keep a copy of its first `length` positions
        for the jobs waiting on it, if any; then they go on."""
        namespace = self.namespace(job)
        try:
            prefilling.end(lambda: self.directory.share(ring, session, namespace, tokens, length))
        except Exception as exc:  # the waiting jobs prefill themselves: slower, not different
            log.warning("job %s: could not share its prefill: %s", job.id, exc)
            let_go_quietly(prefilling)

    def keep(self, job: Job, ring: Ring, session: str, tokens: Sequence[int], length: int) -> bool:
        """End the job's `session` on `ring`, its stages keeping the first `length` positions
        of `tokens`, and record them: whether the session was ended. Not when reuse is off or
        nothing is cached, nor when the drop failed (logged: a cache not kept costs a later
        job its prefill only)."""
        if self.mode == "off" or length <= 0:
            return False
        try:
            self.directory.keep(ring, session, self.namespace(job), tokens, length)
        except Exception as exc:  # whatever the ring raised, the job's tokens are stored
            log.warning("job %s: could not keep its cache: %s", job.id, exc)
            return False
        return True


def let_go_quietly(prefilling: Prefilling) -> None:
    """Let a claim on a prefill go; one that cannot be let go lapses by itself."""
    try:
        prefilling.release()
    except redis.RedisError as exc:
        log.warning("could not let a prefill's claim go (%s); it lapses", exc)
