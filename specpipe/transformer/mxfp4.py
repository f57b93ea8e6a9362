"""MXFP4, the 4-bit format of gpt-oss's expert weights: two E2M1 values per byte and one E8M0
power-of-two scale per 32 values."""

from __future__ import annotations

import torch

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
