"""An EAGLE-3 head drafting at the tail: a `TailDrafter` over the target's taps.

Each round the tail hands it the taps of the round's rows (`StageModel.tap_layers`: the hidden
states entering the head's three layers, side by side, [rows, 3·Ht]). Row t's taps pair with
the token at t + 1, and the pair's keys and values (all a committed row leaves behind: the
head's `rows`) join the session's cache, a `LayerCache` holding one row per position from the
session's first remembered position on, cut back to a round's start as the round's rows join it
(a rejected draft's row never stays). Drafting from the last committed token at `token_pos`:

    g    = fc(taps at token_pos - 1)              the root's features, from the target
    out  = layer(g, embed(token), token_pos - 1)  attending the session's cache before it
    d1   = coupled draw of lm_head(norm(out))     in the target's noise at token_pos + 1
    then g = out (or norm(out)), token = d1, one position on, for d2, d3, …

A tree grows the same way from each node's parent (`tree_growth.grow_tree`), the nodes of one
depth in one pass, every node attending the session's cache and its own path. The head's columns
are its draft vocabulary: column c drafts target token c + d2t[c] (`Eagle3Head.token_ids`).
Whatever it drafts, the tail's verify commits the target's own draw, so the committed tokens are
plain sampling's.

A prompt longer than a prefill chunk goes in rounds whose sampled token the loop drops, and
the tail cannot tell such a round from one whose token is kept: the chunk's last row is paired
with that token. The drafter keeps each session's last row's features, and when the next round
starts from another token there (the prompt's own), pairs the row again with it
(`starts_round`), so the cache holds the session's own pairs only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from specpipe.core.sampling import SamplingParams
from specpipe.core.tree import DraftTree, TreeShape
from specpipe.drafting.coupled import coupled_draft
from specpipe.drafting.eagle3 import Eagle3Head, HeadCache
from specpipe.drafting.eagle3_format import load_eagle3
from specpipe.drafting.target_parts import DraftHeadError, TargetParts
from specpipe.drafting.tree_growth import RankedTrees, grow_tree
from specpipe.transformer.kvcache import LayerCache

MAX_SESSIONS = 256  # sessions whose cache the head keeps (the least recently used goes first)
MAX_RANKED_SESSIONS = 4096  # sessions whose last tree's candidates it remembers


class TreeRows:
    """The rows of a tree's nodes while it grows, in the order they stepped (a node's path is
    the indices of its ancestors' rows and its own among them), in a buffer with room for the
    tree's `capacity` rows. The session's rows are not copied here: every node attends them
    where they lie, as a block of their own (`Eagle3Head.tree_step`)."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity, self.device, self.filled = capacity, device, 0
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def context(self) -> HeadCache | None:
        """The tree's rows so far: [kv_heads, rows, head_dim] keys and values (None: none)."""
        if self.k is None:
            return None
        return HeadCache(self.k[:, : self.filled], self.v[:, : self.filled])

    def visible(self, paths: list[tuple[int, ...]]) -> torch.Tensor:
        """[N, rows so far] bool: each node sees the rows of its own path."""
        mask = torch.zeros(len(paths), self.filled, dtype=torch.bool, device=self.device)
        for i, path in enumerate(paths):
            mask[i, list(path)] = True
        return mask

    def add(self, own: HeadCache) -> int:
        """Write a depth's rows after the others; the tree index of the first."""
        if self.k is None:
            kv_heads, _, head_dim = own.k.shape
            self.k = own.k.new_empty(kv_heads, self.capacity, head_dim)
            self.v = torch.empty_like(self.k)
        first, n = self.filled, own.length
        if first + n > self.capacity:
            raise ValueError(f"a tree of {self.capacity} rows has no room for {first + n}")
        self.k[:, first : first + n], self.v[:, first : first + n] = own.k, own.v
        self.filled += n
        return first


