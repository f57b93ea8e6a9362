"""Growing a draft tree of a given shape from a head's steps, one depth at a time.

Every head drafts a tree the same way: the nodes of one depth step together, each from its
parent's state (the root: the target's), and a node's candidates are the tokens its logits rank
best under the noise the target draws that position with (`ranked_at`), so rank 0 is
the chain's draft and the others are the next most likely to equal the target's draw. A slot
whose rank its node lacks (a top-k or top-p cut leaves fewer candidates) is left out with
everything under it. What a state is (a predicted feature, the keys and values along the path)
is the head's own business: `grow_tree` only hands states from parents to children.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from specpipe.core.sampling import SamplingParams
from specpipe.core.tree import MAX_RANK, DraftTree, TreeShape
from specpipe.drafting.coupled import ranked_at

# (the states of the nodes to expand, the tokens they stand for, their depth) ->
# (each node's state after its step, which its children start from; logits [N, V'])
Step = Callable[[list[Any], list[int], int], tuple[list[Any], np.ndarray]]


def grow_tree(
    shape: TreeShape,
    token: int,
    token_pos: int,
    params: SamplingParams,
    ids: np.ndarray | None,
    root_state: Any,
    step: Step,
) -> tuple[DraftTree, dict[tuple[int, ...], list[int]]]:
    """A draft tree of `shape` under `token` (at absolute position `token_pos`), and the
    candidates ranked at each node it expanded, keyed by the node's tokens below the root.
    Column c of a step's logits is token ids[c] (c itself when `ids` is None)."""
    depths = shape.depths
    row_of = {0: 0}  # shape row -> tree row, for the rows kept
    tokens: list[int] = []
    parents: list[int] = []
    keys: dict[int, tuple[int, ...]] = {0: ()}  # tree row -> its tokens below the root
    node_token = {0: int(token)}
    after: dict[int, Any] = {}  # tree row -> its state after its step
    candidates: dict[tuple[int, ...], list[int]] = {}
    for depth in range(max(depths, default=0)):
        # Every kept row at this depth with a child in the shape steps now.
        expand = sorted({row_of[p] for p in shape.parents if p in row_of and depths[p] == depth})
        if not expand:
            break
        states = [root_state if r == 0 else after[parents[r - 1]] for r in expand]
        stepped, logits = step(states, [node_token[r] for r in expand], depth)
        ranked = ranked_at(logits, params, token_pos + depth + 1, ids, MAX_RANK)
        for i, r in enumerate(expand):
            after[r] = stepped[i]
            candidates[keys[r]] = ranked[i]
        _add_children(shape, depth, row_of, keys, candidates, tokens, parents, node_token)
    return DraftTree(tuple(tokens), tuple(parents)), candidates


def _add_children(
    shape: TreeShape,
    depth: int,
    row_of: dict[int, int],
    keys: dict[int, tuple[int, ...]],
    candidates: dict[tuple[int, ...], list[int]],
    tokens: list[int],
    parents: list[int],
    node_token: dict[int, int],
) -> None:
    """The shape's slots at depth + 1 whose parents were kept, each the candidate of its rank."""
    depths: Sequence[int] = shape.depths
    for slot, (parent, rank) in enumerate(zip(shape.parents, shape.ranks, strict=True)):
        if depths[slot + 1] != depth + 1 or parent not in row_of:
            continue
        ranked = candidates[keys[row_of[parent]]]
        if rank >= len(ranked):
            continue
        row = len(tokens) + 1
        row_of[slot + 1] = row
        tokens.append(ranked[rank])
        parents.append(row_of[parent])
        node_token[row] = ranked[rank]
        keys[row] = (*keys[row_of[parent]], ranked[rank])


class RankedTrees:
    """Per session, the candidates of its last tree, to say at the next round which rank the
    target's tokens had at each node the walk passed (what sizes the trees)."""

    def __init__(self, max_sessions: int = 4096) -> None:
        self.max_sessions = max_sessions
        # session -> (root position, root token, candidates by node)
        self._last: OrderedDict[str, tuple[int, int, dict[tuple[int, ...], list[int]]]] = (
            OrderedDict()
        )

    def keep(
        self, session: str, root_pos: int, root: int, candidates: dict[tuple[int, ...], list[int]]
    ) -> None:
        """The session's newest tree grew from `root` at `root_pos` with these candidates."""
        self._last[session] = (root_pos, int(root), candidates)
        self._last.move_to_end(session)
        while len(self._last) > self.max_sessions:
            self._last.popitem(last=False)

    def ranks_of(
        self, session: str, root_pos: int, root: int, committed: Sequence[int]
    ) -> list[int]:
        """After a round from `root` at `root_pos` committed `committed`: if the session's last
        tree grew from that root, the rank of each committed token among its candidates at the
        node the walk was at (-1: none of them), up to the first node it did not expand."""
        last = self._last.get(session)
        if last is None or last[:2] != (root_pos, int(root)):
            return []
        candidates, ranks = last[2], []
        for depth, token in enumerate(committed):
            ranked = candidates.get(tuple(int(t) for t in committed[:depth]))
            if ranked is None:
                break
            ranks.append(ranked.index(token) if token in ranked else -1)
        return ranks

    def forget(self, session: str) -> None:
        self._last.pop(session, None)
