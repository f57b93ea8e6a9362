"""Adaptive draft length: each round's K, per session, from the recent acceptance of the drafts
and the measured cost of a round.

The rule is the one of Leviathan, Kalman and Matias, "Fast Inference from Transformers via
Speculative Decoding" (ICML 2023), sections 3.1 to 3.4. If each draft is accepted with
probability `a` once the ones before it were, a round that sends K drafts commits on average

    E(K) = (1 - a^(K+1)) / (1 - a)

tokens (the accepted drafts and the target's own token). If that round costs
c(K) = c0 + K * cd, with c0 what a round costs without drafts (the ring's hops, one row through
every stage, the reply) and cd what each draft row adds, tokens per second are E(K) / c(K), and
the rule sends the K in 0..K_max that maximises it. K = 0 is plain decoding, E(0) / c(0) = 1 / c0,
so drafts are sent only when they are expected to beat plain decoding (by `MARGIN`): on novel
text, where the drafts miss, a job runs as fast as plain, while on grounded text (a copied
passage, code being edited) K grows up to the job's `draft_k`. Because c0 is the whole ring's
time, a draft is cheap on a slow ring (25 ms per hop: long drafts pay even at modest
acceptance) and dear on a fast, busy one, where K shrinks.

Both sides are measured as the session runs:

- `a`, one for each source of drafts (the n-gram drafter, the tail's draft head: in copied text
  the one is right nine times in ten while the other is right one time in three, and a shared
  estimate would send the head's drafts as long as the n-gram's): every round's proposal of
  K_max drafts is scored against the tokens the round really committed, whatever K was sent.
  With the coupled verify the committed tokens do not depend on the drafts, so the proposal's
  leading matches are exactly the drafts that would have been accepted; a proposal longer than
  what was committed is censored there (successes counted, no failure), which keeps
  successes / (successes + failures) the estimate of `a` under that model. Both counts (and
  the prior's pseudo-counts) decay by `ACCEPT_DECAY` with each scored proposal, so the
  estimate follows the text; rounds without a proposal leave it as it is.
- c0 and cd: a least-squares line through (drafts sent, round seconds) of the recent rounds
  (decaying by `COST_DECAY`), whose slope is pulled toward a prior of `PRIOR_DRAFT_SHARE` of a
  round per draft (a ridge) while the K sent has not varied enough to tell. Rounds that carry
  more than one committed token (the prefill, a replay) are left out.

The choice never changes the output: every committed token is the one plain sampling gives.
"""

from __future__ import annotations

from collections.abc import Sequence

ACCEPT_DECAY = 0.9  # per scored proposal: the acceptance weighs roughly the last ten
COST_DECAY = 0.98  # per round: the cost line weighs roughly the last fifty
PRIOR_ACCEPT = 0.5  # the acceptance believed before any proposal is scored
PRIOR_ACCEPT_WEIGHT = 2.0  # worth that many scored drafts
PRIOR_DRAFT_SHARE = 0.03  # a draft row's cost as a share of a round, before it is measured
# Worth that much spread in K (drafts squared times rounds): two rounds of 8 drafts among rounds
# of none. Round times are noisy on a shared machine, and a slope measured from one such round
# would be mostly noise.
PRIOR_SLOPE_WEIGHT = 128.0
MARGIN = 0.02  # drafts must promise this much over plain decoding


