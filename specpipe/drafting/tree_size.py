"""The size and shape of each round's draft tree, per session: the tree that is expected to
commit the most tokens per second, from the head's measured acceptance by depth and rank and
the measured cost of a round.

Under the coupling, the walk moves from a node to its child of rank r (the head's r-th best
candidate there) exactly when the target's draw equals that candidate. Let a(d, r) be the
probability of that at depth d (the root is depth 0) once the walk got there. The walk reaches
a node with probability the product of a(·, ·) along its path, and a round commits one token
more than the nodes it passes, so a tree T commits on average

    E(T) = 1 + Σ_{n in T} P(reach n)

tokens. Each node on the tree's longest branch costs one row of every stage's forward, cd
seconds, on top of the round's c0 (`DraftLength.cost`, a line through the rounds' rows and
seconds: on a slow ring c0 is large and rows are nearly free; on a fast, busy one they are
not), and each node off it cs: such a row attends alone, and its siblings make the head rank
more candidates. cs is measured from the tree rounds' time beyond the line, against how many
rows they had off their longest branch (decaying by `SIDE_COST_DECAY`, pulled toward
`PRIOR_SIDE_SHARE` of cd while few were measured). For each size N the best tree is the N nodes
most likely to be reached, which a best-first search grows one node at a time (a node is never
likelier than its parent, so every prefix of the search is a tree), and the rule sends the N
that maximises E / (c0 + B (L cd + (N - L) cs)), L the longest branch, when it beats the best
chain of the head's best candidates by `TREE_MARGIN` (its gain rests on the rarer ranks'
estimates, and on a fast ring a side row costs about what it gains); else that chain, or no
drafts when none beats plain decoding by `MARGIN`. B is the tail's recent batch
(`RoundResult.batch`, decaying by `BATCH_DECAY`): with other sessions' rounds in the same
forwards, a row slows all of them, so on a busy ring trees shrink to what pays for the ring's
throughput, not one job's.

This is the rule of EAGLE-2 (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with
Dynamic Draft Trees"), with acceptance measured instead of read off the drafter's confidence,
and the cost of rows measured on the ring.

a(d, r) is counted from each round's ranks (`RoundResult.ranks`: the rank of each committed
token among the head's candidates at the node the walk was at), decaying by `ACCEPT_DECAY`, from
a prior worth `PRIOR_WEIGHT` rounds. The choice never changes the output: a tree changes how
many tokens a round commits, never which.

With `drafts` fixed, every tree is the best-first tree of that many nodes whatever rows cost:
what a tree of that size commits where rows are nearly free (a GPU's forward), measured on a
ring where they are not.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from specpipe.core.tree import MAX_RANK, TreeShape
from specpipe.drafting.length import MARGIN, DraftLength

ACCEPT_DECAY = 0.97  # per observed node: a depth's estimate weighs roughly its last thirty
PRIOR = (0.5, 0.1, 0.05, 0.03)  # a(d, r) believed before anything is observed, by rank
PRIOR_WEIGHT = 2.0  # worth that many observed nodes
MAX_SLOTS = 32  # drafts in one tree, at most
SIDE_COST_DECAY = 0.98  # per round: the side rows' cost weighs roughly the last fifty
PRIOR_SIDE_SHARE = 1.5  # a row off the longest branch, in rows on it, before it is measured
PRIOR_SIDE_WEIGHT = 16.0  # worth that many side rows (squared) measured
BATCH_DECAY = 0.9  # per round: the tail's batch size weighs roughly the last ten
TREE_MARGIN = 0.05  # a tree must promise this much over the best chain


class TreeSize:
    """One session's draft trees: `choose` before asking the head for one, `observe` after a
    round whose ranks came back."""

    def __init__(self, max_depth: int, length: DraftLength, drafts: int = 0) -> None:
        if max_depth < 0 or not 0 <= drafts <= MAX_SLOTS:
            raise ValueError(f"max_depth must be >= 0 and drafts within 0 … {MAX_SLOTS}")
        self.max_depth = max_depth
        self.length = length  # whose cost line prices a row
        self.drafts = drafts  # 0: each tree's size chosen by its cost; N: always N drafts
        # counts[d][r]: decayed times the walk took rank r at depth d; the last entry: no rank.
        self._counts = [
            [p * PRIOR_WEIGHT for p in PRIOR] + [(1.0 - sum(PRIOR)) * PRIOR_WEIGHT]
            for _ in range(max_depth)
        ]
        self._side_w = self._side_s = 0.0  # decayed sums: side rows squared, side rows x seconds
        self._batch_w = self._batch_s = 0.0  # decayed sums: rounds, batch sizes

    def observe_batch(self, batch: int) -> None:
        """A round's batch at the tail: how many sessions' rounds its forward ran together."""
        self._batch_w = BATCH_DECAY * self._batch_w + 1.0
        self._batch_s = BATCH_DECAY * self._batch_s + max(batch, 1)

    @property
    def batch(self) -> float:
        """The tail's recent batch size (1 before any is known)."""
        return self._batch_s / self._batch_w if self._batch_w else 1.0

    def observe_cost(self, side_rows: int, extra_s: float) -> None:
        """A steady round's `side_rows` (drafts off its longest branch; 0 for a chain) and its
        seconds beyond what the draft length's line gives its longest branch."""
        self._side_w = SIDE_COST_DECAY * self._side_w + side_rows * side_rows
        self._side_s = SIDE_COST_DECAY * self._side_s + side_rows * extra_s

    def side_cost(self, per_row: float) -> float:
        """cs: a side row's seconds as measured, given cd (`per_row`) for the prior."""
        prior = PRIOR_SIDE_WEIGHT * PRIOR_SIDE_SHARE * per_row
        return max((self._side_s + prior) / (self._side_w + PRIOR_SIDE_WEIGHT), 0.0)

    def acceptance(self, depth: int, rank: int) -> float:
        """a(depth, rank) as measured so far."""
        counts = self._counts[depth]
        return counts[rank] / sum(counts)

    def observe(self, ranks: Sequence[int]) -> None:
        """A round's ranks: at depth d the walk took the head's candidate ranks[d] (-1: none)."""
        for depth, rank in enumerate(ranks[: self.max_depth]):
            counts = self._counts[depth]
            for r in range(len(counts)):
                counts[r] *= ACCEPT_DECAY
            counts[rank if 0 <= rank < MAX_RANK else MAX_RANK] += 1.0

    def choose(self, limit: int = MAX_SLOTS) -> TreeShape:
        """The tree to ask the head for: at most `limit` drafts, none when plain is faster."""
        base, per_row = self.length.cost()
        per_side = self.side_cost(per_row)
        # A row slows every round of the forward it runs in: with others' rounds beside it,
        # what it costs them counts too (the aggregate's tokens per second, not this job's).
        per_row, per_side = per_row * self.batch, per_side * self.batch
        # Candidates: (-P(reach), order, parent row, rank, depth); order keeps ties stable.
        frontier: list[tuple[float, int, int, int, int]] = []
        order = 0

        def offer(parent: int, depth: int, reach: float) -> None:
            nonlocal order
            if depth >= self.max_depth:
                return
            for rank in range(MAX_RANK):
                heapq.heappush(
                    frontier, (-reach * self.acceptance(depth, rank), order, parent, rank, depth)
                )
                order += 1

        offer(0, 0, 1.0)
        plain = (1.0 / base) * (1.0 + MARGIN)
        chain_k, chain = self._best_chain(base, per_row, plain)
        parents: list[int] = []
        ranks: list[int] = []
        # A tree must promise `TREE_MARGIN` more than the best chain: its gain over it rests on
        # the rarer ranks' estimates, and on a fast ring a side row costs about what it gains.
        expected, best_n, best = 1.0, 0, max(plain, chain * (1.0 + TREE_MARGIN))
        longest = 0
        while frontier and len(parents) < min(limit, self.drafts or MAX_SLOTS):
            reach, _, parent, rank, depth = heapq.heappop(frontier)
            parents.append(parent)
            ranks.append(rank)
            expected -= reach
            longest = max(longest, depth + 1)
            side = len(parents) - longest
            rate = expected / (base + longest * per_row + side * per_side)
            if rate > best:
                best_n, best = len(parents), rate
            offer(len(parents), depth + 1, -reach)
        if self.drafts:
            best_n = len(parents)
        if best_n == 0:
            return TreeShape.chain(chain_k)
        return TreeShape(tuple(parents[:best_n]), tuple(ranks[:best_n]))

    def _best_chain(self, base: float, per_row: float, plain: float) -> tuple[int, float]:
        """The chain of the head's best candidates that is expected fastest, and its tokens
        per second: (0, plain's) when none beats plain decoding."""
        best_k, best, expected, reach = 0, plain, 1.0, 1.0
        for depth in range(min(self.max_depth, MAX_SLOTS)):
            reach *= self.acceptance(depth, 0)
            expected += reach
            rate = expected / (base + (depth + 1) * per_row)
            if rate > best:
                best_k, best = depth + 1, rate
        return best_k, best
