"""The drafter: n-gram prompt lookup.

It proposes the tokens that followed the most recent earlier occurrence of the context's
longest suffix (n from `max_ngram` down to `min_ngram`). An index from each n-gram to where it
last ended is updated as tokens are committed, so a proposal costs O(max_ngram + K), whatever
the context length. A cheap drafter is enough: the verify rule is lossless for any proposal,
and a wrong guess costs only the slots it occupied in a round.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramDrafter:
    """Prompt-lookup drafting over the committed tokens of one session."""

    # A single matching token predicts the next poorly in open text, and a verify of K wrong
    # drafts still costs (K=8: about 1.25 steps on the CPU); on copied passages 2-grams find the
    # same drafts. So by default a proposal needs a 2-token match.
    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        # n-gram -> index just past its most recent occurrence, excluding the current suffix
        self._last_end: dict[tuple[int, ...], int] = {}

    def extend(self, ids: Iterable[int]) -> None:
        """Append committed tokens."""
        for token in ids:
            end = len(self.tokens)
            # The suffixes ending here become "earlier occurrences" once a token follows them.
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._last_end[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(int(token))

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier match of the current suffix."""
        if k <= 0:
            return []
        end = len(self.tokens)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            start = self._last_end.get(tuple(self.tokens[end - n : end]))
            if start is not None:
                return self._continue_from(start, k)
        return []

    def _continue_from(self, start: int, k: int) -> list[int]:
        """The k tokens after `start`, read as if the sequence repeats with period end - start."""
        period = len(self.tokens) - start
        return [self.tokens[start + i % period] for i in range(k)]
