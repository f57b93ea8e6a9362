"""gpt-oss's feed-forward, a mixture of experts: the top-k router and the clamped SwiGLU experts.

MXFP4 expert weights (see `mxfp4`) stay packed, and one expert is unpacked when a token is routed
to it, so a 9-layer gpt-oss-120b stage fits a 24 GB GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from specpipe.transformer.config import ModelConfig
from specpipe.transformer.linear import Linear, stable_linear
from specpipe.transformer.mxfp4 import mxfp4_dequantize


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation on interleaved (gate, up) columns, both clamped to `limit`."""
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


class Experts(nn.Module):
    """E experts, each gate_up [2I, D] and down [D, I] with biases; float or MXFP4-packed."""

    row_stable = True  # see linear.py

    def __init__(self, cfg: ModelConfig, packed: bool) -> None:
        super().__init__()
        E, D, inter = cfg.n_experts, cfg.dim, cfg.intermediate_size
        self.packed = packed
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.gate_up_bias = nn.Parameter(torch.zeros(E, 2 * inter))
        self.down_bias = nn.Parameter(torch.zeros(E, D))
        if packed:
            u8 = torch.uint8
            self.register_buffer("gate_up_blocks", torch.zeros(E, 2 * inter, D // 32, 16, dtype=u8))
            self.register_buffer("gate_up_scales", torch.zeros(E, 2 * inter, D // 32, dtype=u8))
            self.register_buffer("down_blocks", torch.zeros(E, D, inter // 32, 16, dtype=u8))
            self.register_buffer("down_scales", torch.zeros(E, D, inter // 32, dtype=u8))
        else:
            self.gate_up = nn.Parameter(torch.zeros(E, 2 * inter, D))
            self.down = nn.Parameter(torch.zeros(E, D, inter))

    def weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, D], down [D, I]), unpacked if packed."""
        if self.packed:
            return (
                mxfp4_dequantize(self.gate_up_blocks[e], self.gate_up_scales[e], dtype),
                mxfp4_dequantize(self.down_blocks[e], self.down_scales[e], dtype),
            )
        return self.gate_up[e], self.down[e]

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [T, D], idx/weight [T, k] -> sum over each token's k experts of weight * expert(x)."""
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            tok, slot = torch.where(idx == e)
            w_gu, w_down = self.weights(e, x.dtype)
            gate_up = stable_linear(x[tok], w_gu, self.gate_up_bias[e], self.row_stable)
            h = clamped_swiglu(gate_up, self.alpha, self.limit)
            y = stable_linear(h, w_down, self.down_bias[e], self.row_stable)
            out.index_add_(0, tok, y * weight[tok, slot, None])
        return out


class MoE(nn.Module):
    """Router (softmax over the top-k logits) feeding the experts."""

    def __init__(self, cfg: ModelConfig, packed: bool) -> None:
        super().__init__()
        self.top_k = cfg.experts_per_token
        self.router = Linear(cfg.dim, cfg.n_experts, bias=True)
        self.experts = Experts(cfg, packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, idx = torch.topk(self.router(x), self.top_k, dim=-1)  # [T, k]
        return self.experts(x, idx, torch.softmax(top, dim=-1))
