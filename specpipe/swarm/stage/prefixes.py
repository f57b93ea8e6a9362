"""The prefixes a stage keeps after their sessions end, for later sessions whose tokens start
with the same ones (a conversation's next turn, a shared system prompt).

A `drop` that names a prefix keeps the session's first `start_pos` positions under that name; a
`reset` that names one starts the new session from a copy of its first `start_pos` positions.
Which names to use, and which prompt matches which prefix, is the coordinator's to know
(`specpipe.swarm.prefix_directory`): a stage only keeps and copies. Kept prefixes count against
the KV budget like live sessions, but yield first: while the caches hold more than the budget,
the least recently used prefix is forgotten, with no idle wait; and one unused for `keep_s` is
forgotten anyway. A prefix forgotten, or never kept here (a restart, a spare that took over),
costs the session only its prefill: the reset starts it empty, its first round gets a gap, and
the coordinator replays from position 0.
"""

from __future__ import annotations

import logging

from specpipe.core.ring import PrefixStage, Stage
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
        self.used = Activity()  # when each kept prefix was kept or last started from

    def keep(self, message: wire.Message) -> None:
        """The drop `message` names a prefix: keep the session's first `start_pos` positions."""
        if self.stage is None:
            return
        if self.stage.keep_prefix(message.session, message.prefix, message.start_pos):
            self.used.touch(message.prefix)
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
        together hold more than `budget_tokens` (0: no budget), the least recently used."""
        if self.stage is None:
            return []
        forgotten = self.used.idle(self.keep_s, now)
        kept = self.stage.kept_tokens()
        if budget_tokens:
            total = sum(self.stage.held_tokens().values()) + sum(kept.values())
            total -= sum(kept.get(name, 0) for name in forgotten)
            for name in sorted(kept, key=lambda n: self.used.last_used.get(n, 0.0)):
                if total <= budget_tokens:
                    break
                if name not in forgotten:
                    forgotten.append(name)
                    total -= kept[name]
        for name in forgotten:
            self.stage.forget_prefix(name)
            self.used.forget(name)
        if forgotten:
            log.info("%s: forgot %d kept prefix(es)", self.stats.host, len(forgotten))
            self._publish()
        return forgotten

    def _publish(self) -> None:
        """What the kept prefixes hold now, for `specpipe nodes` and the metrics."""
        kept = self.stage.kept_tokens() if self.stage is not None else {}
        self.stats.set_gauges({"kept_prefixes": len(kept), "kept_tokens": sum(kept.values())})
