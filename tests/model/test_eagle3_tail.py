"""An EAGLE-3 head drafting at the tail of a one-process ring: the stages keep the states entering
its tapped layers, the head drafts from them, and the committed tokens stay plain sampling's."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from specpipe.cli import cli
from specpipe.core.ring import Round
from specpipe.core.sampling import SamplingParams
from specpipe.core.tree import MAX_RANK, TreeShape
from specpipe.decoding.generation import Generation
from specpipe.decoding.local_ring import LocalRing
from specpipe.decoding.target import open_target
from specpipe.drafting.coupled import ranked_candidates
from specpipe.drafting.eagle3 import Eagle3Config, Eagle3Head
from specpipe.drafting.eagle3_drafter import Eagle3Drafter, TreeRows
from specpipe.drafting.eagle3_synth import head_config, head_tensors
from specpipe.drafting.head import DraftHeadError, TargetParts
from specpipe.drafting.sources import TailDrafter, named_sources
from specpipe.transformer.layer_range import load_stage
from specpipe.transformer.resolve import load_stages, open_checkpoint
from tests.drafting import head_generation
from tests.swarmprocs import write_tiny_model

PROMPT = [5, 17, 42, 8, 23, 61, 9, 5, 17, 30]
TAPS = (1, 2, 4)  # of the tiny model's 4 layers: 4 is the last layer's output
GREEDY = SamplingParams(temp=0.0)
SAMPLED = SamplingParams(temp=0.8, top_p=0.95, seed=7, sampler="gumbel")
WIDE = TreeShape((0, 0, 0, 1, 1, 4, 2), (0, 1, 2, 0, 1, 0, 0))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("eagle3") / "tiny")


def head_for(stages, seed: int = 0, draft_vocab: int | None = None) -> Eagle3Head:
    """A random head of the model's width, reading TAPS."""
    cfg = stages[-1].cfg
    vocab = draft_vocab or cfg.vocab_size
    head = Eagle3Head(
        Eagle3Config(
            hidden=cfg.dim,
            heads=cfg.n_heads,
            kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            intermediate=48,
            draft_vocab=vocab,
            target_vocab=cfg.vocab_size,
            taps=TAPS,
            norm_eps=cfg.norm_eps,
        )
    )
    torch.manual_seed(seed)
    for name, weight in head.named_parameters():
        if "norm" not in name:
            torch.nn.init.normal_(weight, std=0.05)
    if vocab < cfg.vocab_size:  # every other token: column c drafts token 2c
        head.d2t.copy_(torch.arange(vocab))
    return head


def ring_with(stages, head: Eagle3Head) -> LocalRing:
    parts = TargetParts.from_stage(stages[-1], stages[0].embed.weight)
    return LocalRing(stages, Eagle3Drafter(head, parts))


def run(ring, params, n=30, draft_k=3, trees=False, session="s"):
    generation = head_generation(
        ring, session, PROMPT, params, n, draft_k, tree=WIDE if trees else None
    )
    tokens = generation.run()
    ring.drop(session)
    return tokens, generation.stats


def test_the_stages_keep_the_states_entering_the_tapped_layers(model):
    stages = load_stages(model, 2, pack=False)  # layers 0:2 and 2:4
    ring = ring_with(stages, head_for(stages))
    assert isinstance(ring.head, TailDrafter)
    ring.reset("s", GREEDY)
    ring.round(Round("s", PROMPT, 0))
    taps = stages[-1].features["s"]  # [T, 3 x D]
    D = stages[-1].cfg.dim
    assert taps.shape == (len(PROMPT), 3 * D)
    ids = torch.tensor(PROMPT)
    checkpoint = open_checkpoint(model)
    for i, layer in enumerate(TAPS[:2]):  # entering layer k: the output of layers 0 … k-1
        upto = load_stage(checkpoint, 0, layer, pack=False)
        expected = upto.forward("r", ids, 0)
        assert torch.allclose(taps[:, i * D : (i + 1) * D], expected, atol=1e-5), layer
    whole = load_stage(checkpoint, 0, 4, pack=False)  # the last layer's output, before the norm
    whole.keep_features = True
    whole.forward("r", ids, 0, last_rows=len(PROMPT))
    assert torch.allclose(taps[:, 2 * D :], whole.features["r"], atol=1e-5)
    # Nothing is kept where no drafter reads taps.
    plain = LocalRing(load_stages(model, 2, pack=False))
    plain.reset("s", GREEDY)
    plain.round(Round("s", PROMPT, 0))
    assert all(not stage.tapped for stage in plain.stages)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "gumbel"])
