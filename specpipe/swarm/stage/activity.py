"""When each session last had a message here: what forgets an idle session (its coordinator
died, or went away without a drop) and, over the KV budget, the one idle longest."""

from __future__ import annotations

import time
from collections import OrderedDict


class Activity:
    """The monotonic time of each live session's last message."""

    def __init__(self) -> None:
        self.last_used: dict[str, float] = {}

    def touch(self, session: str) -> None:
        """`session` had a message now."""
        self.last_used[session] = time.monotonic()

    def forget(self, session: str) -> None:
        self.last_used.pop(session, None)

    def idle(self, idle_s: float, now: float | None = None) -> list[str]:
        """The sessions without a message for `idle_s` at `now` (default: now)."""
        cutoff = (time.monotonic() if now is None else now) - idle_s
        return [s for s, used in self.last_used.items() if used < cutoff]


def remember(table: OrderedDict, session: str, value, limit: int) -> None:
    """Put `value` for `session` in `table`, which keeps the `limit` sessions put last."""
    table[session] = value
    table.move_to_end(session)
    while len(table) > limit:
        table.popitem(last=False)
