"""GGUF files: a tiny one written here (with llama.cpp's q/k permutation), and bad ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specpipe.transformer.errors import ModelError
from specpipe.transformer.gguf import GGUFCheckpoint
from specpipe.transformer.layer_range import load_stage
from specpipe.transformer.resolve import load_tokenizer, open_checkpoint
from tests.model.conftest import SPLITS, hf_logits, write_llama
from tests.model.helpers import load_split, run_split

gguf = pytest.importorskip("gguf")
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _vocab(n: int) -> list[str]:
    """Byte-level symbols for the first bytes of printable ASCII, then the control tokens."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "Ċ", ".", ",", "!"]
    rest = [a for a in alphabet if a not in letters]
    return SPECIALS + letters + rest[: n - len(SPECIALS) - len(letters)]


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama q/k rows (the inverse of what we undo)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(path, hf_dir, arch: str = "llama") -> None:
    """Convert a tiny HF Llama checkpoint to an F32 GGUF file, as llama.cpp would name it."""
    import json

    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    t = load_file(hf_dir / "model.safetensors")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    tokens = _vocab(cfg["vocab_size"])
    w.add_token_list(tokens)
    w.add_token_types([3 if tok in SPECIALS else 1 for tok in tokens])
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
    permute = arch != "qwen2"  # llama.cpp permutes q/k rows for Llama, not for Qwen2
    for i in range(cfg["num_hidden_layers"]):
        for hf, ours in names.items():
            for kind in ("weight", "bias"):
                x = t.get(f"model.layers.{i}.{hf}.{kind}")
                if x is None:
                    continue
                if permute and ours == "attn_q":
                    x = _permute(x, cfg["num_attention_heads"])
                if permute and ours == "attn_k":
                    x = _permute(x, cfg["num_key_value_heads"])
                w.add_tensor(f"blk.{i}.{ours}.{kind}", x)
    w.add_tensor("output_norm.weight", t["model.norm.weight"])
    if "lm_head.weight" in t:
        w.add_tensor("output.weight", t["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    hf_dir = write_llama(root / "hf", "plain", seed=7)
    write_gguf(root / "tiny.gguf", hf_dir)
    return root / "tiny.gguf", hf_dir


@pytest.fixture(scope="module")
def tiny_qwen2(checkpoints, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "qwen2.gguf"
    write_gguf(path, checkpoints["qwen2"], arch="qwen2")
    return path, checkpoints["qwen2"]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("family", ["tiny", "tiny_qwen2"])
def test_gguf_stages_match_transformers(request, family, split):
    path, hf_dir = request.getfixturevalue(family)
    ids = torch.randint(0, 97, (17,), generator=torch.Generator().manual_seed(1))
    stages = load_split(lambda: GGUFCheckpoint(path), SPLITS[split])
    want = hf_logits(hf_dir, ids)
    logits = run_split(stages, "s", ids, 0)
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)
    assert torch.equal(logits.argmax(-1), want.argmax(-1))


def test_gguf_stage_reads_only_its_layers(tiny):
    path, _ = tiny
    source = GGUFCheckpoint(path)
    load_stage(source, 1, 3)
    want = [n for n in source.names() if n.startswith(("blk.1.", "blk.2."))]
    assert source.bytes_read == sum(source.info(n)[2] for n in want)


def test_gguf_tokenizer_and_template(tiny):
    path, _ = tiny
    tok = load_tokenizer(open_checkpoint(path))
    ids = tok.encode("hi there.")
    assert tok.decode(ids) == "hi there."
    assert tok.encode("<|im_start|>") == [1]
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.prompt_ids("hi")[:1] == [1] and tok.prompt_ids("hi", raw=True) == tok.encode("hi")


def test_unknown_gguf_architecture(tiny, tmp_path):
    _, hf_dir = tiny
    write_gguf(tmp_path / "m.gguf", hf_dir, arch="mamba")
    with pytest.raises(ModelError, match="m.gguf: unknown GGUF architecture 'mamba'"):
        open_checkpoint(tmp_path / "m.gguf")


def test_bad_gguf_files(tiny, tmp_path):
    path, _ = tiny
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelError, match="x.gguf: neither a checkpoint directory nor a GGUF"):
        open_checkpoint(not_gguf)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ModelError, match="cut.gguf: not a readable GGUF file"):
        open_checkpoint(cut)
    with pytest.raises(ModelError, match="nowhere.gguf: no such file"):
        open_checkpoint(tmp_path / "nowhere.gguf")