@pytest.mark.parametrize("trees", [False, True], ids=["chains", "trees"])
@pytest.mark.parametrize("draft_vocab", [None, 40], ids=["whole-vocab", "part-vocab"])
def test_spec_equals_plain_whatever_a_random_head_drafts(model, params, trees, draft_vocab):
    stages = load_stages(model, 2, pack=False)
    ring = ring_with(stages, head_for(stages, seed=3, draft_vocab=draft_vocab))
    plain, _ = run(ring, params, draft_k=0)
    spec, stats = run(ring, params, trees=trees)
    assert spec == plain and stats.head_rounds > 0
    if trees:
        assert stats.tree_rounds > 0
    if draft_vocab:
        drafted = ring.head.ids
        assert set(drafted.tolist()) == set(range(0, 2 * draft_vocab, 2))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn)")
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "gumbel"])
def test_a_packed_head_drafts_as_its_plain_copy_and_changes_no_token(model, params):
    stages = load_stages(model, 2, pack=False)
    head = head_for(stages, seed=3, draft_vocab=40)
    packed = copy.deepcopy(head)
    assert packed.pack() == 9  # fc, q, k, v, o, gate, up, down, lm_head
    assert packed.lm_head.weight is None and packed.lm_head.packed is not None
    torch.manual_seed(2)
    g, embeds = torch.randn(6, head.cfg.hidden), torch.randn(6, head.cfg.hidden)
    with torch.no_grad():
        for rows in (1, 2, 6):  # one row, a tree's few, a prompt's
            want, _ = head(g[:rows], embeds[:rows], 0)
            got, _ = packed(g[:rows], embeds[:rows], 0)
            assert torch.allclose(packed.logits(got), head.logits(want), atol=1e-5), rows
    ring = ring_with(stages, packed)
    plain, _ = run(ring, params, draft_k=0)
    spec, stats = run(ring, params, trees=True)
    assert spec == plain and stats.tree_rounds > 0


def test_the_sessions_cache_after_its_rounds_is_the_one_built_at_once(model):
    # Each round's rows join the cache where they stand, cut back to their start: a replay
    # from position 0 after a stage lost the session (it restarted) builds it again, and
    # whatever happened on the way it ends as the committed tokens' rows, built in one go.
    stages = load_stages(model, 2, pack=False)
    head = head_for(stages, seed=5)
    ring = ring_with(stages, head)
    generation = Generation(
        ring, "s", PROMPT, SAMPLED, max_new_tokens=25, sources=named_sources("head", SAMPLED)
    )
    for i, _ in enumerate(generation.rounds()):
        if i == 4:
            stages[0].drop("s")  # the next round finds a gap and replays from position 0
    assert generation.stats.replays == 1 and generation.stats.accepted > 0
    tokens = PROMPT + generation.generated
    # The taps of every committed position, in one round on fresh stages.
    fresh = load_stages(model, 2, pack=False)
    once = ring_with(fresh, head)
    once.reset("o", SAMPLED)
    once.round(Round("o", tokens, 0))
    taps = fresh[-1].features["o"]
    n = len(tokens)
    built = Eagle3Drafter(head, once.head.parts)
    built.remember("o", taps[: n - 2], tokens[1 : n - 1], 1)  # rows 0 … n-3
    assert ring.head._rows["s"].first == 0
    cut, whole = ring.head.past_before("s", n - 2), built.past_before("o", n - 2)
    assert cut.length == whole.length == n - 2
    assert torch.allclose(cut.k, whole.k, atol=1e-4)
    assert torch.allclose(cut.v, whole.v, atol=1e-4)
    # And both draft the same after the last token.
    after = ring.head.drafts_after("s", taps[n - 2], tokens[-1], n - 1, 4, SAMPLED)
    assert after == built.drafts_after("o", taps[n - 2], tokens[-1], n - 1, 4, SAMPLED)


