"""Checkpoints of a released model's layout with random weights, made here: no download.

`synthesize("gpt-oss-120b", out, layers=(9, 18))` writes what the released checkpoint holds for
those layers: its config.json, its tensor names, dtypes and shapes (MXFP4 blocks and E8M0 scales
for the experts, bf16 elsewhere), in shards with an index, and nothing else. The embedding
comes with a range that starts at layer 0, the final norm and the head with one that ends at the
last layer. Each tensor's values depend on the seed and its name alone, so layer 12 is the same
whether it was made alone or with its neighbours.

The numbers are the published configs of gpt-oss-120b and gpt-oss-20b (their config.json on the
model cards): 36 and 24 layers, hidden 2880, 64 query and 8 KV heads of 64, 128 and 32 experts
(4 per token, intermediate 2880), sliding windows of 128 on every other layer, attention sinks,
YaRN RoPE (factor 32 over 4096 positions, theta 150000) and a vocabulary of 201,088.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from specpipe.transformer.checkpoint import NameMap, hf_name_map
from specpipe.transformer.config import ModelConfig
from specpipe.transformer.errors import ModelError

MXFP4_GROUP = 32  # values per E8M0 scale; two 4-bit values per byte
SHARD_BYTES = 4 * 2**30  # at most this much of tensors per shard file


def _gpt_oss(n_layers: int, n_experts: int) -> dict:
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "pad_token_id": 199999,
        "experts_per_token": 4,
        "num_experts_per_tok": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * (n_layers // 2),
        "max_position_embeddings": 131072,
        "num_attention_heads": 64,
        "num_hidden_layers": n_layers,
        "num_key_value_heads": 8,
        "num_local_experts": n_experts,
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        "rope_theta": 150000,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "vocab_size": 201088,
    }


LIKE = {
    "gpt-oss-120b": _gpt_oss(n_layers=36, n_experts=128),
    "gpt-oss-20b": _gpt_oss(n_layers=24, n_experts=32),
}


@dataclass(frozen=True)
class Spec:
    """One tensor of the checkpoint: its name, shape and what it holds."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "weight" (bf16, random), "norm" (bf16, ones), "bias" (bf16, small),
    # "blocks" (uint8 E2M1 codes), "scales" (uint8 E8M0 exponents)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * (1 if self.kind in ("blocks", "scales") else 2)


def tensor_specs(cfg: ModelConfig, start: int, end: int, embedding: bool = False) -> Iterator[Spec]:
    """The tensors of layers [start, end), in the released checkpoint's names, with the
    embedding when start is 0 (or `embedding`) and the norm and head when end is the last
    layer."""
    D, V, E = cfg.dim, cfg.vocab_size, cfg.n_experts
    I, H, K, d = cfg.intermediate_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim  # noqa: E741
    if start == 0 or embedding:
        yield Spec("model.embed_tokens.weight", (V, D), "weight")
    for i in range(start, end):
        p = f"model.layers.{i}."
        yield Spec(p + "input_layernorm.weight", (D,), "norm")
        yield Spec(p + "post_attention_layernorm.weight", (D,), "norm")
        for proj, rows in (("q", H * d), ("k", K * d), ("v", K * d)):
            yield Spec(f"{p}self_attn.{proj}_proj.weight", (rows, D), "weight")
            yield Spec(f"{p}self_attn.{proj}_proj.bias", (rows,), "bias")
        yield Spec(p + "self_attn.o_proj.weight", (D, H * d), "weight")
        yield Spec(p + "self_attn.o_proj.bias", (D,), "bias")
        yield Spec(p + "self_attn.sinks", (H,), "bias")
        yield Spec(p + "mlp.router.weight", (E, D), "weight")
        yield Spec(p + "mlp.router.bias", (E,), "bias")
        # Experts as the release stores them: out rows of in/32 groups of 16 bytes.
        for proj, rows, cols in (("gate_up_proj", 2 * I, D), ("down_proj", D, I)):
            groups = cols // MXFP4_GROUP
            yield Spec(f"{p}mlp.experts.{proj}_blocks", (E, rows, groups, 16), "blocks")
            yield Spec(f"{p}mlp.experts.{proj}_scales", (E, rows, groups), "scales")
            yield Spec(f"{p}mlp.experts.{proj}_bias", (E, rows), "bias")
    if end == cfg.n_layers:
        yield Spec("model.norm.weight", (D,), "norm")
        yield Spec("lm_head.weight", (V, D), "weight")


