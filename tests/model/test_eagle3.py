"""The EAGLE-3 head against the published equations, and released heads read in both formats.

The reference below is vLLM's EAGLE-3 Llama head (`llama_eagle3.py`) written out line by line,
on transformers' own Llama parts (RMSNorm, rotary embedding with gpt-oss's YaRN, MLP) and a
plain softmax attention, so that nothing of specpipe's model code checks itself.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from specpipe.cli import cli
from specpipe.drafting import eagle3
from specpipe.drafting.eagle3 import Eagle3Config, HeadCache, attend, default_taps
from specpipe.drafting.eagle3_format import load_eagle3
from specpipe.drafting.eagle3_synth import head_config, head_tensors
from specpipe.drafting.head import DraftHeadError
from specpipe.transformer.synth import LIKE
from tests.harmony_checkpoint import tiny_like

YARN = LIKE["gpt-oss-120b"]["rope_scaling"]
# A model of gpt-oss's kind at a small size: its head is 64 wide, 4 query heads of 16, 2 KV.
SMALL = tiny_like(n_layers=12, vocab_size=500)


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def small_head(fmt: str, tmp_path, **changes) -> tuple[dict, dict]:
    """A small released head of format `fmt` in tmp_path: its config and its tensors."""
    config = head_config(SMALL, fmt, intermediate=96, draft_vocab=200)
    config.update(changes)
    tensors = head_tensors(config, fmt, seed=3)
    for name, t in tensors.items():  # norms other than one, so that a skipped norm shows
        if name.endswith("norm.weight"):
            tensors[name] = (1 + 0.1 * torch.randn(t.shape)).to(t.dtype)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, tmp_path / "model.safetensors")
    return config, tensors


def reference(tensors: dict, config: dict, taps, tokens, embed, layers_out=False):
    """vLLM's EAGLE-3 head, step by step: logits [T, Vd] for rows 0 … T-1 (causal)."""
    layer = config.get("transformer_layer_config", config)
    H, nh, nkv = layer["hidden_size"], layer["num_attention_heads"], layer["num_key_value_heads"]
    hd, eps = layer["head_dim"], layer["rms_norm_eps"]
    w = {k.removeprefix("layers.0."): v.float() for k, v in tensors.items() if k != "t2d"}

    def rmsnorm(x, weight):
        norm = LlamaRMSNorm(x.shape[-1], eps=eps)
        norm.weight.data = weight
        return norm(x)

    T = taps.shape[0]
    # fc over the normed concatenation of the taps (norm_before_fc)
    hidden = rmsnorm(taps, w["input_norm.weight"]) @ w["fc.weight"].T
    # the decoder layer: [input_layernorm(embeds); hidden_norm(hidden)] into q, k, v
    emb = rmsnorm(embed[tokens], w["input_layernorm.weight"])
    normed = rmsnorm(hidden, w["hidden_norm.weight"])
    x = torch.cat([emb, normed], dim=-1)
    q = (x @ w["self_attn.q_proj.weight"].T).view(1, T, nh, hd).transpose(1, 2)
    k = (x @ w["self_attn.k_proj.weight"].T).view(1, T, nkv, hd).transpose(1, 2)
    v = (x @ w["self_attn.v_proj.weight"].T).view(1, T, nkv, hd).transpose(1, 2)
    llama = LlamaConfig(
        hidden_size=H,
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        head_dim=hd,
        max_position_embeddings=layer["max_position_embeddings"],
        rope_parameters={**layer["rope_scaling"], "rope_theta": layer["rope_theta"]},
    )
    cos, sin = LlamaRotaryEmbedding(llama)(x, torch.arange(T)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(T, nh * hd)
    residual = hidden + attn @ w["self_attn.o_proj.weight"].T
    mlp = LlamaMLP(LlamaConfig(hidden_size=H, intermediate_size=w["mlp.up_proj.weight"].shape[0]))
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(mlp, name).weight.data = w[f"mlp.{name}.weight"]
    out = residual + mlp(rmsnorm(residual, w["post_attention_layernorm.weight"]))
    logits = rmsnorm(out, w["norm.weight"]) @ w["lm_head.weight"].T
    return (logits, out) if layers_out else logits


@pytest.mark.parametrize("fmt", ["eagle", "speculators"])
def test_a_released_head_drafts_the_logits_of_the_published_equations(tmp_path, fmt):
    config, tensors = small_head(fmt, tmp_path)
    head = load_eagle3(tmp_path, 64, 500, 12)
    torch.manual_seed(0)
    T = 7
    taps, tokens = torch.randn(T, 3 * 64), torch.randint(0, 500, (T,))
    embed = torch.randn(500, 64)
    want = reference(tensors, config, taps, tokens, embed)
    out, cache = head(head.fuse(taps), embed[tokens], 0)
    got = head.logits(out)
    scale = float(want.abs().max())
    assert torch.allclose(got, want, atol=1e-4 * scale), (got - want).abs().max() / scale
    assert torch.equal(got.topk(5).indices, want.topk(5).indices)
    assert cache.length == T
    # The same rows one at a time over the session's cache: the same logits.
    past, rows = None, []
    for i in range(T):
        out_i, past = head(head.fuse(taps[i : i + 1]), embed[tokens[i : i + 1]], i, past)
        rows.append(head.logits(out_i))
    assert torch.allclose(torch.cat(rows), got, atol=1e-5 * scale)


def test_a_deeper_step_feeds_the_output_back_at_the_next_position(tmp_path):
    """Depth 2: the first step's output (not fused again) with the drafted token's embedding,
    attending to the committed rows and the first step's row."""
    small_head("eagle", tmp_path)
    head = load_eagle3(tmp_path, 64, 500, 12)
    torch.manual_seed(1)
    taps, tokens, embed = torch.randn(5, 192), torch.randint(0, 500, (5,)), torch.randn(500, 64)
    out, cache = head(head.fuse(taps), embed[tokens], 0)
    drafted = int(head.logits(out[-1:]).argmax())
    deeper, longer = head(head.feed_back(out[-1:]), embed[[drafted]], 5, cache)
    assert longer.length == 6 and deeper.shape == (1, 64)
    # Recomputed from scratch with that row as a sixth: the same output.
    g = torch.cat([head.fuse(taps), out[-1:]])
    again, _ = head(g, embed[torch.cat([tokens, torch.tensor([drafted])])], 0)
    assert torch.allclose(again[-1:], deeper, atol=1e-5)
    assert HeadCache(longer.k, longer.v).upto(5).length == 5


@pytest.mark.parametrize("block", [4096, 5, 1])
def test_attention_over_blocks_is_one_softmax_over_the_joined_keys(monkeypatch, block):
    """A session's rows (in blocks of `block`) and a tree's masked rows, attended without
    joining them: the same as one softmax over all the keys, a query seeing a masked key of
    the tree's never. The session's scores are made large so that a block whose maximum is
    not rescaled into the others' shows."""
    monkeypatch.setattr(eagle3, "SESSION_BLOCK", block)
    torch.manual_seed(3)
    nkv, group, T, S, R, hd = 2, 3, 4, 13, 6, 16
    q = torch.randn(nkv, group * T, hd) * 4
    past = HeadCache(torch.randn(nkv, S, hd) * 3, torch.randn(nkv, S, hd))
    k, v = torch.randn(nkv, R, hd), torch.randn(nkv, R, hd)
    visible = torch.rand(T, R) < 0.5
    visible[:, 0] = True
    got = attend(q, [*eagle3.session_blocks(past), (k, v, visible)])
    mask = torch.cat([torch.ones(T, S, dtype=torch.bool), visible], dim=1).repeat(group, 1)
    keys, values = torch.cat([past.k, k], dim=1), torch.cat([past.v, v], dim=1)
    want = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # Without the session's rows: the tree's alone, under its mask.
    alone = attend(q, [(k, v, visible)])
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=visible.repeat(group, 1)
    )
    assert torch.allclose(alone, want, atol=1e-5)


