"""The decoder layer: pre-norm attention and a pre-norm MLP, with RMSNorm and SwiGLU.

Hidden states are [T, D] for one sequence (no batch dimension). The parts live beside this:
`attention`, `moe` (gpt-oss's mixture of experts), and `linear` (row-stable products).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specpipe.transformer.attention import Attention, Segment
from specpipe.transformer.config import ModelConfig
from specpipe.transformer.kvcache import LayerCache
from specpipe.transformer.linear import Linear
from specpipe.transformer.moe import MoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) in float32 whatever the model dtype, then the weight in the
        # model's dtype, as the reference implementations do.
        h = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        return self.weight * h.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # The gate and up projections in one product: gate [I] | up [I].
        self.w_gate_up = Linear(cfg.dim, 2 * cfg.intermediate_size, bias=False)
        self.w_down = Linear(cfg.intermediate_size, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    """One decoder layer: pre-norm attention and pre-norm MLP (SwiGLU or mixture of experts)."""

    def __init__(self, cfg: ModelConfig, layer: int, packed_experts: bool = False) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MoE(cfg, packed_experts) if cfg.is_moe else SwiGLU(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache,
        pos: int,
        tokens: int | None = None,
    ) -> torch.Tensor:
        """x [P, D] -> [P, D]; rows from `tokens` on are padding (see `Attention.forward`)."""
        P = x.shape[0]
        return self.forward_many(
            x, [Segment(P, P if tokens is None else tokens, cos, sin, cache, pos)]
        )

    def forward_many(self, x: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """The rows of several sequences one after another, [sum of P, D] -> [sum of P, D]:
        attention within each sequence, everything else on every row at once."""
        x = x + self.attn.forward_many(self.attn_norm(x), segments)
        return x + self.mlp(self.mlp_norm(x))
