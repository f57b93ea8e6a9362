"""gpt-oss: YaRN RoPE, the top-k router, the clamped SwiGLU experts and MXFP4 expert weights.

Attention sinks and per-layer sliding windows live in `layers.Attention` (a few lines each); what
is here is what makes gpt-oss's feed-forward a mixture of experts. MXFP4 expert weights stay packed
(two 4-bit E2M1 values per byte, one E8M0 power-of-two scale per 32 values) and one expert is
unpacked when a token is routed to it, so a 9-layer gpt-oss-120b stage fits a 24 GB GPU.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from specpipe.model.config import ModelConfig
from specpipe.model.layers import Linear, stable_linear

# The 16 E2M1 values, indexed by the 4-bit code (sign bit high).
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def yarn_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, ramp between; scale cos/sin by mscale."""
    s = cfg.rope_scaling
    hd, base = cfg.head_dim, cfg.rope_theta
    orig = s["original_max_position_embeddings"]
    factor = s.get("factor") or cfg.max_position_embeddings / orig
    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        attn_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the rotary dimension that turns `rotations` times
        return hd * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(hd // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, hd, 2, dtype=torch.float) / hd)
    keep = 1 - ramp  # 1: extrapolate (high frequency), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attn_factor)


def mxfp4_dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """[..., R, G, 16] uint8 codes and [..., R, G] uint8 exponents -> [..., R, G*32] values."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    # Low nibble first: byte b holds values 2b (low) and 2b+1 (high).
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., R, G, 32]
    values = lut[codes]
    exponent = scales.to(torch.int32) - 127
    out = torch.ldexp(values, exponent.unsqueeze(-1).to(values.device))
    return out.flatten(-2).to(dtype)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., R, C] float -> blocks [..., R, C/32, 16], scales [..., R, C/32] (nearest codes)."""
    *lead, C = w.shape
    g = w.float().reshape(*lead, C // 32, 32)
    amax = g.abs().amax(-1).clamp_min(2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # so amax / 2**e <= 6
    scaled = g / torch.exp2(exponent).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation on interleaved (gate, up) columns, both clamped to `limit`."""
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


class Experts(nn.Module):
    """E experts, each gate_up [2I, D] and down [D, I] with biases; float or MXFP4-packed."""

    row_stable = True  # see layers.py

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
