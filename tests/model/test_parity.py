"""Stages of every family match transformers' logits on the same weights, whole or split."""

from __future__ import annotations

import pytest
import torch

from specpipe.transformer import attention
from specpipe.transformer.checkpoint import SafetensorsCheckpoint
from specpipe.transformer.linear import Linear, pack_weight
from specpipe.transformer.rope import Rotary
from tests.model.conftest import SLIDING_WINDOW, SPLITS, hf_logits
from tests.model.helpers import load_split, run_split

FAMILIES = ["llama", "qwen2", "gptoss", "gptoss-mxfp4"]
T = 5 * SLIDING_WINDOW  # longer than gpt-oss's sliding window


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (T,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def reference(checkpoints):
    return {name: hf_logits(path, _ids()) for name, path in checkpoints.items()}


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("family", FAMILIES)
def test_split_matches_transformers(checkpoints, reference, family, split):
    stages = load_split(lambda: SafetensorsCheckpoint(checkpoints[family]), SPLITS[split])
    logits = run_split(stages, "s", _ids(), 0)
    want = reference[family]
    assert logits.shape == want.shape and logits.dtype == torch.float32
    assert want.abs().max() > 1.0  # the comparison is not between near-zero numbers
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)
    assert torch.equal(logits.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_decoding_with_rollback(checkpoints, reference, family):
    """Prefill, single steps, a verify of 4, a rollback of 3 and re-append = one full forward."""
    stages = load_split(lambda: SafetensorsCheckpoint(checkpoints[family]), [2, 2])
    ids, want = _ids(), reference[family]
    rows = {}
    rows.update(enumerate(run_split(stages, "s", ids[:6], 0), start=0))
    for p in range(6, 9):
        rows[p] = run_split(stages, "s", ids[p : p + 1], p)[0]
    # A verify round whose last three drafts are wrong: garbage tokens at 10..12.
    wrong = torch.tensor([ids[9].item(), 1, 2, 3])
    got = run_split(stages, "s", wrong, 9)
    rows[9] = got[0]
    # Roll back to 10 and continue with the true tokens, in rounds of uneven length.
    for lo, hi in ((10, 11), (11, 15), (15, T)):
        rows.update(enumerate(run_split(stages, "s", ids[lo:hi], lo), start=lo))
    logits = torch.stack([rows[p] for p in range(T)])
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)


def test_sessions_are_independent_and_droppable(checkpoints, reference):
    stages = load_split(lambda: SafetensorsCheckpoint(checkpoints["llama"]), [4])
    other = _ids(seed=5)
    run_split(stages, "a", _ids()[:7], 0)
    run_split(stages, "b", other, 0)
    tail = run_split(stages, "a", _ids()[7:], 7)
    torch.testing.assert_close(tail, reference["llama"][7:], atol=1e-4, rtol=0)
    stages[0].drop("a")
    assert "a" not in stages[0].sessions and "b" in stages[0].sessions


def test_gap_is_reported(checkpoints):
    from specpipe.core.ring import GapError

    (stage,) = load_split(lambda: SafetensorsCheckpoint(checkpoints["qwen2"]), [4])
    stage.forward("s", _ids()[:4], 0)
    with pytest.raises(GapError):
        stage.forward("s", _ids()[5:6], 5)
    with pytest.raises(GapError):
        stage.forward("new", _ids()[:1], 3)
    assert set(stage.sessions) == {"s"} and stage.sessions["s"].length == 4


def test_sliding_window_cache_forgets_old_positions(checkpoints, reference):
    """A long gpt-oss session keeps only window + slack positions in its sliding layers."""
    from specpipe.core.ring import GapError
    from specpipe.transformer import kvcache

    (stage,) = load_split(lambda: SafetensorsCheckpoint(checkpoints["gptoss"]), [4])
    slack, kvcache.SLIDING_SLACK = kvcache.SLIDING_SLACK, 2
    block, kvcache.FORGET_BLOCK = kvcache.FORGET_BLOCK, 2
    try:
        ids = _ids()
        rows = [stage.forward("s", ids[p : p + 1], p)[0] for p in range(T)]
        torch.testing.assert_close(torch.stack(rows), reference["gptoss"], atol=1e-4, rtol=0)
        sliding, full = stage.sessions["s"].layers[0], stage.sessions["s"].layers[1]
        assert sliding.first > 0 and full.first == 0
        with pytest.raises(GapError):
            stage.forward("s", ids[:1], 1)  # far behind what the sliding layer keeps
    finally:
        kvcache.SLIDING_SLACK, kvcache.FORGET_BLOCK = slack, block


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_close(checkpoints, reference, dtype):
    """In half precision the stages stray from float32 no more than transformers does."""
    theirs = hf_logits(checkpoints["llama"], _ids(), dtype)
    stages = load_split(lambda: SafetensorsCheckpoint(checkpoints["llama"]), [2, 2], dtype=dtype)
    logits = run_split(stages, "s", _ids(), 0)
    wqkv = stages[0].layers[0].attn.wqkv
    weight = wqkv.weight if wqkv.packed is None else wqkv.packed  # bfloat16 packs, float16 does not
    assert weight.dtype == dtype and logits.dtype == torch.float32
    want = reference["llama"]
    ours_err, their_err = (logits - want).abs().mean(), (theirs - want).abs().mean()
    assert 0 < ours_err < 1.5 * their_err