def test_draft_columns_map_to_the_models_tokens_through_d2t(tmp_path):
    _, tensors = small_head("speculators", tmp_path)
    head = load_eagle3(tmp_path, 64, 500, 12)
    ids = head.token_ids()
    assert len(ids) == 200 and list(ids[:100]) == list(range(100))
    assert list(ids) == sorted(set(ids)) and ids.max() < 500
    t2d = tensors["t2d"]
    assert sorted(int(i) for i in t2d.nonzero()) == list(ids)  # the training mask agrees


def test_the_taps_are_counted_as_each_format_publishes_them(tmp_path):
    config, _ = small_head("speculators", tmp_path)
    assert load_eagle3(tmp_path, 64, 500, 12).cfg.taps == (2, 6, 9) == default_taps(12)
    # SpecForge's EAGLE-format heads count the output of a layer: 1, 5, 8 are 2, 6, 9.
    eagle = tmp_path / "eagle"
    eagle.mkdir()
    config, _ = small_head("eagle", eagle)
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 5, 8]
    (eagle / "config.json").write_text(json.dumps(config))
    assert load_eagle3(eagle, 64, 500, 12).cfg.taps == (2, 6, 9)
    # nvidia's count the state entering a layer, up to the last layer's output.
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [8, 10, 12]
    (eagle / "config.json").write_text(json.dumps(config))
    assert load_eagle3(eagle, 64, 500, 12).cfg.taps == (8, 10, 12)
    del config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    (eagle / "config.json").write_text(json.dumps(config))
    assert load_eagle3(eagle, 64, 500, 24).cfg.taps == (2, 12, 21)  # gpt-oss-20b's defaults