class Eagle3Drafter:
    """A released (or synthesized) EAGLE-3 head at the tail, for every session it serves."""

    def __init__(self, head: Eagle3Head, parts: TargetParts) -> None:
        if list(head.cfg.taps) != sorted(set(head.cfg.taps)):
            # The stages keep their taps in the ring's order: the head must read them so.
            raise DraftHeadError(f"the head's taps {list(head.cfg.taps)} are not in layer order")
        self.head, self.parts = head, parts
        self.ids = head.token_ids()
        self._rows: OrderedDict[str, LayerCache] = OrderedDict()  # from each one's first
        # Each session's last row: its position, its features [H], the token it is paired with.
        self._last: dict[str, tuple[int, torch.Tensor, int]] = {}
        self.ranked = RankedTrees(MAX_RANKED_SESSIONS)

    @classmethod
    def for_stage(
        cls,
        stage,
        path: str | Path,
        embed_weight: torch.Tensor | None = None,
        pack: bool = False,
    ) -> Eagle3Drafter:
        """The released head in folder `path` on `stage`, a tail whose weights are not packed
        yet (`embed_weight`: the embedding table, unless the tail holds it), its own weights
        packed when `pack` (`Eagle3Head.pack`); DraftHeadError, in one line, for a head that
        does not fit the model."""
        cfg = stage.cfg
        head = load_eagle3(path, cfg.dim, cfg.vocab_size, cfg.n_layers).to(stage.device)
        if pack:
            head.pack()
        return cls(head, TargetParts.from_stage(stage, embed_weight))

    @property
    def taps(self) -> tuple[int, ...]:
        """The target's layers whose incoming states it reads, in layer order."""
        return self.head.cfg.taps

    def embed(self, ids: Sequence[int]) -> torch.Tensor:
        """The target's embeddings of `ids` [N, H]."""
        tokens = torch.tensor([int(t) for t in ids], dtype=torch.long)
        return self.parts.embed(tokens).float()

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The head's draft logits [N, V_draft] of the layer's output [N, H]."""
        return self.head.logits(out, self.parts.head).float()

    @torch.inference_mode()
    def remember(
        self, session: str, features: torch.Tensor, tokens: Sequence[int], first_pos: int
    ) -> None:
        """Tokens the session committed at first_pos …, each with the taps [m, 3·Ht] of the row
        before it: their rows join the session's cache, anything at or after them cut."""
        if len(tokens):
            self._append(session, self.head.fuse(features.float()), tokens, first_pos - 1)

    @torch.inference_mode()
    def starts_round(self, session: str, token: int, token_pos: int) -> None:
        """A round of the session starts from `token` at `token_pos`. The row before it was
        paired with the token the last round committed there, which the loop dropped if that
        round was a prefill chunk's (it sends the prompt's next token instead): the row's
        features, kept, are paired again with this one."""
        last = self._last.get(session)
        if last is None:
            return
        position, g, paired = last
        if position == token_pos - 1 and paired != int(token):
            self._append(session, g[None], [token], position)

    def _append(self, session: str, g: torch.Tensor, tokens: Sequence[int], position: int) -> None:
        """The rows of features g [m, H] paired with `tokens`, at `position` …, into the
        session's cache (anything at or after them cut); the last row's features kept."""
        new = self.head.rows(g, self.embed(tokens), position)
        rows = self._rows.get(session)
        if rows is None or not rows.first <= position <= rows.end:  # a gap: start again there
            kv_heads, _, head_dim = new.k.shape
            rows = LayerCache(kv_heads, head_dim, new.k.dtype, new.k.device, first=position)
        rows.append(new.k, new.v, position)  # what was at or after `position` is cut
        self._rows[session] = rows
        self._last[session] = (position + len(tokens) - 1, g[-1].clone(), int(tokens[-1]))
        self._rows.move_to_end(session)
        while len(self._rows) > MAX_SESSIONS:
            gone, _ = self._rows.popitem(last=False)
            self._last.pop(gone, None)

    def past_before(self, session: str, position: int) -> HeadCache | None:
        """The session's rows at positions before `position` (None: none)."""
        rows = self._rows.get(session)
        if rows is None:
            return None
        n = min(position, rows.end) - rows.first
        return HeadCache(rows.k[:, :n], rows.v[:, :n]) if n > 0 else None

    @torch.inference_mode()
    def drafts_after(
        self,
        session: str,
        feature: torch.Tensor,
        token: int,
        token_pos: int,
        k: int,
        params: SamplingParams,
    ) -> list[int]:
        """K drafts in a chain after the last committed `token` at `token_pos`, from the taps
        [3·Ht] of the row before it."""
        drafts: list[int] = []
        position = token_pos - 1
        past = self.past_before(session, position)
        g = self.head.fuse(feature.reshape(1, -1).float())
        for j in range(1, k + 1):
            out, past = self.head(g, self.embed([token]), position, past)
            token = coupled_draft(self.logits(out)[0].numpy(), params, token_pos + j, self.ids)
            drafts.append(token)
            g, position = self.head.feed_back(out), position + 1
        return drafts

    @torch.inference_mode()
    def draft_tree(
        self,
        session: str,
        feature: torch.Tensor,
        token: int,
        token_pos: int,
        shape: TreeShape,
        params: SamplingParams,
    ) -> DraftTree:
        """A tree of `shape` after the last committed `token`; its candidates are remembered
        for `ranks_of` until the session's next tree. The nodes of one depth step together
        (`Eagle3Head.tree_step`): each attends the session's rows and the rows of its own path,
        which is a node's state beside the features it is fed."""
        past = self.past_before(session, token_pos - 1)
        rows = TreeRows(len(shape.parents) + 1, feature.device)

        def step(states: list, ids: list[int], depth: int):
            g = torch.stack([features for features, _ in states])  # [N, H]
            paths = [path for _, path in states]
            position, visible = token_pos - 1 + depth, rows.visible(paths)
            out, own = self.head.tree_step(
                g, self.embed(ids), position, past, rows.context, visible
            )
            first = rows.add(own)
            fed = self.head.feed_back(out)
            after = [(fed[i], (*path, first + i)) for i, path in enumerate(paths)]
            return after, self.logits(out).numpy()

        root = (self.head.fuse(feature.reshape(1, -1).float())[0], ())
        tree, candidates = grow_tree(shape, token, token_pos, params, self.ids, root, step)
        self.ranked.keep(session, token_pos, token, candidates)
        return tree

    def ranks_of(
        self, session: str, root_pos: int, root: int, committed: Sequence[int]
    ) -> list[int]:
        """The ranks of the committed tokens in the session's last tree (`RankedTrees`)."""
        return self.ranked.ranks_of(session, root_pos, root, committed)

    def forget(self, session: str) -> None:
        """Let go of what the head keeps of a session."""
        self._rows.pop(session, None)
        self._last.pop(session, None)
        self.ranked.forget(session)