def test_dequantise_on_load_matches_packed(checkpoints, reference):
    stages = load_split(
        lambda: SafetensorsCheckpoint(checkpoints["gptoss-mxfp4"]), [4], packed_experts=False
    )
    experts = stages[0].layers[0].mlp.experts
    assert not experts.packed and experts.gate_up.dtype == torch.float32
    logits = run_split(stages, "s", _ids(), 0)
    torch.testing.assert_close(logits, reference["gptoss-mxfp4"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "blas"])
@pytest.mark.parametrize("family", FAMILIES)
def test_verify_rows_equal_single_steps_exactly(checkpoints, family, pack):
    """A position's logits are the same numbers in a K+1 verify as in a one-token step."""
    stages = load_split(lambda: SafetensorsCheckpoint(checkpoints[family]), [1, 3], pack=pack)
    linears = [m for s in stages for m in s.modules() if isinstance(m, Linear)]
    assert all((m.packed is not None) == pack for m in linears)
    ids = _ids(seed=3)
    run_split(stages, "one", ids[:3], 0)
    single = torch.cat([run_split(stages, "one", ids[p : p + 1], p) for p in range(3, T)])
    run_split(stages, "many", ids[:3], 0)
    chunks = [run_split(stages, "many", ids[p : p + 9], p) for p in range(3, T, 9)]
    assert torch.equal(torch.cat(chunks), single)


def test_packing_frees_the_plain_weights_and_keeps_the_numbers(checkpoints, reference):
    """Packed stages hold no plain copy of a linear weight and agree with the BLAS path."""
    plain = load_split(lambda: SafetensorsCheckpoint(checkpoints["llama"]), [4], pack=False)
    packed = load_split(lambda: SafetensorsCheckpoint(checkpoints["llama"]), [4])
    linears = [m for m in packed[0].modules() if isinstance(m, Linear)]
    assert linears and all(m.weight is None and m.packed is not None for m in linears)
    assert "layers.0.attn.wqkv.weight" not in packed[0].state_dict()
    ours = run_split(packed, "s", _ids(), 0)
    torch.testing.assert_close(ours, run_split(plain, "s", _ids(), 0), atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, reference["llama"], atol=1e-4, rtol=0)


def test_pack_weight_keeps_what_it_cannot_pack():
    assert pack_weight(torch.randn(8, 4, dtype=torch.float16)) is None
    assert pack_weight(torch.randn(8, 4, device="meta")) is None
    packed = pack_weight(torch.randn(8, 4))
    assert packed is not None and packed.is_mkldnn


def test_row_stability_can_be_turned_off(checkpoints, reference):
    stages = load_split(lambda: SafetensorsCheckpoint(checkpoints["llama"]), [4], row_stable=False)
    assert stages[0].layers[0].attn.wqkv.row_stable is False
    rows = [run_split(stages, "s", _ids()[p : p + 1], p)[0] for p in range(T)]
    torch.testing.assert_close(torch.stack(rows), reference["llama"], atol=1e-4, rtol=0)


def test_wrong_inputs_are_refused(checkpoints):
    first, tail = load_split(lambda: SafetensorsCheckpoint(checkpoints["llama"]), [2, 2])
    with pytest.raises(ValueError, match="token ids"):
        first.forward("s", torch.randn(3, 64), 0)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 97\)"):
        first.forward("s", torch.tensor([5, 97]), 0)
    with pytest.raises(ValueError, match=r"hidden states \[T, 64\]"):
        tail.forward("s", torch.tensor([1, 2]), 0)
    assert "s" not in first.sessions and "s" not in tail.sessions  # nothing changed


def test_chunked_attention_and_last_rows(checkpoints, reference, monkeypatch):
    """Queries attended in chunks give the same numbers; the tail can return only its last rows."""
    for family in ("llama", "gptoss-mxfp4"):
        (stage,) = load_split(lambda f=family: SafetensorsCheckpoint(checkpoints[f]), [4])
        whole = stage.forward("a", _ids(), 0)
        monkeypatch.setattr(attention, "QUERY_CHUNK", 3)
        chunked = stage.forward("b", _ids(), 0)
        monkeypatch.undo()
        assert torch.equal(chunked, whole)
        torch.testing.assert_close(chunked, reference[family], atol=1e-4, rtol=0)
        tail = stage.forward("c", _ids(), 0, last_rows=5)
        assert torch.equal(tail, whole[-5:])
        assert stage.sessions["c"].length == T  # every position is still cached


@pytest.mark.parametrize("family", ["llama", "qwen2", "gptoss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_rope_tables_equal_fresh_ones_bit_for_bit(checkpoints, family, dtype):
    """A decode step slices the kept tables; every slice must be what computing that range
    afresh gives, across the tables' growth (llama3 scaling, plain, YaRN)."""
    rotary = Rotary(SafetensorsCheckpoint(checkpoints[family]).config)
    for start, length in [(0, 1), (5, 3), (250, 9), (255, 2), (600, 1), (1000, 40), (3, 700)]:
        cos, sin = rotary(start, length, dtype)
        fresh = [t.to(dtype) for t in rotary.tables(start, start + length)]
        assert cos.shape == (length, rotary.inv_freq.shape[0] * 2)
        assert torch.equal(cos, fresh[0]) and torch.equal(sin, fresh[1])
    assert rotary(0, 1, dtype)[0].shape[0] == 1