@pytest.mark.parametrize("trees", [False, True], ids=["chains", "trees"])
def test_a_chunked_prefill_leaves_the_cache_of_the_prompts_own_pairs(model, monkeypatch, trees):
    """A prompt longer than a prefill chunk goes in rounds whose sampled token the loop drops:
    each chunk's last row is paired again with the prompt's next token when the next round
    starts from it, so the cache ends as the committed tokens' own pairs, built in one go."""
    stages = load_stages(model, 2, pack=False)
    head = head_for(stages, seed=5)
    ring = ring_with(stages, head)
    generation = head_generation(ring, "s", PROMPT, SAMPLED, 12, 3, tree=WIDE if trees else None)
    generation.prefill_chunk = 3
    chunks, send = [], ring.round

    def round_(r: Round):
        if r.n_draft == 0 and r.wanted == 0:  # a chunk's round: its sampled token is dropped
            chunks.append(r.start_pos + len(r.tokens))  # where the prompt's own token goes
        return send(r)

    monkeypatch.setattr(ring, "round", round_)
    generation.run()
    assert len(chunks) >= 3
    tokens = PROMPT + generation.generated
    fresh = load_stages(model, 2, pack=False)
    once = ring_with(fresh, head)
    once.reset("o", SAMPLED)
    once.round(Round("o", tokens, 0))
    taps, n = fresh[-1].features["o"], len(tokens)
    built = Eagle3Drafter(head, once.head.parts)
    built.remember("o", taps[: n - 2], tokens[1 : n - 1], 1)  # rows 0 … n-3
    cut, whole = ring.head.past_before("s", n - 2), built.past_before("o", n - 2)
    assert cut.length == whole.length == n - 2
    for k, want in ((cut.k, whole.k), (cut.v, whole.v)):
        wrong = [i for i in range(n - 2) if not torch.allclose(k[:, i], want[:, i], atol=1e-4)]
        assert wrong == [], f"rows paired wrongly at {wrong}; chunks ended at {chunks}"


def primed(model, seed: int, params: SamplingParams):
    """A head (draft vocabulary of 40) on a ring that ran PROMPT in session "s", its drafter
    remembering the prompt's committed rows but the last: (head, drafter, taps, len(PROMPT))."""
    stages = load_stages(model, 2, pack=False)
    head = head_for(stages, seed=seed, draft_vocab=40)
    ring = ring_with(stages, head)
    ring.reset("s", params)
    ring.round(Round("s", PROMPT, 0))
    taps, n = stages[-1].features["s"], len(PROMPT)
    ring.head.remember("s", taps[: n - 2], PROMPT[1 : n - 1], 1)
    return head, ring.head, taps, n


