"""Rotary position embeddings: the half-split rotation, kept cos/sin tables, and the rope
scalings (linear, Llama 3, YaRN) that reshape the frequencies for longer contexts."""

from __future__ import annotations

import math

import torch
from torch import nn

from specpipe.transformer.config import ModelConfig


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3 rope scaling: slow the low frequencies by `factor`, blend the middle band."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    middle = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(middle, blended, scaled)


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


class Rotary(nn.Module):
    """cos/sin tables for absolute positions, computed once per position and kept (exact)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
        self.scale = 1.0  # YaRN scales cos/sin ("attention factor")
        rope_type = (cfg.rope_scaling or {}).get("rope_type", "default")
        if rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, cfg.rope_scaling)
        elif rope_type == "yarn":
            inv_freq, self.scale = yarn_inv_freq(cfg)
        elif rope_type not in ("default", "linear"):
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        if rope_type == "linear":
            inv_freq = inv_freq / cfg.rope_scaling["factor"]
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, start_pos: int, end_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [end_pos - start_pos, hd] in float32, computed afresh."""
        pos = torch.arange(start_pos, end_pos, device=self.inv_freq.device).float()
        freqs = pos[:, None] * self.inv_freq[None, :]  # [T, hd/2]
        cos, sin = freqs.cos() * self.scale, freqs.sin() * self.scale
        return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)

    def forward(self, start_pos: int, T: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin [T, hd] for positions start_pos…, laid out for `apply_rope`: each half of
        the head dimension gets the same angles, and sin is negated on the first half.

        Each position's angles depend on that position alone, so the tables are kept and grown
        by doubling: a decode step slices them instead of running a dozen small ops."""
        end = start_pos + T
        kept = self._tables.get(dtype)
        if kept is not None and kept[0].device != self.inv_freq.device:  # moved since
            kept = None
        have = 0 if kept is None else kept[0].shape[0]
        if end > have:
            more = [t.to(dtype) for t in self.tables(have, max(end, 2 * have, 256))]
            if kept is not None:
                more = [torch.cat(pair) for pair in zip(kept, more, strict=True)]
            kept = self._tables[dtype] = (more[0], more[1])
        cos, sin = kept
        return cos[start_pos:end], sin[start_pos:end]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [H, T, hd] by half-split pairs (i, i + hd/2), the transformers convention:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), with `Rotary`'s signed, doubled tables."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
