"""The draft head's attention over a session's past: training windows see what a tail's draft
rows see, the tail keeps each session's past through re-sent rounds and gaps, and a trained
head's drafts depend on that past."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specpipe.core.sampling import SamplingParams
from specpipe.drafting import train as dt
from specpipe.drafting.head import DraftHead, TailHead, TargetParts
from specpipe.drafting.head_attention import WINDOW, DraftRows, PastAttention
from specpipe.transformer.resolve import load_stage, open_checkpoint
from tests.swarmprocs import write_tiny_model


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    tiny = write_tiny_model(tmp_path_factory.mktemp("attention") / "tiny")
    checkpoint = open_checkpoint(tiny)
    return load_stage(checkpoint, 0, checkpoint.config.n_layers, pack=False, row_stable=False)


@pytest.fixture(scope="module")
def data(stage):
    rng = np.random.default_rng(3)
    jobs = [
        dt.Continuation(rng.integers(3, 90, size=n).tolist(), 70 + i, t)
        for i, (n, t) in enumerate(((6, 0.9), (8, 0.0), (5, 1.0)))
    ]
    return dt.generate(stage, jobs, 0.95, max_new=30, width=3)


def test_training_windows_attend_what_a_tails_draft_rows_attend():
    torch.manual_seed(0)
    layer = PastAttention(32, 4)
    torch.nn.init.normal_(layer.out.weight, std=0.2)
    x1, x2, x3 = torch.randn(3, 1, 10, 32)  # real pairs, then the head's steps 2 and 3
    out1, real = layer.attend_window(x1, 1)
    out2, own2 = layer.attend_window(x2, 2, real, [])
    out3, _ = layer.attend_window(x3, 3, real, [own2])
    start = 500  # a tail's positions are absolute: only distances count
    for t in (0, 4, 9):
        past = layer.remember(None, x1[0, :t], start) if t else None
        rows = DraftRows(past, start + t)
        got1, rows.own = layer.attend_rows(x1[0, t : t + 1], rows)
        rows.position += 1
        got2, rows.own = layer.attend_rows(x2[0, t : t + 1], rows)
        rows.position += 1
        got3, rows.own = layer.attend_rows(x3[0, t : t + 1], rows)
        torch.testing.assert_close(got1[0], out1[0, t])
        torch.testing.assert_close(got2[0], out2[0, t])
        torch.testing.assert_close(got3[0], out3[0, t])
    # A row that attends nothing before it is not the row that attends its past.
    alone, _ = layer.attend_rows(x1[0, 9:10], DraftRows(None, start + 9))
    assert not torch.allclose(alone[0], out1[0, 9])


def test_a_sessions_past_survives_a_resent_round_and_is_dropped_at_a_gap():
    torch.manual_seed(1)
    layer = PastAttention(32, 2)
    pairs = torch.randn(12, 32)
    past = layer.remember(None, pairs[:5], 40)  # positions 40 … 44
    past = layer.remember(past, pairs[5:8], 45)
    whole = layer.remember(None, pairs[:8], 40)
    torch.testing.assert_close(past.keys, whole.keys)
    assert past.next_pos == 48 and len(past) == 8
    # The round from 45 sent again with other tokens: its pairs replace the old ones.
    again = layer.remember(past, pairs[8:11], 45)
    expected = layer.remember(layer.remember(None, pairs[:5], 40), pairs[8:11], 45)
    torch.testing.assert_close(again.values, expected.values)
    assert again.next_pos == 48
    # Rounds missed (a new tail after a failover): what came before is no longer known.
    gap = layer.remember(again, pairs[11:], 60)
    assert len(gap) == 1 and gap.next_pos == 61
    assert len(gap.before(60)) == 0 and gap.before(62) is None  # 61 was never seen
    assert len(again.before(46)) == 6
    # Only the last WINDOW pairs are kept.
    long = layer.remember(None, torch.randn(WINDOW + 9, 32), 0)
    assert len(long) == WINDOW and long.next_pos == WINDOW + 9


@pytest.fixture(scope="module")
def trained(stage, data):
    parts = dt.training_parts(stage)
    head, losses = dt.train_head(
        parts, data, steps=60, batch=128, lr=3e-3, hidden=64, heads=2, window=12
    )
    return head, losses


def test_a_head_with_attention_learns_and_keeps_its_heads_in_its_file(
    stage, data, trained, tmp_path
):
    head, losses = trained
    assert head.heads == 2 and np.mean(losses[-5:]) < 0.7 * np.mean(losses[:3])
    meta = {"model": "tiny", "dim": stage.cfg.dim, "vocab": stage.cfg.vocab_size}
    head.save(tmp_path / "h.safetensors", meta)
    loaded, _ = DraftHead.load(tmp_path / "h.safetensors")
    assert (loaded.heads, loaded.window, loaded.attention.window) == (2, 12, 12)
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.half().float())


def test_a_tail_head_drafts_from_the_sessions_past(stage, data, trained):
    head, _ = trained
    tail = TailHead(head, TargetParts.from_stage(stage))
    params = SamplingParams(temp=0.0)
    start = data.starts[1]
    tokens, features = data.tokens, data.features
    # The session committed the sequence's first 20 tokens, in rounds of 3 or so.
    first_pos = int(data.positions[start]) + 1
    for a in range(0, 20, 3):
        b = min(a + 3, 20)
        tail.remember(
            "s",
            features[start + a : start + b],
            tokens[start + a + 1 : start + b + 1],
            first_pos + a,
        )
    token_pos = first_pos + 19
    h, token = features[start + 19], int(tokens[start + 20])
    drafts = tail.drafts_after("s", h, token, token_pos, 4, params)
    with torch.inference_mode():  # written out: the past before the root, then each step
        pairs = head.pair(
            features[start : start + 19],
            tail.parts.embed(torch.as_tensor(tokens[start + 1 : start + 20])),
        )
        rows = DraftRows(head.attention.remember(None, pairs, first_pos), token_pos)
        expected, feature = [], h[None]
        for j in range(4):
            rows.position = token_pos + j
            feature, logits = head.step(tail.parts, feature, torch.tensor([token]), rows)
            token = int(
                head.token_ids()[logits[0].argmax()]
                if head.vocab is not None
                else logits[0].argmax()
            )
            expected.append(token)
    assert drafts == expected
    # The past matters: without it (a session the tail has not seen) the head drafts otherwise
    # somewhere along the sequence.
    differs = 0
    for t in range(5, 20):
        tail.forget("s")
        tail.remember(
            "s", features[start : start + t], tokens[start + 1 : start + t + 1], first_pos
        )
        h, token = features[start + t], int(tokens[start + t + 1])
        with_past = tail.drafts_after("s", h, token, first_pos + t, 3, params)
        tail.forget("s")
        differs += with_past != tail.drafts_after("s", h, token, first_pos + t, 3, params)
    assert differs > 0


def test_evaluation_gives_a_head_with_attention_its_sequences_past(stage, data, trained):
    head, _ = trained
    parts = dt.training_parts(stage)
    scores = dt.evaluate(head, parts, data, 3, SamplingParams(temp=0.0))
    rows = dt.round_rows(data, 3)
    assert scores["rounds"] == len(rows)
    drafts, _, _ = dt.head_drafts(head, parts, data, rows[::9], 3, SamplingParams(temp=0.0))
    tail = TailHead(head, TargetParts.from_stage(stage))
    for row, got in zip(rows[::9], drafts, strict=True):  # as a tail with the same past drafts
        start = int(data.starts[np.searchsorted(data.starts, row, side="right") - 1])
        first_pos = int(data.positions[start]) + 1
        tail.forget("e")
        if row > start:
            tail.remember(
                "e", data.features[start:row], data.tokens[start + 1 : row + 1], first_pos
            )
        position = int(data.positions[row]) + 1
        expected = tail.drafts_after(
            "e",
            data.features[row],
            int(data.tokens[row + 1]),
            position,
            3,
            SamplingParams(temp=0.0),
        )
        assert got.tolist() == expected


@pytest.mark.parametrize("params", [SamplingParams(temp=0.0), SamplingParams(0.9, 0.95)])
def test_a_trees_walk_follows_the_targets_tokens_through_the_heads_candidates(
    stage, data, trained, params
):
    head, _ = trained
    parts = dt.training_parts(stage)
    rows = dt.round_rows(data, 3)
    ranks = dt.path_ranks(head, parts, data, rows, 3, params)
    # Rank 0 all the way is the chain: its drafts accepted, exactly.
    drafts, _, _ = dt.head_drafts(head, parts, data, rows, 3, params)
    truth = np.stack([data.tokens[rows + 1 + j] for j in (1, 2, 3)], axis=1)
    assert np.array_equal(np.cumprod(ranks == 0, axis=1), np.cumprod(drafts == truth, axis=1))
    # A walk that stops stays stopped, and the walk takes a sibling somewhere.
    assert not ((ranks[:, :-1] < 0) & (ranks[:, 1:] >= 0)).any()
    assert (ranks > 0).any()
    scores = dt.evaluate(head, parts, data, 3, params)["head_trees"]
    chain = dt.score(drafts == truth).tokens_per_round(3)
    assert scores["any"] >= max(v for n, v in scores.items() if n != "any") - 1e-9
    assert scores["any"] > chain