def test_the_midlayer_names_of_the_original_checkpoints_load(tmp_path):
    config, tensors = small_head("eagle", tmp_path)
    renamed = {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}
    save_file(renamed, tmp_path / "model.safetensors")
    head = load_eagle3(tmp_path, 64, 500, 12)
    assert torch.equal(head.q_proj.weight, tensors["layers.0.self_attn.q_proj.weight"].float())


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        ((32, 500, 12), "taps 64 wide; this model's hidden size is 32"),
        ((64, 600, 12), "drafts for 500 tokens; this model's vocabulary has 600"),
        ((64, 500, 8), "taps the state entering layer 9; this model has 8 layers"),
    ],
    ids=["width", "vocabulary", "taps"],
)
def test_a_head_that_does_not_fit_the_model_is_refused_in_one_line(tmp_path, args, reason):
    small_head("speculators", tmp_path)
    with pytest.raises(DraftHeadError, match=reason) as refused:
        load_eagle3(tmp_path, *args)
    assert "\n" not in str(refused.value)


def test_malformed_heads_are_refused_in_one_line(tmp_path):
    config, tensors = small_head("eagle", tmp_path)
    broken = dict(tensors, **{"layers.0.self_attn.q_proj.weight": torch.zeros(8, 8)})
    save_file(broken, tmp_path / "model.safetensors")
    with pytest.raises(DraftHeadError, match=r"q_proj.weight is \[8, 8\]; its config says"):
        load_eagle3(tmp_path, 64, 500, 12)
    save_file(
        dict(tensors, **{"layers.1.mlp.up_proj.weight": torch.zeros(2)}),
        tmp_path / "model.safetensors",
    )
    with pytest.raises(DraftHeadError, match="a tensor an EAGLE-3 head does not"):
        load_eagle3(tmp_path, 64, 500, 12)
    without = {k: v for k, v in tensors.items() if k != "fc.weight"}
    save_file(without, tmp_path / "model.safetensors")
    with pytest.raises(DraftHeadError, match="no 'fc.weight' tensor"):
        load_eagle3(tmp_path, 64, 500, 12)
    save_file({k: v for k, v in tensors.items() if k != "d2t"}, tmp_path / "model.safetensors")
    with pytest.raises(DraftHeadError, match="drafts 200 of the model's 500 tokens but has no d2t"):
        load_eagle3(tmp_path, 64, 500, 12)
    bad_d2t = dict(tensors, d2t=tensors["d2t"] + 1000)
    save_file(bad_d2t, tmp_path / "model.safetensors")
    with pytest.raises(DraftHeadError, match="d2t maps drafts past the model's 500 tokens"):
        load_eagle3(tmp_path, 64, 500, 12)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(DraftHeadError, match="pickled checkpoint, which is never loaded"):
        load_eagle3(tmp_path, 64, 500, 12)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(DraftHeadError, match="not an EAGLE-3 head"):
        load_eagle3(tmp_path, 64, 500, 12)


