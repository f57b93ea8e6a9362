"""A tiny deterministic transformer split by layer range: a real `Stage` for swarm tests.

Weights come from fixed seeds, so every process that builds layers A:B of the same `ToyConfig`
holds the same numbers. Each layer is pre-norm causal self-attention plus an MLP; stage 0 adds
token and sinusoidal position embeddings; the tail applies a final norm and the head. The KV
cache is kept per session and addressed by absolute position: a round first truncates it to
`start_pos`, and a `start_pos` beyond it raises `GapError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from specpipe.core.ring import GapError


@dataclass(frozen=True)
class ToyConfig:
    vocab: int = 64
    dim: int = 32
    heads: int = 2
    n_layers: int = 4
    seed: int = 1234


def _init(shape: tuple[int, ...], seed: int, scale: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * scale


class ToyLayer(nn.Module):
    def __init__(self, cfg: ToyConfig, index: int) -> None:
        super().__init__()
        d, base = cfg.dim, cfg.seed + 100 * (index + 1)
        self.heads = cfg.heads
        self.qkv = nn.Parameter(_init((3 * d, d), base, 1 / math.sqrt(d)))
        self.out = nn.Parameter(_init((d, d), base + 1, 1 / math.sqrt(d)))
        self.up = nn.Parameter(_init((4 * d, d), base + 2, 1 / math.sqrt(d)))
        self.down = nn.Parameter(_init((d, 4 * d), base + 3, 1 / math.sqrt(4 * d)))

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor], start_pos: int) -> torch.Tensor:
        T, D = x.shape
        hd = D // self.heads
        q, k, v = F.linear(F.rms_norm(x, (D,)), self.qkv).split(D, dim=-1)  # (T, D) each
        keys = torch.cat([cache[0][:start_pos], k])  # (S, D), S = start_pos + T
        values = torch.cat([cache[1][:start_pos], v])
        cache[0], cache[1] = keys, values
        S = keys.shape[0]
        q = q.view(T, self.heads, hd).transpose(0, 1)  # (H, T, hd)
        keys = keys.view(S, self.heads, hd).transpose(0, 1)  # (H, S, hd)
        values = values.view(S, self.heads, hd).transpose(0, 1)
        # query i sits at absolute position start_pos + i and sees keys 0 … start_pos + i
        mask = torch.arange(S)[None, :] <= (start_pos + torch.arange(T))[:, None]
        att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        x = x + F.linear(att.transpose(0, 1).reshape(T, D), self.out)
        return x + F.linear(F.gelu(F.linear(F.rms_norm(x, (D,)), self.up)), self.down)


class ToyStage:
    """Layers `layer_start:layer_end` of the toy model, with a per-session KV cache."""

    def __init__(self, cfg: ToyConfig, layer_start: int, layer_end: int) -> None:
        assert 0 <= layer_start < layer_end <= cfg.n_layers
        self.cfg = cfg
        self.first = layer_start == 0
        self.last = layer_end == cfg.n_layers
        self.layers = [ToyLayer(cfg, i) for i in range(layer_start, layer_end)]
        if self.first:
            self.embed = _init((cfg.vocab, cfg.dim), cfg.seed, 1.0)
        if self.last:
            self.head = _init((cfg.vocab, cfg.dim), cfg.seed + 1, 2 / math.sqrt(cfg.dim))
        self.caches: dict[str, list[list[torch.Tensor]]] = {}

    def cache_len(self, session: str) -> int:
        cache = self.caches.get(session)
        return 0 if cache is None else cache[0][0].shape[0]

    @torch.no_grad()
    def forward(
        self, session: str, inputs: torch.Tensor, start_pos: int, last_rows: int | None = None
    ) -> torch.Tensor:
        have = self.cache_len(session)
        if start_pos > have:
            raise GapError(f"cache holds {have} positions, round starts at {start_pos}")
        if session not in self.caches:
            empty = torch.zeros(0, self.cfg.dim)
            self.caches[session] = [[empty, empty] for _ in self.layers]
        if self.first:
            x = self.embed[inputs] + self._positions(start_pos, inputs.shape[0])
        else:
            x = inputs.to(torch.float32)
        for layer, cache in zip(self.layers, self.caches[session], strict=True):
            x = layer(x, cache, start_pos)
        if self.last:
            return F.linear(F.rms_norm(x, (self.cfg.dim,)), self.head)  # (T, vocab) logits
        return x

    def drop(self, session: str) -> None:
        self.caches.pop(session, None)

    def held_tokens(self) -> dict[str, int]:
        return {session: self.cache_len(session) for session in self.caches}

    def _positions(self, start: int, length: int) -> torch.Tensor:
        pos = torch.arange(start, start + length, dtype=torch.float32)[:, None]
        freq = torch.exp(-math.log(10000.0) * torch.arange(0, self.cfg.dim, 2) / self.cfg.dim)
        angles = pos * freq  # (T, D/2)
        return torch.cat([angles.sin(), angles.cos()], dim=-1)
