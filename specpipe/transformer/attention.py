"""Grouped-query attention over a `LayerCache`, with gpt-oss's sinks and sliding windows.

Queries, keys and values are [H, T, hd] for one sequence. Keys and values are read from the cache
by absolute position, so the same code runs a prefill, a single decode step and a K-token verify.

Row stability (see `linear`): besides padding its products' rows to `MIN_ROWS`, attention depends
on the number of keys S, which differs between a verify and a step; its kernels agree on every
row once S is at least `MIN_KEYS`, so short contexts pad the keys (masked), and gpt-oss's sink
logit goes first, at a fixed index, rather than after the keys.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from specpipe.transformer.config import ModelConfig
from specpipe.transformer.kvcache import LayerCache
from specpipe.transformer.linear import MIN_ROWS, Linear, padded, stable_bmm
from specpipe.transformer.rope import apply_rope

MIN_KEYS = 16
QUERY_CHUNK = 256


@dataclass(frozen=True)
class Segment:
    """One sequence's rows in a forward of several: P rows, of which the first `tokens` are
    tokens at positions pos… (the rest padding), with their rotations and their cache."""

    rows: int
    tokens: int
    cos: torch.Tensor
    sin: torch.Tensor
    cache: LayerCache
    pos: int
    # A draft tree: each token row's rows from the root down to itself. Row r sits at position
    # pos + len(ancestors[r]) - 1 (its rotations say so too); None: a sequence.
    ancestors: tuple[tuple[int, ...], ...] | None = None


class Attention(nn.Module):
    row_stable = True  # see the module docstring

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.window = cfg.window(layer)
        # Queries, keys and values in one product: q [H*hd] | k [Hkv*hd] | v [Hkv*hd].
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.wqkv = Linear(cfg.dim, q + 2 * kv, bias=cfg.qkv_bias)
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.o_bias)
        # gpt-oss: one learned logit per head that competes in the softmax and carries no value.
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.has_sinks else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache,
        pos: int,
        tokens: int | None = None,
    ) -> torch.Tensor:
        """x [P, D] for positions pos…: the first `tokens` rows (default: all) are the tokens;
        any rows after them are padding, attended but never cached (see `StageModel.forward`)."""
        P = x.shape[0]
        return self.forward_many(
            x, [Segment(P, P if tokens is None else tokens, cos, sin, cache, pos)]
        )

    def forward_many(self, x: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """x [sum of P, D]: the rows of several sequences one after another, each attending over
        its own cache. The products run on every row at once; row stability gives each row the
        numbers it gets alone."""
        qkv = self.wqkv(x)  # [sum of P, (H+2Hkv)*hd]
        outs, row = [], 0
        for seg in segments:
            outs.append(self._attend_segment(qkv[row : row + seg.rows], seg))
            row += seg.rows
        return self.wo(outs[0] if len(outs) == 1 else torch.cat(outs))

    def _attend_segment(self, qkv: torch.Tensor, seg: Segment) -> torch.Tensor:
        """One sequence's projected rows [P, (H+2Hkv)*hd] -> attention output [P, H*hd]."""
        P, H, T = seg.rows, self.n_heads, seg.tokens
        qkv = qkv.view(P, H + 2 * self.n_kv, self.hd).transpose(0, 1)  # [H+2Hkv, P, hd]
        qk = apply_rope(qkv[: H + self.n_kv], seg.cos, seg.sin)  # queries and keys rotate alike
        k, v = qk[H:], qkv[H + self.n_kv :]  # [Hkv, P, hd] x 2
        if T < P:
            k, v = k[:, :T], v[:, :T]
        if seg.ancestors is not None:
            out = self._attend_tree(qk[:H], k, v, seg)
            return out.transpose(0, 1).reshape(P, self.n_heads * self.hd)
        keys, values, first = seg.cache.append(k, v, seg.pos)  # [Hkv, S, hd], key 0's position
        out = self._attend_rows(qk[:H], keys, values, first, seg.pos, T)  # [H, P, hd]
        return out.transpose(0, 1).reshape(P, self.n_heads * self.hd)

    def _attend_rows(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        first: int,
        pos: int,
        tokens: int,
    ) -> torch.Tensor:
        """Queries [H, P, hd] of consecutive positions pos… (the first `tokens` of them tokens,
        the rest padding) over a cache's keys and values [Hkv, S, hd] -> [H, P, hd]."""
        if self.row_stable and keys.shape[1] < MIN_KEYS:  # padded keys lie in the future: masked
            keys, values = padded(keys, MIN_KEYS), padded(values, MIN_KEYS)
        # One token that sees every key needs no mask (padding rows may see what they like).
        masked = tokens > 1 or self.window is not None or first + keys.shape[1] > pos + tokens
        # Long prompts attend in chunks of queries, so the scores never outgrow [H, C, S].
        chunks = [
            self._attend(q[:, i : i + QUERY_CHUNK], keys, values, first, pos + i, masked)
            for i in range(0, q.shape[1], QUERY_CHUNK)
        ]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)

    def _attend_tree(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segment
    ) -> torch.Tensor:
        """A draft tree's rows, q [H, P, hd] with k, v [Hkv, T, hd] -> [H, P, hd]: each token
        row over the prefix and its own ancestors, exactly as a plain step at its position
        would see them. A row's path is written into the cache's buffer after the prefix and
        attended there, so nothing is copied: the rows off the longest branch one at a time,
        then the longest branch's rows together, as a chain's verify runs them (it is left in
        the buffer). The rows' keys also wait apart for the accepted path (`LayerCache.keep`);
        padding rows are zero."""
        cache, pos, paths = seg.cache, seg.pos, seg.ancestors
        cache.pending = (k, v, pos)
        longest = list(max(paths[: seg.tokens], key=len))
        out = q.new_zeros(q.shape)
        on_longest = set(longest)
        for r in range(seg.tokens):
            if r in on_longest:
                continue
            path = list(paths[r])
            keys, values, first = cache.append(k[:, path], v[:, path], pos)
            at = pos + len(path) - 1
            out[:, r : r + 1] = self._attend_rows(q[:, r : r + 1], keys, values, first, at, 1)
        keys, values, first = cache.append(k[:, longest], v[:, longest], pos)
        out[:, longest] = self._attend_rows(q[:, longest], keys, values, first, pos, len(longest))
        return out

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        first: int,
        pos: int,
        masked: bool,
    ) -> torch.Tensor:
        """Queries [H, T, hd] at positions pos… over keys/values [Hkv, S, hd] -> [H, T, hd];
        `masked`: hide the keys each query must not see."""
        T, S, group = q.shape[1], keys.shape[1], self.n_heads // self.n_kv
        # Query heads grouped under their kv head: [Hkv, group*T, hd] x [Hkv, hd, S].
        q = q.reshape(self.n_kv, group * T, self.hd)
        rows = MIN_ROWS if self.row_stable else 1
        scores = stable_bmm(q, keys.transpose(1, 2), rows) / math.sqrt(self.hd)
        scores = scores.view(self.n_heads, T, S)
        if masked:
            scores = scores + attention_mask(pos, T, first, S, self.window, q)
        if self.sinks is not None:
            sink = self.sinks.to(scores.dtype).view(-1, 1, 1).expand(-1, T, 1)
            probs = torch.softmax(torch.cat([sink, scores], dim=-1).float(), dim=-1)[..., 1:]
        else:
            probs = torch.softmax(scores.float(), dim=-1)
        probs = probs.to(values.dtype).reshape(self.n_kv, group * T, S)
        return stable_bmm(probs, values, rows).reshape(self.n_heads, T, self.hd)


def attention_mask(
    pos: int, T: int, first: int, S: int, window: int | None, like: torch.Tensor
) -> torch.Tensor:
    """[T, S] additive mask: query at pos+i sees keys at first+j <= pos+i (and within window)."""
    q_pos = torch.arange(pos, pos + T, device=like.device)[:, None]
    k_pos = torch.arange(first, first + S, device=like.device)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    zero = torch.zeros((), dtype=like.dtype, device=like.device)
    return torch.where(visible, zero, torch.finfo(like.dtype).min)
