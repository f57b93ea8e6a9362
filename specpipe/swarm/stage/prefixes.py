"""The prefixes a stage keeps of its sessions, for later sessions whose tokens start with the
same ones (a conversation's next turn, a shared system prompt, the other choices of a request).

A `drop` that names a prefix keeps the session's first `start_pos` positions under that name as
the session ends, a `keep` while it goes on (its prefill done, for jobs waiting on it); a
`reset` that names one starts the new session from a copy of its first `start_pos` positions.
Which names to use, and which prompt matches which prefix, is the coordinator's to know
(`specpipe.swarm.prefix_directory`): a stage only keeps and copies. A stage keeps at most
`SPECPIPE_KEPT_PREFIXES` of them (16), so what it holds levels off under any load; they count
against the KV budget like live sessions, but yield first: while the caches hold more than the
budget, or there are more prefixes than that, the least recently used is forgotten, with no
idle wait; and one unused for `keep_s` is forgotten anyway. A prefix forgotten, or never kept
here (a restart, a spare that took over), costs the session only its prefill: the reset starts
it empty, its first round gets a gap, and the coordinator replays from position 0.
"""

from __future__ import annotations

import logging

from specpipe.core.ring import PrefixStage, Stage
from specpipe.settings import kept_prefixes
from specpipe.swarm import wire
from specpipe.swarm.stage.activity import Activity
from specpipe.swarm.stage.counters import StageStats

log = logging.getLogger("specpipe.stage")


class KeptPrefixes:
    """One stage's kept prefixes: kept and used as messages say, forgotten as they age or the
    budget needs their room."""

    def __init__(self, stage: Stage, stats: StageStats, keep_s: float) -> None:
        self.stage = stage if isinstance(stage, PrefixStage) else None
        self.stats = stats
        self.keep_s = keep_s
        self.most = kept_prefixes()  # prefixes kept at once
        self.used = Activity()  # when each kept prefix was kept or last started from

    def keep(self, message: wire.Message) -> None:
        """The keep or drop `message` names a prefix: keep the session's first `start_pos`
        positions under it."""
        if self.stage is None or not message.prefix:
            return
        if self.stage.keep_prefix(message.session, message.prefix, message.start_pos):
            self.used.touch(message.prefix)
        self._forget(self._least_used(len(self.stage.kept_tokens()) - self.most))
        self._publish()

    def start(self, message: wire.Message) -> None:
        """The reset `message` names a prefix: start the session from it, if it is held here."""
        if self.stage is None:
            return
        if self.stage.start_from_prefix(message.session, message.prefix, message.start_pos):
            self.used.touch(message.prefix)
            self.stats.count("prefix_hits")
        else:
            self.stats.count("prefix_misses")

    def within(self, budget_tokens: int, now: float | None = None) -> list[str]:
        """Forget the prefixes unused for `keep_s`, then, while live sessions and kept prefixes
        together hold more than `budget_tokens` (0: no budget), the least recently used; return
        their names."""
        if self.stage is None:
            return []
        unused = self.used.idle(self.keep_s, now)
        self._forget(unused)
        kept = self.stage.kept_tokens()
        over = sum(self.stage.held_tokens().values()) + sum(kept.values()) - budget_tokens
        for_room = []
        for name in self._least_used(len(kept)) if budget_tokens else ():
            if over <= 0:
                break
            for_room.append(name)
            over -= kept[name]
        self._forget(for_room)
        return unused + for_room

    def _least_used(self, n: int) -> list[str]:
        """The `n` kept prefixes used longest ago (none for n <= 0)."""
        kept = self.stage.kept_tokens()
        ranked = sorted(kept, key=lambda name: self.used.last_used.get(name, 0.0))
        return ranked[: max(n, 0)]

    def _forget(self, names: list[str]) -> None:
        for name in names:
            self.stage.forget_prefix(name)
            self.used.forget(name)
        if names:
            log.info("%s: forgot %d kept prefix(es)", self.stats.host, len(names))
            self._publish()

    def _publish(self) -> None:
        """What the kept prefixes hold now, for `specpipe nodes` and the metrics."""
        kept = self.stage.kept_tokens() if self.stage is not None else {}
        self.stats.set_gauges({"kept_prefixes": len(kept), "kept_tokens": sum(kept.values())})