def test_a_greedy_chain_is_the_heads_equations_step_by_step(model):
    head, drafter, taps, n = primed(model, 9, GREEDY)
    drafts = drafter.drafts_after("s", taps[n - 2], PROMPT[-1], n - 1, 3, GREEDY)
    # Written out: the committed rows 0 … n-3 in one pass, then a row at a time.
    embed = drafter.parts.embed
    with torch.no_grad():
        _, past = head(head.fuse(taps[: n - 2]), embed(torch.tensor(PROMPT[1 : n - 1])), 0)
        g, token, expected = head.fuse(taps[n - 2 : n - 1]), PROMPT[-1], []
        for position in range(n - 2, n + 1):
            out, past = head(g, embed(torch.tensor([token])), position, past)
            column = int(head.lm_head(head.norm(out))[0].argmax())
            token = column + int(head.d2t[column])  # the draft vocabulary's id in the target's
            expected.append(token)
            g = out  # fed back as it is (norm_output off)
    assert drafts == expected and all(t % 2 == 0 for t in drafts)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_each_node_of_a_tree_ranks_what_its_path_drafted_a_row_at_a_time_would(model, params):
    """A tree's depth steps in one pass (each node seeing the session's rows and its own path's,
    not its siblings'); written out, each node is its path run through the head one row at a
    time, and its candidates are those of that row's logits."""
    head, drafter, taps, n = primed(model, 4, params)
    tree = drafter.draft_tree("s", taps[n - 2], PROMPT[-1], n - 1, WIDE, params)
    _, _, candidates = drafter.ranked._last["s"]
    assert len(tree.tokens) == len(WIDE.parents) and max(map(len, candidates)) == 2
    embed = drafter.parts.embed
    for path, ranked in candidates.items():
        with torch.no_grad():
            _, past = head(head.fuse(taps[: n - 2]), embed(torch.tensor(PROMPT[1 : n - 1])), 0)
            g, position = head.fuse(taps[n - 2 : n - 1]), n - 2
            for token in (PROMPT[-1], *path):
                out, past = head(g, embed(torch.tensor([token])), position, past)
                g, position = head.feed_back(out), position + 1
            logits = head.logits(out)[0].numpy()
        depth = len(path)
        assert ranked == ranked_candidates(logits, params, n + depth, drafter.ids, MAX_RANK), path


def test_a_depth_of_a_tree_in_one_pass_is_each_nodes_path_a_row_at_a_time(model):
    """Two branches of two nodes: each node's output equals its path run row by row, so it sees
    the session's rows and its ancestors', never a sibling's or a cousin's."""
    stages = load_stages(model, 2, pack=False)
    head = head_for(stages, seed=5)
    torch.manual_seed(0)
    H, P = head.cfg.hidden, 6
    taps = torch.randn(P + 1, 3 * H)
    embed = torch.randn(5, H)  # the root's token, a and b (depth 1), a's child and b's
    with torch.no_grad():
        _, past = head(head.fuse(taps[:P]), torch.randn(P, H), 0)  # the session's rows
        rows = TreeRows(5, torch.device("cpu"))
        root = head.fuse(taps[P:])
        out0, own = head.tree_step(root, embed[:1], P, past, rows.context, rows.visible([()]))
        rows.add(own)
        g1 = out0.repeat(2, 1)
        visible = rows.visible([(0,)] * 2)
        out1, own = head.tree_step(g1, embed[1:3], P + 1, past, rows.context, visible)
        rows.add(own)
        visible = rows.visible([(0, 1), (0, 2)])
        out2, _ = head.tree_step(out1, embed[3:5], P + 2, past, rows.context, visible)
        for branch in (0, 1):
            g, cache, outs = root, past, []
            for depth, row in enumerate((0, 1 + branch, 3 + branch)):
                out, cache = head(g, embed[row : row + 1], P + depth, cache)
                outs.append(out[0])
                g = out
            assert torch.allclose(outs[0], out0[0], atol=1e-5)
            assert torch.allclose(outs[1], out1[branch], atol=1e-5)
            assert torch.allclose(outs[2], out2[branch], atol=1e-5)


def test_the_rows_a_session_keeps_are_the_cache_of_a_whole_pass(model):
    stages = load_stages(model, 2, pack=False)
    head = head_for(stages, seed=6)
    g, embeds = torch.randn(7, head.cfg.hidden), torch.randn(7, head.cfg.hidden)
    with torch.no_grad():
        _, whole = head(g, embeds, 3)
        kept = head.rows(g[4:], embeds[4:], 7)
    assert kept.length == 3
    assert torch.allclose(kept.k, whole.k[:, 4:], atol=1e-6)
    assert torch.allclose(kept.v, whole.v[:, 4:], atol=1e-6)


def test_a_head_whose_taps_are_out_of_layer_order_is_refused(model):
    stages = load_stages(model, 2, pack=False)
    head = head_for(stages)
    head.cfg = Eagle3Config(**{**head.cfg.__dict__, "taps": (2, 1, 4)})
    with pytest.raises(DraftHeadError, match="not in layer order"):
        ring_with(stages, head)


