"""The KV cache by absolute position: growth, truncation by append, gaps, sliding windows."""

from __future__ import annotations

import pytest
import torch

from specpipe.core.ring import GapError
from specpipe.transformer import kvcache
from specpipe.transformer.kvcache import LayerCache, SessionCache


def _kv(start: int, n: int) -> torch.Tensor:
    """Keys whose values are their absolute positions: [1, n, 2]."""
    return torch.arange(start, start + n, dtype=torch.float32).view(1, n, 1).expand(1, n, 2)


def test_grows_and_truncates_by_position():
    cache = LayerCache(1, 2, torch.float32, "cpu", capacity=4)
    cache.append(_kv(0, 3), _kv(0, 3), 0)
    keys, values, first = cache.append(_kv(3, 6), _kv(3, 6), 3)  # past the capacity
    assert first == 0 and keys[0, :, 0].tolist() == list(range(9))
    keys, _, _ = cache.append(_kv(100, 2), _kv(100, 2), 5)  # roll back to 5, then append
    assert keys[0, :, 0].tolist() == [0, 1, 2, 3, 4, 100, 101] and cache.end == 7


def test_gap_is_one_comparison():
    cache = LayerCache(1, 2, torch.float32, "cpu")
    cache.append(_kv(0, 3), _kv(0, 3), 0)
    with pytest.raises(GapError, match="position 4 is beyond the cache"):
        cache.append(_kv(4, 1), _kv(4, 1), 4)
    session = SessionCache([cache])
    session.length = 3
    session.check(3)
    with pytest.raises(GapError):
        session.check(4)


def test_sliding_window_forgets_in_blocks(monkeypatch):
    monkeypatch.setattr(kvcache, "SLIDING_SLACK", 2)
    monkeypatch.setattr(kvcache, "FORGET_BLOCK", 4)
    cache = LayerCache(1, 2, torch.float32, "cpu", window=3, capacity=2)
    for p in range(40):
        keys, _, first = cache.append(_kv(p, 1), _kv(p, 1), p)
        assert first % 4 == 0
        held = keys[0, :, 0].tolist()
        assert held == list(range(first, p + 1))
        assert first <= max(0, p - 3 + 1 - 2)  # the window and the slack are always kept
        assert len(held) <= 3 + 2 + 2 * 4
    cache.append(_kv(37, 1), _kv(37, 1), 37)  # a short rollback is fine
    with pytest.raises(GapError, match="rolls back past the sliding-window cache"):
        cache.append(_kv(5, 1), _kv(5, 1), 5)
