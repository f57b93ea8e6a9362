"""Stop strings: where a generation's text ends, and what may be shown while it streams.

A generation stops as soon as its decoded text contains one of its stop strings; the text is
cut just before the earliest occurrence, which is not included (the OpenAI convention). The
token ids are not cut: a round commits several tokens at once, and the stop is noticed only
once the round's tokens are decoded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 64


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """`text` cut just before the earliest stop string in it, and whether it holds one."""
    found = [at for at in (text.find(stop) for stop in stops if stop) if at >= 0]
    if not found:
        return text, False
    return text[: min(found)], True


class GenerationText:
    """A generation's text from its token ids: end markers left out, cut before a stop string.

    `Generation` asks after every round whether a stop string has appeared (`should_stop`), and
    the caller then shows or stores the same ids' text: each length of ids is decoded once."""

    def __init__(
        self, decode: Callable[[list[int]], str], eos_ids: Iterable[int], stops: Sequence[str]
    ) -> None:
        self.decode, self.eos_ids, self.stops = decode, set(eos_ids), list(stops)
        self._length, self._cut = -1, ("", False)

    def cut(self, ids: Sequence[int]) -> tuple[str, bool]:
        """The text of `ids`, and whether a stop string ended it."""
        if len(ids) != self._length:  # one generation's ids only grow
            text = self.decode([t for t in ids if t not in self.eos_ids])
            self._length, self._cut = len(ids), cut_at_stop(text, self.stops)
        return self._cut

    @property
    def should_stop(self) -> Callable[[list[int]], bool] | None:
        """The `Generation` hook for these stop strings; None when there are none."""
        return (lambda ids: self.cut(ids)[1]) if self.stops else None


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