def test_a_head_without_its_own_lm_head_reads_through_the_models(tmp_path):
    _, tensors = small_head("eagle", tmp_path, draft_vocab_size=None)
    assert "lm_head.weight" not in tensors and "d2t" not in tensors
    head = load_eagle3(tmp_path, 64, 500, 12)
    assert head.lm_head is None and list(head.token_ids()) == list(range(500))
    target = torch.nn.Linear(64, 500, bias=False)
    out, _ = head(head.fuse(torch.randn(3, 192)), torch.randn(3, 64), 0)
    assert head.logits(out, target).shape == (3, 500)
    with pytest.raises(ValueError, match="through the target's head"):
        head.logits(out)


def test_the_head_numbers_come_from_the_config_in_either_format(tmp_path):
    for fmt in ("eagle", "speculators"):
        folder = tmp_path / fmt
        folder.mkdir()
        small_head(fmt, folder)
        cfg = load_eagle3(folder, 64, 500, 12).cfg
        assert cfg == Eagle3Config(
            hidden=64,
            heads=4,
            kv_heads=2,
            head_dim=16,
            intermediate=96,
            draft_vocab=200,
            target_vocab=500,
            taps=(2, 6, 9),
            target_hidden=64,
            norm_eps=1e-5,
            rope_theta=150000.0,
            rope_scaling=YARN,
            max_positions=131072,
            norm_before_fc=True,
        )
        assert cfg.extra["format"] == fmt


@pytest.mark.parametrize(
    ("like", "fmt"), [("gpt-oss-120b", "eagle"), ("gpt-oss-20b", "speculators")]
)
def test_heads_at_gpt_oss_shapes_load_and_draft(tmp_path, like, fmt):
    folder = tmp_path / "head"
    made = CliRunner().invoke(
        cli, ["model", "synth-head", "--like", like, "--format", fmt, str(folder)]
    )
    assert made.exit_code == 0 and made.output.startswith(f"wrote {folder}"), made.output
    stored = load_file(folder / "model.safetensors")
    assert stored["fc.weight"].shape == (2880, 8640)
    assert stored["input_norm.weight"].shape == (8640,)
    assert stored["layers.0.self_attn.q_proj.weight"].shape == (4096, 5760)
    assert stored["layers.0.self_attn.k_proj.weight"].shape == (512, 5760)
    assert stored["layers.0.self_attn.o_proj.weight"].shape == (2880, 4096)
    assert stored["lm_head.weight"].shape == (32000, 2880) and stored["d2t"].shape == (32000,)
    assert ("t2d" in stored) == (fmt == "speculators")
    layers = LIKE[like]["num_hidden_layers"]
    head = load_eagle3(folder, 2880, 201088, layers, dtype=torch.bfloat16)
    assert head.cfg.taps == default_taps(layers) and head.cfg.rope_scaling == YARN
    taps = torch.randn(4, 8640, dtype=torch.bfloat16)
    out, cache = head(head.fuse(taps), torch.randn(4, 2880, dtype=torch.bfloat16), 0)
    logits = head.logits(out)
    assert logits.shape == (4, 32000) and torch.isfinite(logits.float()).all()
    assert cache.k.shape == (8, 4, 64)
    assert head.token_ids().max() < 201088
    with pytest.raises(DraftHeadError, match="hidden size is 64"):
        load_eagle3(folder, 64, 201088, layers)
