"""Training an EAGLE-3 head on a tiny model: the taps it learns from, the training-time test
against drafting at the tail, its folder, and `specpipe drafter train --eagle3` / `eval`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from specpipe.cli import cli
from specpipe.core.sampling import SamplingParams
from specpipe.drafting import train as dt
from specpipe.drafting import train_eagle3 as e3
from specpipe.drafting.eagle3_drafter import Eagle3Drafter
from specpipe.drafting.eagle3_format import load_eagle3
from specpipe.transformer.resolve import load_stage, open_checkpoint
from tests.swarmprocs import write_tiny_model

SAMPLED = SamplingParams(temp=0.8, top_p=0.9)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("eagle3-train") / "tiny")


@pytest.fixture(scope="module")
def stage(tiny):
    checkpoint = open_checkpoint(tiny)
    return load_stage(checkpoint, 0, checkpoint.config.n_layers, pack=False, row_stable=False)


@pytest.fixture(scope="module")
def settings(stage):
    return e3.head_settings(stage.cfg, draft_vocab=40, intermediate=48)


@pytest.fixture(scope="module")
def data(stage, settings):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 90, size=n).tolist() for n in (5, 9, 6, 12)]
    jobs = [
        dt.Continuation(p, 70 + i, t)
        for i, (p, t) in enumerate(zip(prompts, (0.8, 0.0, 1.0, 0.7), strict=True))
    ]
    return dt.generate(stage, jobs, 0.9, max_new=20, width=3, taps=settings.taps)


def trained_a_little(stage, settings, data, seed: int = 0):
    """A head from `new_head`, its layer's weights stirred so that every part of it counts."""
    parts = dt.training_parts(stage)
    vocab = torch.arange(0, 2 * settings.draft_vocab, 2)  # every other token
    head = e3.new_head(settings, parts, vocab)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, weight in head.named_parameters():
            if name.endswith("proj.weight") or name == "fc.weight":
                weight.add_(torch.randn_like(weight) * 0.05)
    return head.eval(), parts


def test_the_taps_are_the_states_entering_the_tapped_layers(tiny, stage, settings, data):
    from transformers import AutoModelForCausalLM

    assert settings.taps == (1, 2)  # a 4-layer model's 2, 2 and 1, once each, in order
    reference = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    for i, start in enumerate(data.starts):
        length = int(data.left[start]) + 1
        ids = data.prompts[i][:-1] + data.tokens[start : start + length].tolist()
        with torch.no_grad():
            states = reference(torch.tensor([ids]), output_hidden_states=True).hidden_states
        n = len(data.prompts[i]) - 1  # the sequence's first row is the prompt's last token
        # transformers' hidden_states[k]: the state entering layer k
        want = torch.cat([states[k][0, n : n + length] for k in settings.taps], dim=-1)
        got = data.taps[start : start + length].float()
        assert torch.allclose(got, want, atol=1e-2 * float(want.abs().max())), i
    assert data.taps.shape == (len(data), len(settings.taps) * stage.cfg.dim)
    assert data.taps.dtype == torch.float16


def test_the_training_time_test_is_drafting_at_the_tail(stage, settings, data):
    # Every depth's output of every row equals what the tail's drafter computes after the same
    # committed rows, fed the same tokens: training sees what drafting does.
    head, parts = trained_a_little(stage, settings, data)
    drafter = Eagle3Drafter(head, parts)
    starts = [data.starts[0], data.starts[3]]
    outputs = e3.ttt_outputs(head, parts, data, starts, steps=3)
    checked = 0
    for b, start in enumerate(starts):
        end = start + int(data.left[start]) + 1
        drafter.remember(
            "s",
            data.taps[start : end - 1].float(),
            data.tokens[start + 1 : end].tolist(),
            int(data.positions[start]) + 1,
        )
        for j in range(0, end - start - 4, 3):
            row = start + j
            position = int(data.positions[row])
            past = drafter.past_before("s", position)
            g, token = head.fuse(data.taps[row : row + 1].float()), int(data.tokens[row + 1])
            for d, (out, nxt, counts) in enumerate(outputs):
                with torch.no_grad():
                    chain, past = head(g, drafter.embed([token]), position + d, past)
                assert bool(counts[b, j]) and int(nxt[b, j]) == row + 1 + d
                assert torch.allclose(out[b, j], chain[0], atol=1e-4), (b, j, d)
                g, token = head.feed_back(chain), int(data.tokens[row + 2 + d])
                checked += 1
        drafter.forget("s")
    assert checked >= 12


