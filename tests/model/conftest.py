"""Tiny random checkpoints written by transformers, and the reference logits they give."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from specpipe.transformer.mxfp4 import mxfp4_quantize

transformers = pytest.importorskip("transformers")

N_LAYERS = 4
SLIDING_WINDOW = 4
SPLITS = {  # stage sizes
    "1": [4],
    "2-even": [2, 2],
    "2-uneven": [1, 3],
    "4": [1, 1, 1, 1],
}


def _llama_config(**kw):
    base = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=5000.0,
    )
    return {**base, **kw}


def _randomise(model: torch.nn.Module, seed: int) -> None:
    # Random init is tiny-variance; larger weights make the comparison mean something.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.2))
            if name.endswith("norm.weight"):
                p.add_(1.0)


def write_llama(path: Path, kind: str = "llama", seed: int = 0) -> Path:
    """A tiny LlamaForCausalLM (untied, llama3 rope; "plain": no rope scaling) or Qwen2 (tied)."""
    if kind == "plain":
        cfg = transformers.LlamaConfig(**_llama_config(), tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "llama":
        cfg = transformers.LlamaConfig(
            **_llama_config(
                rope_scaling=dict(
                    rope_type="llama3",
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=16,
                )
            ),
            tie_word_embeddings=False,
        )
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**_llama_config(), tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    _randomise(model, seed)
    model.save_pretrained(path)
    return path


def write_gptoss(path: Path, mxfp4: bool, seed: int = 0, shard_size: str | None = None) -> Path:
    """A tiny GptOssForCausalLM; with mxfp4, experts saved packed as in the released model."""
    cfg = transformers.GptOssConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * (N_LAYERS // 2),
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_max_position_embeddings=64,
            truncate=False,
        ),
        max_position_embeddings=2048,
    )
    model = transformers.GptOssForCausalLM(cfg)
    _randomise(model, seed)
    kw = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(path, **kw)
    if mxfp4:
        _pack_experts(path)
    return path


def _pack_experts(path: Path) -> None:
    """Rewrite float experts [E, in, out] as MXFP4 blocks/scales [E, out, in/32, 16].

    transformers runs MXFP4 only through extra packages, so its reference copy (`<path>-ref`)
    gets float experts unpacked by transformers' own MXFP4 decoder."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ref = path.parent / (path.name + "-ref")
    shutil.copytree(path, ref)
    file = path / "model.safetensors"
    tensors = load_file(file)
    ref_tensors = dict(tensors)
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = mxfp4_quantize(tensors.pop(name).transpose(1, 2))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        ref_tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, file, metadata={"format": "pt"})
    save_file(ref_tensors, ref / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config))


def reference(path: Path) -> Path:
    """The checkpoint transformers reads for `path` (a float copy for MXFP4 ones)."""
    ref = path.parent / (path.name + "-ref")
    return ref if ref.exists() else path


def hf_logits(path: Path, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits [T, V] of transformers' own model loaded from `path` (as float32)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(reference(path), dtype=dtype)
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: these models are tiny, and threads only fight on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One tiny checkpoint per family."""
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "llama": write_llama(root / "llama", "llama"),
        "qwen2": write_llama(root / "qwen2", "qwen2", seed=1),
        "gptoss": write_gptoss(root / "gptoss", mxfp4=False, seed=2),
        "gptoss-mxfp4": write_gptoss(root / "gptoss-mxfp4", mxfp4=True, seed=3),
    }
