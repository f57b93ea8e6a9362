"""An EAGLE-3 draft head, built as the published heads for gpt-oss are (Li et al. 2025,
"EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time Test").

The head reads the target's hidden states at three depths ("taps": the states entering layers
t1, t2, t3, `Eagle3Config.taps`) and one Llama decoder layer whose attention and MLP see the
token's embedding beside the fused features:

    taps   [T, 3·Ht]  the target's taps at the committed positions 0 … T-1
    g    = fc(input_norm(taps))                      [3·Ht] -> [H]
                                                     (input_norm: norm_before_fc, or one per tap)
    e    = input_layernorm(embed(x_{t+1}))           the token sampled after position t
    h    = hidden_norm(g)
    a    = o_proj(attention(W_qkv [e ; h]))          [2·H] wide in; causal over the session's rows,
                                                     RoPE at the row's position (the head's own)
    r    = (h if norm_before_residual else g) + a
    out  = r + down(silu(gate(r')) * up(r')),  r' = post_attention_layernorm(r)
    logits = lm_head(norm(out))                      [H] -> [V_draft] (the target's head if none)
    token  = draft id + d2t[draft id]                the draft vocabulary's ids in the target's

Drafting deeper than one token feeds `out` back as `g` (no fc; the normed `norm(out)` when
`norm_output`) with the drafted token's embedding, at the next position, the chain's rows
attending to the committed rows and to each other. The head keeps its keys and values per
session, as the target keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specpipe.transformer.config import ModelConfig
from specpipe.transformer.layers import RMSNorm
from specpipe.transformer.linear import Linear
from specpipe.transformer.rope import Rotary, apply_rope


def default_taps(n_layers: int) -> tuple[int, int, int]:
    """The layers EAGLE-3 taps when a head does not say: the states entering layers 2, L//2
    and L-3 (gpt-oss-120b: 2, 18, 33)."""
    return (2, n_layers // 2, n_layers - 3)


def linear(n_in: int, n_out: int) -> Linear:
    """A linear layer without bias, which `Eagle3Head.pack` may pack for oneDNN. A draft need
    not be row-stable (the verify commits the target's own tokens whatever it drafts), so its
    products run the rows they are given, one as one."""
    layer = Linear(n_in, n_out, bias=False)
    layer.row_stable = False
    return layer


@dataclass(frozen=True)
class Eagle3Config:
    """The numbers of one EAGLE-3 head. `taps` are indices into the target's hidden states as
    transformers counts them: k is the state entering layer k (0 the embeddings, L the last
    layer's output before the final norm)."""

    hidden: int  # H: the head's width, the target's too for every published head
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    draft_vocab: int  # columns of lm_head (the target's vocabulary when it has none)
    target_vocab: int
    taps: tuple[int, ...]
    target_hidden: int = 0  # each tap's width; 0: `hidden`
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_positions: int = 131072
    norm_before_fc: bool = False  # an RMSNorm over the concatenated taps before fc…
    fc_norm: bool = False  # …or one over each tap (the two are exclusive)
    norm_before_residual: bool = False  # the residual is hidden_norm(g), not g
    norm_output: bool = False  # a deeper step is fed norm(out), not out
    has_lm_head: bool = True  # False: the target's own head reads the head's features
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # what it was read from

    @property
    def tap_width(self) -> int:
        return self.target_hidden or self.hidden

    def layer_config(self) -> ModelConfig:
        """The decoder layer's settings as a Llama config (its RoPE, its norms)."""
        return ModelConfig(
            arch="llama",
            vocab_size=self.target_vocab,
            dim=self.hidden,
            n_layers=1,
            n_heads=self.heads,
            n_kv_heads=self.kv_heads,
            intermediate_size=self.intermediate,
            head_dim=self.head_dim,
            norm_eps=self.norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_positions,
        )


@dataclass
class HeadCache:
    """One session's keys and values in the head's layer: [kv_heads, S, head_dim] each."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def length(self) -> int:
        return self.k.shape[1]

    def upto(self, n: int) -> HeadCache:
        """The first n rows (the committed ones, when drafts were appended after them)."""
        return HeadCache(self.k[:, :n], self.v[:, :n])


SESSION_BLOCK = 4096  # a session's rows attended in one block: bounds the scores' memory

Block = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # keys, values, mask


def attend(q: torch.Tensor, blocks: list[Block]) -> torch.Tensor:
    """Softmax attention of q [nkv, group·T, hd] (row g·T + t: query head g of the group, row
    t) over blocks of keys and values, one softmax across all of them without joining them:
    each block is k, v [nkv, S, hd] and which keys each row t sees, a mask [T, S] bool (None:
    all); every row sees a key of the first block. The blocks merge as flash attention's do:
    a running maximum of the scores, the sums so far rescaled whenever it rises."""
    nkv, rows, hd = q.shape
    top = total = out = None  # [nkv, group·T, 1], [nkv, group·T, 1], [nkv, group·T, hd]
    for k, v, mask in blocks:
        s = (q @ k.transpose(1, 2)) * hd**-0.5  # [nkv, group·T, S]
        if mask is not None:
            T, S = mask.shape
            s = s.view(nkv, rows // T, T, S).masked_fill(~mask, float("-inf")).view(nkv, rows, S)
        block_top = s.amax(dim=-1, keepdim=True)
        new_top = block_top if top is None else torch.maximum(top, block_top)
        w = (s - new_top).exp_()  # [nkv, group·T, S]
        if top is None:
            total, out = w.sum(dim=-1, keepdim=True), w @ v
        else:
            rescale = (top - new_top).exp_()
            total = total * rescale + w.sum(dim=-1, keepdim=True)
            out = out * rescale + w @ v
        top = new_top
    return out / total


def session_blocks(past: HeadCache | None) -> list[Block]:
    """A session's rows as blocks of `attend`, every row visible, read where they lie."""
    if past is None:
        return []
    return [
        (past.k[:, i : i + SESSION_BLOCK], past.v[:, i : i + SESSION_BLOCK], None)
        for i in range(0, past.length, SESSION_BLOCK)
    ]


class Eagle3Head(nn.Module):
    """The head's weights and its forward pass; names follow the published checkpoints."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        H, hd = cfg.hidden, cfg.head_dim
        self.cfg = cfg
        fused = len(cfg.taps) * cfg.tap_width
        if cfg.norm_before_fc and cfg.fc_norm:
            raise ValueError("a head norms its taps together or one by one, not both")
        self.input_norm = RMSNorm(fused, cfg.norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList(
            [RMSNorm(cfg.tap_width, cfg.norm_eps) for _ in cfg.taps] if cfg.fc_norm else []
        )
        self.fc = linear(fused, H)
        self.input_layernorm = RMSNorm(H, cfg.norm_eps)  # on the token's embedding
        self.hidden_norm = RMSNorm(H, cfg.norm_eps)  # on the features
        self.q_proj = linear(2 * H, cfg.heads * hd)
        self.k_proj = linear(2 * H, cfg.kv_heads * hd)
        self.v_proj = linear(2 * H, cfg.kv_heads * hd)
        self.o_proj = linear(cfg.heads * hd, H)
        self.post_attention_layernorm = RMSNorm(H, cfg.norm_eps)
        self.gate_proj = linear(H, cfg.intermediate)
        self.up_proj = linear(H, cfg.intermediate)
        self.down_proj = linear(cfg.intermediate, H)
        self.norm = RMSNorm(H, cfg.norm_eps)
        self.lm_head = linear(H, cfg.draft_vocab) if cfg.has_lm_head else None
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.long))
        self.rotary = Rotary(cfg.layer_config())

    def pack(self) -> int:
        """Hold the linear weights packed in oneDNN's blocked layout where it is available (the
        CPU), as a stage's are: the few rows of a tree's depth then cost about what one row
        does, where a plain product of the lm_head costs about twice as much for two rows as
        for one. The plain weights are let go; how many were packed."""
        return sum(m.pack() for m in self.modules() if isinstance(m, Linear))

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """The target's taps [T, 3·Ht] (concatenated in `cfg.taps` order) -> features [T, H]."""
        if self.input_norm is not None:
            taps = self.input_norm(taps)
        elif len(self.fc_norm):
            parts = taps.split(self.cfg.tap_width, dim=-1)
            normed = [norm(part) for norm, part in zip(self.fc_norm, parts, strict=True)]
            taps = torch.cat(normed, dim=-1)
        return self.fc(taps)

    def forward(
        self,
        g: torch.Tensor,
        embeds: torch.Tensor,
        start_pos: int,
        past: HeadCache | None = None,
    ) -> tuple[torch.Tensor, HeadCache]:
        """One pass of the decoder layer over T rows at positions start_pos …: features g [T, H]
        and the embeddings of the tokens that follow them [T, H] -> the layer's output [T, H]
        and the cache with these rows appended. Row i attends to `past` and rows 0 … i."""
        T = g.shape[0]
        h, q, k, v = self._project(g, embeds, *self.rotary(start_pos, T, g.dtype))
        causal = torch.ones(T, T, dtype=torch.bool, device=g.device).tril()
        out = self._attend_and_mix(g, h, q, [*session_blocks(past), (k, v, causal)])
        if past is not None:
            k, v = torch.cat([past.k, k], dim=1), torch.cat([past.v, v], dim=1)
        return out, HeadCache(k, v)

    def rows(self, g: torch.Tensor, embeds: torch.Tensor, start_pos: int) -> HeadCache:
        """The keys and values `forward` gives T rows at positions start_pos …, without the rest
        of its pass: what a session keeps of its committed rows. A row's own input and position
        make them; the rows before it do not."""
        _, _, k, v = self._project(g, embeds, *self.rotary(start_pos, g.shape[0], g.dtype))
        return HeadCache(k, v)

    def tree_step(
        self,
        g: torch.Tensor,
        embeds: torch.Tensor,
        position: int,
        past: HeadCache | None,
        tree: HeadCache | None,
        visible: torch.Tensor,
    ) -> tuple[torch.Tensor, HeadCache]:
        """One depth of a draft tree in one pass: N nodes, all at `position`, with features
        g [N, H] and their tokens' embeddings [N, H] -> the layer's output [N, H] and the
        nodes' own rows [kv_heads, N, head_dim]. Every node attends all of `past` (the
        session's rows, read where they lie), row j of `tree` (the R rows of the tree's
        shallower nodes) where visible[i, j] ([N, R] bool), and itself, not its siblings."""
        N = g.shape[0]
        h, q, k, v = self._project(g, embeds, *self.rotary(position, 1, g.dtype))
        own = torch.eye(N, dtype=torch.bool, device=g.device)
        if tree is not None:  # the tree's rows are few: joining them to the nodes' is cheap
            k, v = torch.cat([tree.k, k], dim=1), torch.cat([tree.v, v], dim=1)
            own = torch.cat([visible, own], dim=1)  # [N, R + N]
        out = self._attend_and_mix(g, h, q, [*session_blocks(past), (k, v, own)])
        return out, HeadCache(k[:, -N:], v[:, -N:])

    def _project(
        self, g: torch.Tensor, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """hidden_norm(g) [T, H], and the rows' queries [nh, T, hd], keys and values
        [nkv, T, hd] from [input_layernorm(embeds); hidden_norm(g)], rotated by cos/sin."""
        cfg, T = self.cfg, g.shape[0]
        h = self.hidden_norm(g)
        x = torch.cat([self.input_layernorm(embeds), h], dim=-1)  # [T, 2H]
        q = self.q_proj(x).view(T, cfg.heads, cfg.head_dim).transpose(0, 1)  # [nh, T, hd]
        k = self.k_proj(x).view(T, cfg.kv_heads, cfg.head_dim).transpose(0, 1)  # [nkv, T, hd]
        v = self.v_proj(x).view(T, cfg.kv_heads, cfg.head_dim).transpose(0, 1)
        return h, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _attend_and_mix(
        self,
        g: torch.Tensor,
        h: torch.Tensor,
        q: torch.Tensor,
        blocks: list[Block],
    ) -> torch.Tensor:
        """The rest of the layer: attention of q over the blocks of keys and values (`attend`),
        o_proj, the residual, the MLP -> out [T, H]."""
        cfg, T = self.cfg, g.shape[0]
        group = cfg.heads // cfg.kv_heads
        # Query head i reads KV head i // group: the group's queries go as one KV head's rows
        # [nkv, group·T, hd], so the keys are read where they are instead of copied per head.
        q = q.reshape(cfg.kv_heads, group * T, cfg.head_dim)
        attn = attend(q, blocks).view(cfg.heads, T, cfg.head_dim)  # [nh, T, hd]
        a = self.o_proj(attn.transpose(0, 1).reshape(T, cfg.heads * cfg.head_dim))
        r = (h if cfg.norm_before_residual else g) + a
        m = self.post_attention_layernorm(r)
        return r + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))

    def logits(self, out: torch.Tensor, target_head=None) -> torch.Tensor:
        """Draft logits [T, V_draft] of the layer's output: its own norm, then its lm_head (or
        the target's head, `target_head`, for a head that has none)."""
        normed = self.norm(out)
        if self.lm_head is not None:
            return self.lm_head(normed)
        if target_head is None:
            raise ValueError("this head reads its features through the target's head")
        return target_head(normed)

    def feed_back(self, out: torch.Tensor) -> torch.Tensor:
        """What a deeper step takes as its features: the output, or its normed form."""
        return self.norm(out) if self.cfg.norm_output else out

    def token_ids(self) -> np.ndarray:
        """The target's token id of each draft column: column c is token c + d2t[c]."""
        return (torch.arange(self.cfg.draft_vocab) + self.d2t.cpu()).numpy()
