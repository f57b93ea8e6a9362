"""The draft head on a tiny model: the data it learns from, training, drafting, its file, and
the `specpipe drafter` commands."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from specpipe.cli import cli
from specpipe.core.coupling import GumbelSampler, gumbel_draw
from specpipe.core.sampling import SamplingParams, target_probs
from specpipe.drafting import train as dt
from specpipe.drafting.head import DraftHead, DraftHeadError, TargetParts, check_fits
from specpipe.transformer.resolve import load_stage, open_checkpoint
from tests.swarmprocs import write_tiny_model

TOP_P = 0.9


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("draft") / "tiny")


@pytest.fixture(scope="module")
def stage(tiny):
    checkpoint = open_checkpoint(tiny)
    return load_stage(checkpoint, 0, checkpoint.config.n_layers, pack=False, row_stable=False)


@pytest.fixture(scope="module")
def jobs():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 90, size=n).tolist() for n in (5, 9, 6, 12)]
    return [
        dt.Continuation(p, 40 + i, t)
        for i, (p, t) in enumerate(zip(prompts, (0.8, 1.0, 0.0, 0.7), strict=True))
    ]


@pytest.fixture(scope="module")
def data(stage, jobs):
    return dt.generate(stage, jobs, TOP_P, max_new=24, width=3)


def test_the_data_is_what_plain_sampling_gives(stage, jobs, data):
    # Each sequence alone, token by token, through the Gumbel sampler at its absolute position.
    for job, start in zip(jobs, data.starts, strict=True):
        sampler = GumbelSampler(temp=job.temp, top_p=TOP_P, seed=job.seed)
        ids, session = list(job.prompt), f"solo-{job.seed}"
        logits = stage.forward(session, torch.tensor(ids), 0)[-1]
        for _ in range(24):
            ids.append(sampler.sample(logits, len(ids)))
            logits = stage.forward(session, torch.tensor(ids[-1:]), len(ids) - 1)[-1]
        stage.drop(session)
        n = len(job.prompt)
        assert data.tokens[start : start + 25].tolist() == ids[n - 1 :]
        assert data.positions[start : start + 25].tolist() == list(range(n - 1, n + 24))
    assert data.generated == 4 * 24 and len(data) == 4 * 25


def test_the_features_are_what_enters_the_final_norm(stage, data):
    # Through the target's own norm and head they give the forward's distribution back.
    logits = stage.head(stage.norm(data.features))
    top = torch.softmax(logits, dim=-1).topk(dt.TEACHER_TOP, dim=-1)
    assert torch.equal(top.indices[:, :5], data.top_ids[:, :5])
    assert torch.allclose(top.values, data.top_probs, atol=1e-5)
    # And each sequence's rows count down to its end.
    assert data.left[data.starts[1] - 1] == 0 and data.left[data.starts[1]] == 24


def test_training_lowers_the_loss(stage, data):
    parts = dt.training_parts(stage)
    head, losses = dt.train_head(parts, data, steps=40, batch=32, lr=3e-3, hidden=64)
    assert len(losses) == 40
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:3])
    assert not any(p.requires_grad for p in stage.parameters())  # the target stays frozen


def test_drafts_follow_the_heads_distribution_with_the_targets_noise(stage, data):
    parts = TargetParts.from_stage(stage)
    torch.manual_seed(0)
    head = DraftHead(stage.cfg.dim, 32)
    torch.nn.init.normal_(head.w_down.weight, std=0.5)
    h, token, pos = data.features[3], int(data.tokens[4]), int(data.positions[4])
    params = SamplingParams(temp=0.9, top_p=TOP_P, seed=123)
    drafts = head.draft(parts, h, token, pos, 4, params)
    assert len(drafts) == 4 and all(0 <= d < stage.cfg.vocab_size for d in drafts)
    # Written out: step, distribution, Gumbel draw at token_pos + j, fed back.
    with torch.inference_mode():
        feature, expected = h[None], []
        for j in range(1, 5):
            feature, logits = head.step(parts, feature, torch.tensor([token]))
            q = target_probs(logits[0].numpy(), 0.9, TOP_P)
            token = gumbel_draw(q, 123, pos + j)
            expected.append(token)
    assert drafts == expected
    greedy = head.draft(parts, h, int(data.tokens[4]), pos, 3, SamplingParams(temp=0.0))
    with torch.inference_mode():
        _, logits = head.step(parts, h[None], torch.tensor([int(data.tokens[4])]))
    assert greedy[0] == int(logits[0].argmax())


def test_a_head_round_trips_through_its_file(tmp_path, stage, data):
    parts = TargetParts.from_stage(stage)
    torch.manual_seed(1)
    head = DraftHead(stage.cfg.dim, 48)
    torch.nn.init.normal_(head.w_down.weight, std=0.3)
    meta = {
        "model": "tiny",
        "dim": stage.cfg.dim,
        "vocab": stage.cfg.vocab_size,
        "seed": 5,
        "command": "specpipe drafter train --model tiny",
    }
    head.save(tmp_path / "h.safetensors", meta)
    loaded, got = DraftHead.load(tmp_path / "h.safetensors")
    assert got == meta
    for name, tensor in head.state_dict().items():  # stored in float16
        assert torch.equal(loaded.state_dict()[name], tensor.half().float())
    params = SamplingParams(temp=0.8, seed=9)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.half().float())
    h, token = data.features[10], int(data.tokens[11])
    assert loaded.draft(parts, h, token, 30, 3, params) == head.draft(
        parts, h, token, 30, 3, params
    )
    check_fits(got, "tiny", stage.cfg.dim, stage.cfg.vocab_size)
    with pytest.raises(DraftHeadError, match="trained for model 'tiny'"):
        check_fits(got, "other", stage.cfg.dim, stage.cfg.vocab_size)


def test_a_bad_head_file_is_refused(tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(DraftHeadError, match="cannot read"):
        DraftHead.load(tmp_path / "junk.safetensors")
    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(DraftHeadError, match="not a draft head"):
        DraftHead.load(tmp_path / "other.safetensors")
    with pytest.raises(DraftHeadError, match="cannot read"):
        DraftHead.load(tmp_path / "missing.safetensors")


def test_the_default_models_head_is_a_few_megabytes():
    head = DraftHead(576, dt.HEAD_HIDDEN, heads=9)  # SmolLM2-135M's width
    assert 2 * sum(p.numel() for p in head.parameters()) < 8e6  # float16 bytes


def test_scores_and_the_ngram_drafter_on_known_text():
    matches = np.array([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=bool)
    score = dt.score(matches)
    assert score.accepted == [0.75, 0.5, 0.25]
    assert score.per_position == [0.75, 2 / 3, 0.5]
    assert score.tokens_per_round(1) == 1.75 and score.tokens_per_round(3) == 2.5
    # Text that repeats a phrase: the n-gram drafter's proposals come true once it has seen it.
    phrase = [10, 11, 12, 13, 14, 15]
    tokens = phrase * 3
    data = dt.Sequences(
        tokens=np.array(tokens),
        features=torch.zeros(len(tokens), 2),
        top_ids=torch.zeros(len(tokens), 1, dtype=torch.long),
        top_probs=torch.ones(len(tokens), 1),
        left=np.arange(len(tokens))[::-1].copy(),
        positions=np.arange(len(tokens)) + 2,
        seeds=np.zeros(len(tokens), dtype=np.int64),
        starts=[0],
        prompts=[[1, 2, 10]],
    )
    rows = dt.round_rows(data, 3)
    assert rows.tolist() == list(range(len(tokens) - 1 - 3))
    hits, proposed = dt.ngram_matches(data, rows, 3)
    # Round at row j has seen tokens[: j + 2]; from the second copy of the phrase on, all match.
    assert hits[6:].all() and proposed[6:].all()
    assert not proposed[:4].any()


def test_the_best_trees_are_the_walks_taken_most_often_scored_on_the_other_half():
    # Walks of 2 levels: rank at depth 0, then at depth 1 (-1: the walk stopped there).
    walks = [[0, 0], [0, 1], [1, 0], [0, -1], [-1, -1], [0, 0]]
    ranks = np.array(walks * 2)
    halves = np.arange(len(ranks)) < len(walks)  # two identical halves
    scores = dt.best_trees(ranks, halves, (1, 2, 3, 10))
    # (0,) is walked 4 times in 6, then (0, 0) 2 times, then (0, 1) and (1,) once each.
    assert scores["1"] == pytest.approx(1 + 4 / 6)
    assert scores["2"] == pytest.approx(1 + 6 / 6)
    assert scores["3"] == pytest.approx(1 + 7 / 6)
    # Every walked path: as deep as every walk goes, the ceiling of any tree.
    depth = [2, 2, 2, 1, 0, 2]
    assert scores["10"] == pytest.approx(scores["any"]) == pytest.approx(1 + np.mean(depth))
    # Chosen on one half, scored on the other: what the first half never walked scores nothing.
    other = np.array([[1, 0]] * 3 + [[0, 0]] * 3)
    split = dt.best_trees(other, np.arange(6) < 3, (1,))
    assert split["1"] == pytest.approx(1.0)


def test_drafter_commands(tmp_path, tiny):
    out = tmp_path / "tiny-head.safetensors"
    result = CliRunner().invoke(
        cli,
        [
            "drafter",
            "train",
            "--model",
            str(tiny),
            "--tokens",
            "64",
            "--steps",
            "5",
            "--batch",
            "16",
            "--seed",
            "3",
            "--threads",
            "1",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    _, meta = DraftHead.load(out)
    assert meta["seed"] == 3 and meta["model"] == "tiny" and "--seed 3" in meta["command"]
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
    doc = json.loads(report.read_text())
    for mode in ("temp 0.7 top_p 0.95", "greedy"):
        scores = doc["modes"][mode]
        assert scores["rounds"] == len(dt.EVAL_PROMPTS) * (12 - 3)
        assert len(scores["head"]["per_position"]) == 3
        assert 0 <= scores["head_ceiling_draft_1"] <= 1
        assert 0 <= scores["head_inverse_cdf_draft_1"] <= 1
    bench = tmp_path / "bench.json"
    result = CliRunner().invoke(
        cli,
        [
            "bench",
            "draft-head",
            "--model",
            str(tiny),
            "--head",
            str(out),
            "--repeats",
            "2",
            "--k",
            "3",
            "--stages",
            "2",
            "--hop-delay-ms",
            "0",
            "--tokens",
            "10",
            "--seeds",
            "1",
            "--json",
            str(bench),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "K=3" in result.output and "over the support" in result.output
    # On real stage processes the tail's head drafts travel back with each result, and every
    # drafter commits plain decoding's tokens.
    ring = json.loads(bench.read_text())["ring"]
    assert ring["identical_to_plain"] is True
    assert {(r["mode"], r["kind"]) for r in ring["runs"]} == {
        (m, k) for m in ("greedy", "temp 0.7 top_p 0.95") for k in ("grounded", "novel")
    }
    for row in ring["runs"]:
        assert set(row["methods"]) == {"plain", "ngram", "head", "both"}
        assert row["methods"]["head"]["head_round_share"] > 0
        assert row["methods"]["ngram"]["head_round_share"] == 0
    # Narrowed to the 20 tokens the target gives the most mass: the same weights, its drafts
    # among those tokens only, and a second narrowing refused.
    narrow = tmp_path / "narrow.safetensors"
    args = [
        "drafter",
        "narrow",
        "--model",
        str(tiny),
        "--head",
        str(out),
        "--draft-vocab",
        "20",
        "--tokens",
        "64",
        "--threads",
        "1",
        "--out",
        str(narrow),
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    narrowed, narrow_meta = DraftHead.load(narrow)
    whole, _ = DraftHead.load(out)
    assert len(narrowed.token_ids()) == 20 and narrow_meta["draft_vocab"] == 20
    assert 0 < narrow_meta["narrowed"]["mass_covered"] < 1
    assert narrow_meta["command"] == meta["command"]  # how the weights were trained
    pairs = zip(narrowed.state_dict().values(), whole.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    refused = CliRunner().invoke(cli, [*args[:5], str(narrow), *args[6:]])
    assert refused.exit_code != 0 and "already drafts part" in refused.output
    # A head for another model is refused in one line, before anything runs.
    meta["model"] = "another"
    head, _ = DraftHead.load(out)
    head.save(tmp_path / "wrong.safetensors", meta)
    result = CliRunner().invoke(
        cli,
        ["drafter", "eval", "--model", str(tiny), "--head", str(tmp_path / "wrong.safetensors")],
    )
    assert result.exit_code != 0
    assert "trained for model 'another'" in result.output and "Traceback" not in result.output


def test_the_shipped_head_fits_the_default_model():
    from specpipe.drafting.head import shipped_head
    from specpipe.transformer.resolve import model_label

    label = model_label("default")
    path = shipped_head(label)
    assert path.stat().st_size < 8e6
    head, meta = DraftHead.load(path)
    cfg = open_checkpoint("default").config
    check_fits(meta, label, cfg.dim, cfg.vocab_size)
    assert meta["command"].startswith("specpipe drafter train --model default")
    assert "--seed" in meta["command"] and "TRAIN_PROMPTS" in meta["data"]
    assert head.hidden == meta["hidden"]


def test_a_head_on_part_of_the_vocabulary(tmp_path, stage, data):
    parts = dt.training_parts(stage)
    head, losses = dt.train_head(
        parts, data, steps=30, batch=32, lr=3e-3, hidden=32, draft_vocab=20
    )
    ids = head.token_ids()
    assert len(ids) == 20 and np.all(np.diff(ids) > 0)
    # The 20 tokens with the most target mass over the data.
    mass = np.zeros(stage.cfg.vocab_size)
    np.add.at(mass, data.top_ids.numpy().ravel(), data.top_probs.numpy().ravel())
    assert set(ids) == set(np.argsort(-mass, kind="stable")[:20].tolist())
    assert np.mean(losses[-5:]) < np.mean(losses[:3])
    params = SamplingParams(temp=1.0, seed=4)
    h, token = data.features[7], int(data.tokens[8])
    drafts = head.draft(parts, h, token, 50, 3, params)
    assert set(drafts) <= set(ids.tolist())
    with torch.inference_mode():
        _, logits = head.step(parts, h[None], torch.tensor([token]))
        full = stage.head(stage.norm(head(h[None], stage.embed(torch.tensor([token])))))
    assert logits.shape == (1, 20)
    assert torch.allclose(logits[0], full[0, torch.as_tensor(ids)], atol=1e-5)
    q = target_probs(logits[0].numpy(), 1.0)
    assert drafts[0] == gumbel_draw(q, 4, 51, ids)
    head.save(tmp_path / "part.safetensors", {"model": "tiny"})
    loaded, _ = DraftHead.load(tmp_path / "part.safetensors")
    assert np.array_equal(loaded.token_ids(), ids)
    # Evaluation scores such a head on the whole vocabulary's terms.
    scores = dt.evaluate(loaded, parts, data, 3, SamplingParams(temp=0.8, top_p=TOP_P))
    assert 0 <= scores["head_inverse_cdf_draft_1"] <= 1
    # Σ min(p, q) bounds the Gumbel agreement from above (up to sampling noise).
    ceiling, agreed = scores["head_ceiling_draft_1"], scores["head"]["accepted_through"][0]
    assert 0 < ceiling <= 1 and agreed <= ceiling + 4 * np.sqrt(ceiling / scores["rounds"])


def test_the_training_prompts_leave_out_every_prompt_the_head_is_measured_on():
    from specpipe.bench.load import PROMPTS as LOAD_PROMPTS
    from specpipe.bench.ring_hops import EXACT_PROMPTS, GROUNDED_PROMPT, NOVEL_PROMPT

    measured = {*dt.EVAL_PROMPTS, *LOAD_PROMPTS, *EXACT_PROMPTS, GROUNDED_PROMPT, NOVEL_PROMPT}
    assert len(set(dt.TRAIN_PROMPTS)) == len(dt.TRAIN_PROMPTS) > 1000
    assert not measured & set(dt.TRAIN_PROMPTS)
    # Nor any of their subjects: a held-out prompt is about something the head never read of.
    lowered = " ".join(measured).lower()
    assert [s for s in dt.SUBJECTS if s.lower() in lowered] == []


def test_a_tail_apart_from_stage_0_keeps_its_heads_embedding_table_in_host_memory(
    tmp_path, checkpoints
):
    """gpt-oss's head is not tied to its embedding, so a tail's draft head needs a table of its
    own; it stays on the CPU, whatever the stage's device, and gathers rows for the ids' device."""
    from specpipe.drafting.head import load_with_head
    from specpipe.transformer.layer_range import load_embedding

    checkpoint = open_checkpoint(checkpoints["gptoss-mxfp4"])
    cfg = checkpoint.config
    assert not cfg.tie_word_embeddings
    head_file = tmp_path / "head.safetensors"
    meta = {"model": "gptoss", "dim": cfg.dim, "vocab": cfg.vocab_size}
    DraftHead(cfg.dim, cfg.dim).save(head_file, meta)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    (tail,), head = load_with_head(
        lambda **options: [load_stage(checkpoint, 2, cfg.n_layers, device=device, **options)],
        str(head_file),
        "gptoss",
        checkpoint,
    )
    assert tail.embed is None and tail.last
    assert head.parts.embed_weight.device.type == "cpu"
    ids = torch.tensor([1, 5, 9, 5], device=device)
    rows = head.parts.embed(ids)
    assert rows.device == ids.device
    assert torch.equal(rows.cpu(), load_embedding(checkpoint)[ids.cpu()])