def make_tensor(spec: Spec, seed: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """The tensor's random values, made on `device`: a function of the seed and its name alone
    (on one kind of device; a GPU's generator draws other numbers than the CPU's)."""
    digest = hashlib.sha256(f"{seed}:{spec.name}".encode()).digest()
    g = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    on = dict(generator=g, device=device)
    if spec.kind == "blocks":
        return torch.randint(0, 256, spec.shape, dtype=torch.uint8, **on)
    if spec.kind == "scales":
        # 2^-9 … 2^-6 per group: E2M1 values of at most 6 give weights of at most ~0.1.
        return torch.randint(127 - 9, 127 - 5, spec.shape, dtype=torch.uint8, **on)
    if spec.kind == "norm":
        return torch.ones(spec.shape, dtype=torch.bfloat16, device=device)
    scale = 0.02 if spec.kind == "weight" else 0.01
    out = torch.empty(spec.shape, dtype=torch.bfloat16, device=device)
    # In slices, so that a 201,088-row head never needs a float32 copy of itself.
    rows = max(1, 2**24 // max(1, out[0].numel())) if out.dim() > 1 else len(out)
    for lo in range(0, out.shape[0], rows):
        part = out[lo : lo + rows]
        part.copy_(torch.randn(part.shape, **on) * scale)
    return out


class SynthSource:
    """A checkpoint of `like`'s layout that makes each tensor when a stage reads it, on
    `device`, with no file: `load_stage(SynthSource("gpt-oss-120b", "cuda"), 9, 18)` is a
    real-size stage whose weights are drawn in place."""

    kind = "synth"

    def __init__(self, like: str, device: str | torch.device = "cpu", seed: int = 0) -> None:
        if like not in LIKE:
            raise ModelError(f"unknown model {like!r}: one of {', '.join(sorted(LIKE))}")
        self.config = ModelConfig.from_hf(LIKE[like])
        self.path = Path(f"synth:{like}")
        self.device, self.seed = device, seed
        self._specs = {s.name: s for s in tensor_specs(self.config, 0, self.config.n_layers)}

    def name_map(self, start: int, end: int, first: bool, last: bool, packed: bool) -> NameMap:
        return hf_name_map(self.config, start, end, first, last, packed)

    def read(self, name: str) -> torch.Tensor:
        return make_tensor(self._specs[name], self.seed, self.device)


@dataclass
class Synthesized:
    """What `synthesize` wrote."""

    path: Path
    layers: tuple[int, int]
    tensors: int
    bytes: int
    shards: int


def synthesize(
    like: str,
    out: str | Path,
    layers: tuple[int, int] | None = None,
    seed: int = 0,
    shard_bytes: int = SHARD_BYTES,
    embedding: bool = False,
    n_layers: int | None = None,
) -> Synthesized:
    """Write a checkpoint of `like`'s layout holding layers [start, end) (all: None) to `out`,
    which must not exist or be empty; with `embedding`, the embedding table too whatever the
    range (a tail with a draft head reads it). With `n_layers`, the model is `like` cut to its
    first n layers (its config says so), with its embedding, norm and head. ModelError for an
    unknown model or a bad range."""
    config = _hf_config(like, n_layers)
    cfg = ModelConfig.from_hf(config)
    start, end = layers or (0, cfg.n_layers)
    if not 0 <= start < end <= cfg.n_layers:
        raise ModelError(f"layer range {start}:{end} is not within 0:{cfg.n_layers} of {like}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelError(f"{out} exists and is not an empty directory")
    specs = list(tensor_specs(cfg, start, end, embedding))
    shards = _shards(specs, shard_bytes)
    total = sum(spec.nbytes for spec in specs)
    # Written beside `out` and renamed at the end: a run that fails leaves nothing half made.
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        _write_checkpoint(partial, config, shards, seed, total)
        if out.exists():
            out.rmdir()
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return Synthesized(out, (start, end), len(specs), total, len(shards))


def _hf_config(like: str, n_layers: int | None) -> dict:
    """The config.json of `like`, cut to its first `n_layers` (None: all of them)."""
    if like not in LIKE:
        raise ModelError(f"unknown model {like!r}: one of {', '.join(sorted(LIKE))}")
    config = LIKE[like]
    if n_layers is not None:
        if not 1 <= n_layers <= config["num_hidden_layers"]:
            raise ModelError(f"{like} has {config['num_hidden_layers']} layers, not {n_layers}")
        types = config["layer_types"][:n_layers]
        config = {**config, "num_hidden_layers": n_layers, "layer_types": types}
    return config


def _shards(specs: list[Spec], shard_bytes: int) -> list[list[Spec]]:
    """The tensors in order, cut into shards of at most `shard_bytes` (one tensor: any size)."""
    shards: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _write_checkpoint(
    folder: Path, config: dict, shards: list[list[Spec]], seed: int, total: int
) -> None:
    """The shards' tensors made and saved one shard at a time, the index and the config."""
    weight_map = {}
    for n, shard in enumerate(shards, start=1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        tensors = {spec.name: make_tensor(spec, seed) for spec in shard}
        save_file(tensors, folder / file, metadata={"format": "pt"})
        del tensors
        weight_map.update(dict.fromkeys((spec.name for spec in shard), file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
