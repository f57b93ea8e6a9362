"""Giving freed heap memory back to the system.

glibc keeps what a process frees for its own later use, and with several threads allocating
(torch's) it often grows the heap rather than reuse it: generating the draft head's training
data kept about 100 KB per generated token of caches long dropped, 12 GB for 112 k tokens, until
trimmed. `malloc_trim` returns it; it costs tens of milliseconds after much was freed, under a
millisecond otherwise.
"""

from __future__ import annotations

import ctypes


def trim() -> None:
    """Return the heap's free memory to the system (glibc; elsewhere nothing happens)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class Trimmer:
    """Trims the heap after memory was freed, at most once every `every_s` seconds: a serving
    loop marks each time it frees a session's caches and calls `due` as it goes."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._freed = False
        self._next = 0.0

    def freed(self) -> None:
        """Memory worth giving back was freed."""
        self._freed = True

    def due(self, now: float) -> None:
        """Trim if something was freed and the last trim is `every_s` old."""
        if self._freed and now >= self._next:
            trim()
            self._freed, self._next = False, now + self.every_s
