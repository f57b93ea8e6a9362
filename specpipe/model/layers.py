"""The Llama-family building blocks: RMSNorm, half-split RoPE, grouped-query attention, SwiGLU.

Every tensor here is one sequence: hidden states are [T, D] (no batch dimension), attention heads
are [H, T, hd]. Attention reads keys and values from a `LayerCache` addressed by absolute
position, so the same code runs a prefill, a single decode step and a K-token verify.

Row stability: the logits at a position must be the same numbers whether it is computed alone (a
plain decode step) or among K drafts (a verify), or speculative and plain sampling could commit
different tokens. Linear layers on the CPU hold their weight packed in oneDNN's blocked layout
(`Linear.pack`): its kernels give every row the same numbers for any number of rows from 2 up,
and a few rows cost about what one does. Packing checks this on each weight and keeps the plain
weight where it does not hold. Unpacked products go through BLAS, whose kernel (and rounding)
depends on the number of rows in ways that differ between CPUs; so they run in blocks of exactly
`BLAS_ROWS` rows, the last one padded. Attention's products pad to at least `MIN_ROWS` rows. It
also depends on the number of keys S, which differs between a verify and a step; its kernels
agree on every row once S is at least `MIN_KEYS`, so short contexts pad the keys (masked), and
gpt-oss's sink logit goes first, at a fixed index, rather than after the keys. `row_stable=False`
on the stage turns all of this off, and a verify row may then differ from a plain step in the
last bits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specpipe.model.config import ModelConfig
from specpipe.model.kvcache import LayerCache

MIN_ROWS = 4
BLAS_ROWS = 16
MIN_KEYS = 16
QUERY_CHUNK = 256


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [..., M, K] with zero rows appended up to `rows` (x itself if it has as many)."""
    pad = rows - x.shape[-2]
    return F.pad(x, (0, 0, 0, pad)) if pad > 0 else x


def stable_linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, stable: bool = True
) -> torch.Tensor:
    """F.linear on [M, K] whose every row is the same numbers for any M: the rows go through
    BLAS in blocks of exactly `BLAS_ROWS` (unless `stable` is False)."""
    M = x.shape[-2]
    if not stable:
        return F.linear(x, w, b)
    padded = _padded(x, -(-M // BLAS_ROWS) * BLAS_ROWS)
    blocks = [F.linear(block, w, b) for block in padded.split(BLAS_ROWS, dim=-2)]
    return torch.cat(blocks, dim=-2)[..., :M, :]


def stable_bmm(a: torch.Tensor, b: torch.Tensor, min_rows: int = MIN_ROWS) -> torch.Tensor:
    """a @ b for [B, M, K] x [B, K, N] whose every row is the same numbers for any M."""
    M = a.shape[-2]
    if M >= min_rows:
        return a @ b
    return (_padded(a, min_rows) @ b)[..., :M, :]


# Rows at which `pack_weight` checks that a packed product agrees with its longest one.
PROBE_ROWS = (MIN_ROWS, 5, 9, 17, 64)


def pack_weight(w: torch.Tensor) -> torch.Tensor | None:
    """w [N, K] in oneDNN's blocked layout, or None where packing is unavailable or the packed
    product would not give every row the same numbers for any number of rows from MIN_ROWS up."""
    if (
        w.device.type != "cpu"
        or w.dtype not in (torch.float32, torch.bfloat16)
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach())
        probe = torch.randn(
            max(PROBE_ROWS), w.shape[1], generator=torch.Generator().manual_seed(0)
        ).to(w.dtype)
        whole = _packed_product(probe, packed, None)
        rows = (_packed_product(probe[:m], packed, None) for m in PROBE_ROWS)
        if all(torch.equal(y, whole[: y.shape[0]]) for y in rows):
            return packed
    except RuntimeError:  # a build or CPU without these kernels
        pass
    return None


def _packed_product(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None, min_rows: int = MIN_ROWS
) -> torch.Tensor:
    """F.linear on [M, K] with a weight from `pack_weight`, rows padded to at least `min_rows`."""
    M = x.shape[-2]
    if M >= min_rows:
        return _packed_product(x.contiguous(), packed, b)
    return _packed_product(_padded(x, min_rows), packed, b)[..., :M, :]


class Linear(nn.Linear):
    """nn.Linear through `stable_linear`, or `packed_linear` once packed."""

    row_stable = True  # see the module docstring
    packed: torch.Tensor | None = None  # set by pack(); not moved by .to()

    def pack(self) -> bool:
        """Hold the weight packed (see `pack_weight`) instead of plain; False if it stays plain."""
        packed = pack_weight(self.weight)
        if packed is None:
            return False
        self.packed = packed
        self.weight = None  # the plain copy is freed (unless another module shares it)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias, MIN_ROWS if self.row_stable else 1)
        return stable_linear(x, self.weight, self.bias, self.row_stable)


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
            from specpipe.model.gptoss import yarn_inv_freq

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
        P, H = x.shape[0], self.n_heads
        T = P if tokens is None else tokens
        qkv = self.wqkv(x).view(P, H + 2 * self.n_kv, self.hd).transpose(0, 1)  # [H+2Hkv, P, hd]
        qk = apply_rope(qkv[: H + self.n_kv], cos, sin)  # queries and keys rotate alike
        k, v = qk[H:], qkv[H + self.n_kv :]  # [Hkv, P, hd] x 2
        if T < P:
            k, v = k[:, :T], v[:, :T]
        keys, values, first = cache.append(k, v, pos)  # [Hkv, S, hd], absolute position of key 0
        if self.row_stable and keys.shape[1] < MIN_KEYS:  # padded keys lie in the future: masked
            keys, values = _padded(keys, MIN_KEYS), _padded(values, MIN_KEYS)
        # One token that sees every key needs no mask (padding rows may see what they like).
        masked = T > 1 or self.window is not None or first + keys.shape[1] > pos + T
        # Long prompts attend in chunks of queries, so the scores never outgrow [H, C, S].
        chunks = [
            self._attend(qk[:H, i : i + QUERY_CHUNK], keys, values, first, pos + i, masked)
            for i in range(0, P, QUERY_CHUNK)
        ]
        out = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)  # [H, P, hd]
        return self.wo(out.transpose(0, 1).reshape(P, self.n_heads * self.hd))

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
        if cfg.is_moe:
            from specpipe.model.gptoss import MoE

            self.mlp = MoE(cfg, packed_experts)
        else:
            self.mlp = SwiGLU(cfg)

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
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, pos, tokens)
        return x + self.mlp(self.mlp_norm(x))