@pytest.mark.parametrize("fmt", ["eagle", "speculators"])
def test_a_released_head_folder_drafts_on_a_local_ring(model, tmp_path, fmt):
    config = head_config(json.loads((model / "config.json").read_text()), fmt, 48, 50)
    taps = {"eagle": "eagle_config", "speculators": None}[fmt]
    where = config[taps] if taps else config
    where["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    folder = tmp_path / fmt
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(head_tensors(config, fmt, seed=2), folder / "model.safetensors")
    ring = open_target(str(model)).local_ring(2, draft_head=str(folder))
    assert isinstance(ring.head, Eagle3Drafter)
    # Packed with the stages, as a stage worker holds it (where oneDNN is there to pack).
    lm_head = ring.head.head.lm_head
    assert (lm_head.packed is not None) == torch.backends.mkldnn.is_available()
    # An EAGLE-format head whose first tap is 1 counts layers' outputs (SpecForge's heads).
    assert ring.head.taps == ((2, 3, 4) if fmt == "eagle" else (1, 2, 3))
    for params in (GREEDY, SAMPLED):
        plain, _ = run(ring, params, draft_k=0)
        spec, stats = run(ring, params)
        assert spec == plain and stats.head_rounds > 0
    result = CliRunner().invoke(
        cli,
        ["generate", "--local", "Hello there", "--model", str(model), "--draft-head", str(folder)],
    )
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output


def test_a_stage_splits_what_the_stage_before_sent_by_the_taps_below_it(model):
    first, middle, tail = (
        load_stage(open_checkpoint(model), a, b) for a, b in ((0, 1), (1, 3), (3, 4))
    )
    D = tail.cfg.dim
    sent = torch.randn(5, 3 * D)  # the hidden states, then the states entering layers 1 and 2
    rows, carried = tail.split_taps(sent, TAPS)
    assert torch.equal(rows, sent[:, :D]) and torch.equal(carried, sent[:, D:])
    rows, carried = middle.split_taps(sent[:, :D], TAPS)  # nothing is tapped below layer 1
    assert carried is None and torch.equal(rows, sent[:, :D])
    for stage, wrong in ((tail, sent[:, : 2 * D]), (tail, sent[:, :D]), (middle, sent)):
        with pytest.raises(ValueError, match="columns"):
            stage.split_taps(wrong, TAPS)
    assert first.taps_here(TAPS) == [] and middle.taps_here(TAPS) == [1, 2]
    assert tail.taps_here(TAPS) == [4]


def test_each_query_head_reads_its_own_kv_head():
    """Six query heads over two KV heads: heads 0-2 read KV head 0, heads 3-5 KV head 1, as
    copying each KV head for its queries does."""
    cfg = Eagle3Config(
        hidden=96,
        heads=6,
        kv_heads=2,
        head_dim=16,
        intermediate=64,
        draft_vocab=50,
        target_vocab=100,
        taps=(1, 2, 3),
    )
    torch.manual_seed(0)
    head = Eagle3Head(cfg)
    for name, weight in head.named_parameters():
        if "norm" not in name:
            torch.nn.init.normal_(weight, std=0.1)
    g, embeds = torch.randn(5, 96), torch.randn(5, 96)
    with torch.no_grad():
        out, _ = head(g, embeds, 3)
        h, q, k, v = head._project(g, embeds, *head.rotary(3, 5, g.dtype))
        copied = (k.repeat_interleave(3, 0), v.repeat_interleave(3, 0))
        mask = torch.ones(5, 5, dtype=torch.bool).tril()
        attn = torch.nn.functional.scaled_dot_product_attention(q, *copied, attn_mask=mask)
        r = g + head.o_proj(attn.transpose(0, 1).reshape(5, 96))
        m = head.post_attention_layernorm(r)
        want = r + head.down_proj(torch.nn.functional.silu(head.gate_proj(m)) * head.up_proj(m))
    assert torch.allclose(out, want, atol=1e-5)
