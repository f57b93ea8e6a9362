"""KV cache addressed by absolute position: truncation is a length reset, a gap one comparison.

A `LayerCache` holds keys and values for the absolute positions `[first, end)` of one layer of one
session, in a buffer that grows by doubling. Appending at `pos` first forgets everything from
`pos` on, which is how rejected drafts roll back. A sliding-window layer also forgets positions no
query can see any more, keeping `slack` extra positions so that a rollback of up to `slack`
tokens still finds what it needs; a deeper rollback is a gap.
"""

from __future__ import annotations

import torch

from specpipe.core.ring import GapError

SLIDING_SLACK = 64  # positions kept beyond a sliding window: the deepest rollback it survives
# Forgetting happens in whole blocks, so the first key held sits at a multiple of this whatever the
# rounds were: attention sums keys in the same lanes in a verify and in a plain step.
FORGET_BLOCK = 256


def bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, element_size: int) -> int:
    """What one position of a session's cache takes across `n_layers` layers: keys and values."""
    return 2 * n_layers * n_kv_heads * head_dim * element_size


class LayerCache:
    def __init__(
        self,
        n_kv: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        window: int | None = None,
        capacity: int = 256,
        first: int = 0,
    ) -> None:
        self.window = window
        self.k = torch.empty(n_kv, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.first = first  # absolute position held in slot 0
        self.end = first  # one past the last absolute position held
        # A draft tree's keys and values [Hkv, R, hd] and its root's position, held apart until
        # the rows of its accepted path are known (`keep`).
        self.pending: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: int) -> tuple[torch.Tensor, ...]:
        """Store k, v [Hkv, T, hd] at positions pos…; return all keys, values and `first`."""
        self.check(pos)
        T = k.shape[1]
        if self.window is not None:
            self._forget_before(pos - self.window + 1 - SLIDING_SLACK)
        need = pos + T - self.first
        if need > self.k.shape[1]:
            self._grow(need)
        lo = pos - self.first
        self.k[:, lo : lo + T] = k
        self.v[:, lo : lo + T] = v
        self.end = pos + T
        n = self.end - self.first
        return self.k[:, :n], self.v[:, :n], self.first

    def keep(self, rows: list[int]) -> None:
        """Store the pending tree's `rows` (an accepted path, root first) at its root's position
        on, as if they had been appended one after another."""
        if self.pending is None:
            raise GapError("no draft tree is waiting for its path here")
        k, v, pos = self.pending
        index = torch.tensor(rows, device=k.device)
        self.append(k[:, index], v[:, index], pos)
        self.pending = None

    def copy(self, end: int) -> LayerCache:
        """A cache of its own holding this one's positions before `end` (none once a sliding
        window forgot them: continuing at `end` is then a gap)."""
        n = max(min(end, self.end) - self.first, 0)
        n_kv, _, head_dim = self.k.shape
        copied = LayerCache(
            n_kv, head_dim, self.k.dtype, self.k.device, self.window, max(n, 1), self.first
        )
        copied.k[:, :n] = self.k[:, :n]
        copied.v[:, :n] = self.v[:, :n]
        copied.end = self.first + n
        return copied

    def check(self, pos: int) -> None:
        """Raise GapError unless this layer can continue from `pos`."""
        if pos > self.end:
            raise GapError(f"position {pos} is beyond the cache (it ends at {self.end})")
        if self.window is not None and max(0, pos - self.window + 1) < self.first:
            raise GapError(f"position {pos} rolls back past the sliding-window cache")

    def _grow(self, need: int) -> None:
        capacity = max(need, 2 * self.k.shape[1])
        n = self.end - self.first
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], capacity, old.shape[2])
            new[:, :n] = old[:, :n]
            setattr(self, name, new)

    def _forget_before(self, pos: int) -> None:
        pos = min(pos, self.end) // FORGET_BLOCK * FORGET_BLOCK
        drop = pos - self.first
        if drop <= 0:
            return
        n = self.end - self.first - drop
        # Shift down only once the dropped prefix is as long as what stays, so shifting is cheap.
        if drop < max(n, 1):
            return
        self.k[:, :n] = self.k[:, drop : drop + n].clone()
        self.v[:, :n] = self.v[:, drop : drop + n].clone()
        self.first += drop


class SessionCache:
    """Every layer's cache for one session, and the length they share."""

    def __init__(self, layers: list[LayerCache]) -> None:
        self.layers = layers
        self.length = 0
        # After a draft tree's round: each of its rows' path from the root, until `keep_path`.
        self.tree: tuple[tuple[int, ...], ...] | None = None

    def check(self, start_pos: int) -> None:
        """Raise GapError when `start_pos` is beyond what this session holds."""
        if start_pos > self.length or start_pos < 0:
            raise GapError(f"start_pos {start_pos} is beyond the cache (length {self.length})")
        for layer in self.layers:
            layer.check(start_pos)

    def copy(self, length: int) -> SessionCache:
        """A session cache of its own holding this one's first `length` positions (at most
        what it holds); a pending draft tree is not copied."""
        copied = SessionCache([layer.copy(length) for layer in self.layers])
        copied.length = min(length, self.length)
        return copied

    def nbytes(self) -> int:
        return sum(c.k.numel() * c.k.element_size() * 2 for c in self.layers)