def expected_tokens(a: float, k: int) -> float:
    """E(K): tokens a round of `k` drafts commits on average at acceptance `a`."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class DraftLength:
    """One session's draft length: `choose` before each round, `observe` after it."""

    def __init__(self, max_k: int) -> None:
        if max_k < 0:
            raise ValueError("max_k must be >= 0")
        self.max_k = max_k
        self._counts: dict[str, list[float]] = {}  # source -> [successes, failures], decayed
        # Decayed sums of the cost line's points (x: drafts sent, y: seconds).
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def acceptance(self, source: str = "ngram") -> float:
        """The acceptance `a` of the drafts from `source`, as measured so far."""
        successes, failures = self._counts_of(source)
        return successes / (successes + failures)

    def _counts_of(self, source: str) -> list[float]:
        # The prior's pseudo-counts decay with the rest, so evidence soon outweighs them.
        return self._counts.setdefault(
            source, [PRIOR_ACCEPT * PRIOR_ACCEPT_WEIGHT, (1.0 - PRIOR_ACCEPT) * PRIOR_ACCEPT_WEIGHT]
        )

    def cost(self) -> tuple[float, float]:
        """(c0, cd): a round's seconds without drafts and each draft's extra, as measured; in
        units of a round when nothing has been measured yet."""
        if self._w <= 0:
            return 1.0, PRIOR_DRAFT_SHARE
        mean_x, mean_y = self._sx / self._w, self._sy / self._w
        spread = self._sxx - self._w * mean_x * mean_x  # sum of w (x - mean x)^2
        covariance = self._sxy - self._w * mean_x * mean_y
        prior = PRIOR_DRAFT_SHARE * mean_y / (1.0 + PRIOR_DRAFT_SHARE * mean_x)
        slope = (covariance + PRIOR_SLOPE_WEIGHT * prior) / (max(spread, 0.0) + PRIOR_SLOPE_WEIGHT)
        slope = max(slope, 0.0)
        base = max(mean_y - slope * mean_x, 1e-3 * mean_y, 1e-9)
        return base, slope

    def score(self, proposal: Sequence[int], committed: Sequence[int], source: str) -> None:
        """Count a proposal of `source` at a round's first position against the tokens the
        round `committed`, whether it was sent or not: the committed tokens do not depend on
        the drafts, so its leading matches are the drafts that would have been accepted."""
        if not proposal or not committed:
            return
        counts = self._counts_of(source)
        counts[0] *= ACCEPT_DECAY
        counts[1] *= ACCEPT_DECAY
        compared = min(len(proposal), len(committed))
        matched = 0
        while matched < compared and proposal[matched] == committed[matched]:
            matched += 1
        counts[0] += matched
        if matched < compared:
            counts[1] += 1

    def leads(self, source: str, other: str) -> bool:
        """Whether `source`'s drafts are measured at least as likely accepted as `other`'s."""
        return self.acceptance(source) >= self.acceptance(other)

    def choose(self, available: int, source: str = "ngram") -> int:
        """The K to send this round, when `source` has `available` drafts to offer."""
        limit = min(self.max_k, available)
        if limit <= 0:
            return 0
        a = self.acceptance(source)
        base, per_draft = self.cost()
        plain = 1.0 / base
        best_k, best = 0, plain * (1.0 + MARGIN)
        for k in range(1, limit + 1):
            rate = expected_tokens(a, k) / (base + k * per_draft)
            if rate > best:
                best_k, best = k, rate
        return best_k

    def observe(
        self,
        proposal: Sequence[int],
        committed: Sequence[int],
        sent: int,
        seconds: float,
        steady: bool = True,
        source: str = "ngram",
    ) -> None:
        """After a round: the whole `proposal` of `source` at the round's first position, the
        tokens the round `committed`, how many drafts were `sent` and the round's `seconds`.
        `steady` is False for a round that carried more than one committed token (the prefill,
        a replay), whose time says nothing of a draft's cost."""
        self.score(proposal, committed, source)
        self.observe_cost(sent, seconds, steady)

    def observe_cost(self, sent: int, seconds: float, steady: bool = True) -> None:
        """A round's point on the cost line: `sent` drafts, `seconds`; none from a round that
        was not `steady` (see `observe`)."""
        if steady and seconds > 0:
            self._w = COST_DECAY * self._w + 1.0
            self._sx = COST_DECAY * self._sx + sent
            self._sy = COST_DECAY * self._sy + seconds
            self._sxx = COST_DECAY * self._sxx + sent * sent
            self._sxy = COST_DECAY * self._sxy + sent * seconds
