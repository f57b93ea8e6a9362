"""Draft trees: several candidates per position, verified in one round by walking the tree.

A round sends the last committed token (the root, row 0) and the drafts as rows 1 … N; draft
row r has a token and a parent row (0: the root), and its logits give the distribution of the
token one position past it. A chain of K drafts is the tree whose every row has one child.

Verifying is walking: at the root draw the target's token at its position; if a child of the
root holds that token, move to it and draw again one position on; stop at the first row none
of whose children holds the draw. The committed tokens are the draws made on the way, so the
round commits 1 + (accepted depth) tokens.

Why this is exact. A sampler's draw at absolute position t is a function of (seed, t, the
logits there) alone: the Gumbel-max draw (`core.coupling`), or the inverse CDF at u_t
(`core.sampling`). The row the walk draws at holds the committed prefix and nothing else
(every row sees only the prefix and its own ancestors), so its logits are plain decoding's at
that position and its draw is plain sampling's. The committed tokens are plain sampling's token
for token, whatever the tree held; a tree changes how many a round commits, never which.
Under the Gumbel coupling a drafter that shares the noise also proposes well: its best
candidates are those most likely to equal the target's draw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class DraftTree:
    """Drafts under the root: draft i is row i + 1, with token `tokens[i]` under row
    `parents[i]` (0: the root; a parent comes before its children). Siblings hold different
    tokens, so the walk follows at most one child."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} drafts but {len(self.parents)} parents")
        ancestor_paths(self.parents)  # ValueError for a parent that is not an earlier row
        seen: set[tuple[int, int]] = set()
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents, strict=True)):
            if token < 0:
                raise ValueError(f"draft {i} has token {token}: ids are never negative")
            if (parent, token) in seen:
                raise ValueError(f"row {parent} has two children holding token {token}")
            seen.add((parent, token))

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        """K drafts one after another: row r's parent is row r - 1."""
        return cls(tuple(int(t) for t in tokens), tuple(range(len(tokens))))

    @property
    def rows(self) -> int:
        """Rows a round runs: the root and every draft."""
        return len(self.tokens) + 1

    @cached_property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Each row's rows from the root down to itself (`ancestor_paths`)."""
        return ancestor_paths(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Each row's distance from the root (the root: 0); row r's logits are for the
        position `depth` past the root's."""
        return tuple(len(path) - 1 for path in self.paths)

    @cached_property
    def _children(self) -> tuple[dict[int, int], ...]:
        children: list[dict[int, int]] = [{} for _ in range(self.rows)]
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents, strict=True)):
            children[parent][token] = i + 1
        return tuple(children)

    def child(self, row: int, token: int) -> int | None:
        """The row under `row` holding `token`, if any."""
        return self._children[row].get(token)

    @property
    def is_chain(self) -> bool:
        """Whether every row has at most one child (what a plain verify round carries)."""
        return self.parents == tuple(range(len(self.parents)))

    def within_depth(self, depth: int) -> DraftTree:
        """The rows at most `depth` below the root (none for depth 0)."""
        row_of = {0: 0}
        tokens: list[int] = []
        parents: list[int] = []
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents, strict=True)):
            if self.depths[i + 1] <= depth and parent in row_of:
                row_of[i + 1] = len(tokens) + 1
                tokens.append(token)
                parents.append(row_of[parent])
        return DraftTree(tuple(tokens), tuple(parents))

    def main_branch(self) -> list[int]:
        """The tokens down the first child of each row from the root: the branch a drafter that
        orders its rows best first thinks likeliest."""
        first_child: dict[int, int] = {}
        for i, parent in enumerate(self.parents):
            first_child.setdefault(parent, i + 1)
        tokens, row = [], 0
        while row in first_child:
            row = first_child[row]
            tokens.append(self.tokens[row - 1])
        return tokens

    def ancestors(self, row: int) -> list[int]:
        """The rows from the root down to `row`, both included: what `row` may attend to
        within the round (besides the committed prefix)."""
        return list(self.paths[row])


def ancestor_paths(parents: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """For a tree given by its drafts' parent rows (draft i is row i + 1, row 0 the root), each
    row's rows from the root down to itself. ValueError for a parent that is not an earlier row."""
    paths: list[tuple[int, ...]] = [(0,)]
    for i, parent in enumerate(parents):
        if not 0 <= parent <= i:
            raise ValueError(f"draft {i} (row {i + 1}) has parent row {parent}, not 0 … {i}")
        paths.append((*paths[parent], i + 1))
    return tuple(paths)


def is_path(paths: Sequence[Sequence[int]], rows: Sequence[int]) -> bool:
    """Whether `rows` run from the root down a branch of the tree whose `paths` are given."""
    return (
        0 < len(rows) <= len(paths)
        and all(0 <= r < len(paths) for r in rows)
        and (tuple(paths[rows[-1]]) == tuple(rows))
    )


def walk(tree: DraftTree, draw: Callable[[int, int], int]) -> tuple[list[int], list[int]]:
    """Verify `tree`: `draw(row, depth)` is the target's token from row's logits, at the
    position `depth` past the root. Returns the committed tokens (one per row walked) and the
    rows walked, the root first: the accepted drafts are the rows after the root."""
    row, committed, path = 0, [], [0]
    while True:
        token = int(draw(row, tree.depths[row]))
        committed.append(token)
        row = tree.child(row, token)
        if row is None:
            return committed, path
        path.append(row)


MAX_RANK = 4  # candidates a drafter ranks at a node: a tree's node has at most this many children


@dataclass(frozen=True)
class TreeShape:
    """The shape of a tree a drafter is asked for, before it has tokens: slot i is row i + 1,
    under row `parents[i]`, holding the drafter's candidate of rank `ranks[i]` there (0: its
    best). A parent comes before its children, and no two siblings share a rank."""

    parents: tuple[int, ...] = ()
    ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.parents) != len(self.ranks):
            raise ValueError(f"{len(self.parents)} parents but {len(self.ranks)} ranks")
        ancestor_paths(self.parents)  # ValueError for a parent that is not an earlier row
        seen: set[tuple[int, int]] = set()
        for parent, rank in zip(self.parents, self.ranks, strict=True):
            if not 0 <= rank < MAX_RANK:
                raise ValueError(f"rank {rank} is not 0 … {MAX_RANK - 1}")
            if (parent, rank) in seen:
                raise ValueError(f"row {parent} has two children of rank {rank}")
            seen.add((parent, rank))

    @classmethod
    def chain(cls, k: int) -> TreeShape:
        """K drafts one after another, each the drafter's best."""
        return cls(tuple(range(k)), (0,) * k)

    def __len__(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Each row's distance from the root (the root: 0)."""
        return tuple(len(path) - 1 for path in ancestor_paths(self.parents))
