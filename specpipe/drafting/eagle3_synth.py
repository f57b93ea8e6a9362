"""EAGLE-3 heads of a released model's shapes with random weights, in either published format:
the loader and the taps are tested at the real size without downloading a head.

`synthesize_head("gpt-oss-120b", out, "eagle")` writes a config.json and a model.safetensors as
the released gpt-oss heads lay them out: H 2880, 64 query and 8 KV heads of 64, a draft
vocabulary of 32,000 of the model's 201,088 tokens (`d2t`, and the training-only `t2d` the
speculators format carries), gpt-oss's YaRN RoPE, and the default taps 2, L//2, L-3 (in the
format's counting). The MLP is 2,880 wide unless asked otherwise (SpecForge's heads use 17,280).
The draft vocabulary is a seeded sample of the model's tokens, always with the lowest ids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from specpipe.drafting.eagle3 import default_taps
from specpipe.drafting.eagle3_format import FORMATS
from specpipe.transformer.config import ModelConfig
from specpipe.transformer.synth import LIKE

DRAFT_VOCAB = 32000


def head_config(
    model: dict,
    fmt: str,
    intermediate: int = 2880,
    draft_vocab: int = DRAFT_VOCAB,
    taps: Sequence[int] | None = None,
) -> dict:
    """The config.json of a head in format `fmt` for the model whose config.json is `model`,
    tapping `taps` (default: `default_taps`), written as the format counts them."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: one of {', '.join(FORMATS)}")
    taps = list(taps or default_taps(model["num_hidden_layers"]))
    # The RoPE as the released heads write it; transformers 5 writes a model's as one dict.
    rope = dict(model.get("rope_parameters") or {})
    rope_theta = model.get("rope_theta", rope.pop("rope_theta", 10000.0))
    rope_scaling = model.get(
        "rope_scaling", rope if rope.get("rope_type", "default") != "default" else None
    )
    layer = {
        "model_type": "llama",
        "hidden_size": model["hidden_size"],
        "num_attention_heads": model["num_attention_heads"],
        "num_key_value_heads": model["num_key_value_heads"],
        "head_dim": model["head_dim"],
        "intermediate_size": intermediate,
        "num_hidden_layers": 1,
        "rms_norm_eps": model["rms_norm_eps"],
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": model["max_position_embeddings"],
        "vocab_size": model["vocab_size"],
        "hidden_act": "silu",
    }
    if fmt == "speculators":
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer,
            "draft_vocab_size": draft_vocab,
            "target_hidden_size": model["hidden_size"],
            "norm_before_fc": True,
            "norm_before_residual": False,
            "eagle_aux_hidden_state_layer_ids": taps,
            "speculators_config": {
                "algorithm": "eagle3",
                "verifier": {"name_or_path": model.get("_name_or_path", "")},
            },
        }
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **layer,
        "draft_vocab_size": draft_vocab,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": taps,
            "use_aux_hidden_state": True,
            "norm_before_fc": True,
        },
    }


def model_fields(cfg: ModelConfig) -> dict:
    """The config.json fields `head_config` reads, from a loaded model's config (a GGUF file
    has no config.json)."""
    return {
        "num_hidden_layers": cfg.n_layers,
        "hidden_size": cfg.dim,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
    }


def head_tensors(config: dict, fmt: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 weights (norms at one) under the format's names, with d2t (and t2d)."""
    layer = config.get("transformer_layer_config", config)
    H, V = layer["hidden_size"], layer["vocab_size"]
    nh, nkv, hd = layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]
    inter, Vd = layer["intermediate_size"], config["draft_vocab_size"]
    gen = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    p = "layers.0."
    tensors = {
        "fc.weight": weight(H, 3 * H),
        "input_norm.weight": ones(3 * H),
        p + "self_attn.q_proj.weight": weight(nh * hd, 2 * H),
        p + "self_attn.k_proj.weight": weight(nkv * hd, 2 * H),
        p + "self_attn.v_proj.weight": weight(nkv * hd, 2 * H),
        p + "self_attn.o_proj.weight": weight(H, nh * hd),
        p + "mlp.gate_proj.weight": weight(inter, H),
        p + "mlp.up_proj.weight": weight(inter, H),
        p + "mlp.down_proj.weight": weight(H, inter),
        p + "input_layernorm.weight": ones(H),
        p + "hidden_norm.weight": ones(H),
        p + "post_attention_layernorm.weight": ones(H),
        "norm.weight": ones(H),
    }
    if not Vd:  # a head that reads its features through the model's own head
        return tensors
    tensors["lm_head.weight"] = weight(Vd, H)
    rest = torch.randperm(V - Vd // 2, generator=gen)[: Vd - Vd // 2] + Vd // 2
    ids = torch.sort(torch.cat([torch.arange(Vd // 2), rest])).values
    tensors["d2t"] = ids - torch.arange(Vd)
    if fmt == "speculators":
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    return tensors


def synthesize_head(
    like: str,
    out: str | Path,
    fmt: str,
    seed: int = 0,
    intermediate: int = 2880,
    taps: Sequence[int] | None = None,
) -> Path:
    """Write a head for the released model `like` in format `fmt` to the folder `out` (tapping
    `taps`, default the released heads' `default_taps`)."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    model = {**LIKE[like], "_name_or_path": f"openai/{like}"}
    config = head_config(model, fmt, intermediate, taps=taps)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(head_tensors(config, fmt, seed), folder / "model.safetensors")
    return folder