def test_a_chains_walk_is_what_the_tail_drafts(stage, settings, data):
    # Rank 0 along the target's tokens is the drafter's own coupled chain agreeing with them.
    head, parts = trained_a_little(stage, settings, data, seed=1)
    # Make the head agree often: read the deepest tap through the target's own head.
    drafter = Eagle3Drafter(head, parts)
    rows = dt.round_rows(data, 3)
    ranks = e3.walk_ranks(drafter, data, rows, 3, SAMPLED)
    agreed = 0
    for n, row in enumerate(rows):
        start = data.starts[int(np.searchsorted(data.starts, row, side="right")) - 1]
        drafter.remember(
            "t",
            data.taps[start:row].float(),
            data.tokens[start + 1 : row + 1].tolist(),
            int(data.positions[start]) + 1,
        )
        seeded = SamplingParams(SAMPLED.temp, SAMPLED.top_p, 0, int(data.seeds[row]))
        drafts = drafter.drafts_after(
            "t",
            data.taps[row].float(),
            int(data.tokens[row + 1]),
            int(data.positions[row]) + 1,
            3,
            seeded,
        )
        drafter.forget("t")
        truth = data.tokens[row + 2 : row + 5].tolist()
        through = np.cumprod([a == b for a, b in zip(drafts, truth, strict=True)])
        assert through.tolist() == np.cumprod(ranks[n] == 0).tolist(), (n, drafts, truth, ranks[n])
        agreed += int(through[0])
    assert 0 < agreed < len(rows)  # both kinds of round were checked


def test_training_lowers_the_loss(stage, settings, data):
    parts = dt.training_parts(stage)
    head, losses = e3.train_eagle3(settings, parts, data, steps=30, sequences=2, lr=3e-3)
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:3])
    assert not any(p.requires_grad for p in stage.parameters())  # the target stays frozen
    ids = head.token_ids()
    assert len(set(ids.tolist())) == settings.draft_vocab and ids.max() < stage.cfg.vocab_size


def test_a_head_round_trips_through_its_folder(tmp_path, stage, settings, data):
    head, parts = trained_a_little(stage, settings, data)
    folder = e3.save_head(head, stage.cfg, tmp_path / "head", {"seed": 5})
    loaded = load_eagle3(folder, stage.cfg.dim, stage.cfg.vocab_size, stage.cfg.n_layers)
    assert loaded.cfg.taps == settings.taps and loaded.cfg.draft_vocab == settings.draft_vocab
    assert (loaded.token_ids() == head.token_ids()).all()
    g = head.fuse(data.taps[:6].float())
    embeds = parts.embed(torch.as_tensor(data.tokens[1:7])).float()
    with torch.no_grad():
        want = head.to(torch.bfloat16).float().logits(head(g, embeds, 3)[0])
        got = loaded.logits(loaded(g, embeds, 3)[0])
    assert torch.allclose(got, want, atol=1e-3 * float(want.abs().max()))
    assert e3.head_meta(folder) == {"seed": 5}


def test_drafter_train_and_eval_an_eagle3_head(tmp_path, tiny):
    out = tmp_path / "tiny-eagle3"
    args = ["--model", str(tiny), "--tokens", "64", "--steps", "4", "--threads", "1"]
    result = CliRunner().invoke(
        cli, ["drafter", "train", "--eagle3", *args, "--draft-vocab", "32", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert (out / "config.json").exists() and e3.head_meta(out)["seed"] == 0
    assert "--eagle3" in e3.head_meta(out)["command"]
    report = tmp_path / "eval.json"
    result = CliRunner().invoke(
        cli,
        [
            "drafter",
            "eval",
            "--model",
            str(tiny),
            "--head",
            str(out),
            "--tokens",
            "12",
            "--k",
            "3",
            "--threads",
            "1",
            "--json",
            str(report),
        ],
    )
    assert result.exit_code == 0, result.output
    scores = json.loads(report.read_text())["modes"]["greedy"]
    assert scores["rounds"] > 0 and set(scores) >= {"head", "ngram", "both", "head_trees"}
    chain = scores["head"]["tokens_per_round"]
    assert 1.0 <= chain["1"] <= chain["3"] <= 4.0
    # Today's head's options do not shape an EAGLE-3 head: one line, nothing written.
    result = CliRunner().invoke(
        cli, ["drafter", "train", "--eagle3", *args, "--heads", "2", "--out", str(tmp_path / "x")]
    )
    assert result.exit_code == 2 and "--heads and --window" in result.output
    assert not (tmp_path / "x").exists()
    # Trained again into its folder (on main click refused an existing folder for --out), and
    # never into a file.
    again = [*args[:5], "1", *args[6:], "--seed", "3"]
    result = CliRunner().invoke(cli, ["drafter", "train", "--eagle3", *again, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert e3.head_meta(out)["seed"] == 3
    (tmp_path / "a-file").write_text("")
    result = CliRunner().invoke(
        cli, ["drafter", "train", "--eagle3", *args, "--out", str(tmp_path / "a-file")]
    )
    assert result.exit_code == 2 and "exists and is not a folder" in result.output
