"""What Redis answers, as plain values."""

from __future__ import annotations


def text(value: bytes | str) -> str:
    """`value` as text: bytes decoded as UTF-8, any byte that does not decode replaced (a key or
    a name another host wrote may hold anything)."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
