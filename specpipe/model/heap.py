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
