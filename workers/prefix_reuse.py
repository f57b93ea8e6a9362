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
from specpipe.core.ring import Prefix
from specpipe.swarm.prefix_directory import PrefixDirectory, new_name

log = logging.getLogger("specpipe.coordinator")


class PrefixReuse:
    """Where jobs' kept prefixes are looked up and recorded, in whose namespace."""

    def __init__(self, directory: PrefixDirectory, mode: str) -> None:
        self.directory, self.mode = directory, mode

    def namespace(self, job: Job) -> str:
        """The job user's own namespace, or everyone's when prefixes are shared."""
        return "shared" if self.mode == "shared" else f"user:{job.user_id}"

    def start(self, job: Job, tokens: Sequence[int], route: Sequence[str]) -> Prefix | None:
        """The kept prefix the job's `tokens` may start from on `route`, if any. A directory
        that cannot be read means no reuse, not a failed job."""
        if self.mode == "off" or not route:
            return None
        try:
            return self.directory.longest(self.namespace(job), tokens, route)
        except redis.RedisError as exc:
            log.warning("job %s: the prefix directory did not answer (%s); no reuse", job.id, exc)
            return None

    def keep(self, job: Job, length: int) -> Prefix | None:
        """A fresh prefix for the job's ending session to keep its first `length` positions
        under (its drop carries it), None when nothing is to be kept."""
        if self.mode == "off" or length <= 0:
            return None
        return Prefix(new_name(), length)

    def kept(self, job: Job, tokens: Sequence[int], kept: Prefix, route: Sequence[str]) -> None:
        """The stages of `route` were told to keep `kept` of `tokens`: record it."""
        try:
            self.directory.record(self.namespace(job), tokens, kept, route)
        except redis.RedisError as exc:
            log.warning("job %s: could not record its kept prefix (%s)", job.id, exc)
