"""Stop strings: where a generation's text ends, and what may be shown while it streams.

A generation stops as soon as its decoded text contains one of its stop strings; the text is
cut just before the earliest occurrence, which is not included (the OpenAI convention). The
token ids are not cut: a round commits several tokens at once, and the stop is noticed only
once the round's tokens are decoded.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 64


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """`text` cut just before the earliest stop string in it, and whether it holds one."""
    found = [at for at in (text.find(stop) for stop in stops if stop) if at >= 0]
    if not found:
        return text, False
    return text[: min(found)], True


def hold_back_stop_prefix(text: str, stops: Sequence[str]) -> str:
    """`text` without its longest ending that could be the start of a stop string.

    While a generation streams, that ending is not shown yet: the next tokens may complete the
    stop string, and the text would then be cut before it."""
    held = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:length]):
                held = length
                break
    return text[: len(text) - held]


def check_stop_strings(stops: Sequence[object]) -> list[str]:
    """The stop strings as a list, or ValueError saying what is wrong with them."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"must be at most {MAX_STOP_STRINGS} strings, not {len(stops)}")
    for stop in stops:
        if not isinstance(stop, str):
            raise ValueError("must be text or a list of text")
        if not stop:
            raise ValueError("must not contain an empty string")
        if len(stop) > MAX_STOP_CHARS:
            raise ValueError(f"must each be at most {MAX_STOP_CHARS} characters")
        if "\x00" in stop:
            raise ValueError("must not contain NUL characters")
        try:
            stop.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must be valid UTF-8") from None
    return list(stops)
