"""Released EAGLE-3 heads read as they are published, in either of their two formats.

- **EAGLE / ModelOpt** (SafeAILab's EAGLE, nvidia's Model Optimizer, SpecForge): `config.json`
  is a Llama config with `architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size` (null:
  no `lm_head`, the target's head reads the features) and the taps in
  `eagle_config.eagle_aux_hidden_state_layer_ids` (or at the top level). The layer's tensors are
  `layers.0.*`, or `midlayer.*` in SafeAILab's checkpoints.
- **speculators** (`speculators_model_type: "eagle3"`): the layer's numbers in
  `transformer_layer_config`, the head's own flags beside them (`norm_before_fc`, `fc_norm`,
  `norm_before_residual`, `norm_output`, `target_hidden_size`), the taps at the top level.

Both count taps the way vLLM does, the state entering layer k (transformers' `hidden_states[k]`;
gpt-oss-120b's defaults 2, 18, 33, nvidia's v3 head 24, 30, 36 with 36 the last layer's output).
Heads trained with SpecForge count the output of layer k instead (their first tap is 1, the
output of layer 1, where the default is the state entering layer 2), as SGLang reads them: an
EAGLE-format head whose first tap is 1 is read that way, every tap one further on. A head without
taps gets the defaults (`eagle3.default_taps`).

`t2d` (training only), a copy of the target's embedding (`embed_tokens`, frozen: the target's is
used) and the verifier's head are skipped; anything else unknown is refused, as is a head that
does not fit the model (its width, its vocabulary, its taps), each in one line. Weights come from
safetensors files only: a pickled checkpoint is refused, never loaded.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from specpipe.drafting.eagle3 import Eagle3Config, Eagle3Head, default_taps
from specpipe.drafting.target_parts import DraftHeadError

FORMATS = ("eagle", "speculators")
SKIPPED = ("t2d", "embed_tokens.weight", "verifier_lm_head.weight")
LAYER = {  # the decoder layer's tensors, as `Eagle3Head` names them
    "self_attn.q_proj.weight": "q_proj.weight",
    "self_attn.k_proj.weight": "k_proj.weight",
    "self_attn.v_proj.weight": "v_proj.weight",
    "self_attn.o_proj.weight": "o_proj.weight",
    "mlp.gate_proj.weight": "gate_proj.weight",
    "mlp.up_proj.weight": "up_proj.weight",
    "mlp.down_proj.weight": "down_proj.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "hidden_norm.weight": "hidden_norm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
}
OWN = ("fc.weight", "input_norm.weight", "norm.weight", "lm_head.weight", "d2t")
FC_NORM = re.compile(r"fc_norm\.(\d+)\.weight")


def head_format(config: dict[str, Any]) -> str:
    """ "speculators" or "eagle"; DraftHeadError for a config of neither."""
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    if "LlamaForCausalLMEagle3" in (config.get("architectures") or []):
        return "eagle"
    if "eagle_config" in config:
        return "eagle"
    kind = config.get("speculators_model_type") or config.get("architectures")
    raise DraftHeadError(f"not an EAGLE-3 head: its config.json describes {kind!r}")


def read_config(folder: Path, target_layers: int) -> Eagle3Config:
    """The head's numbers from its config.json, the taps in transformers' counting."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise DraftHeadError(f"{folder} holds no config.json: not a released head") from None
    except ValueError as exc:
        raise DraftHeadError(f"{folder}/config.json is not JSON: {exc}") from None
    fmt = head_format(config)
    layer = config.get("transformer_layer_config", {}) if fmt == "speculators" else config
    eagle = config.get("eagle_config") or {}

    def flag(name: str) -> bool:
        return bool(config.get(name, eagle.get(name, False)))

    try:
        hidden = int(layer["hidden_size"])
        heads = int(layer["num_attention_heads"])
        vocab = int(layer["vocab_size"])
        draft_vocab = config.get("draft_vocab_size")
        taps = config.get("eagle_aux_hidden_state_layer_ids") or eagle.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        if taps and fmt == "eagle" and int(taps[0]) == 1:
            taps = [int(t) + 1 for t in taps]  # SpecForge's output-of-layer counting
        return Eagle3Config(
            hidden=hidden,
            heads=heads,
            kv_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads),
            intermediate=int(layer["intermediate_size"]),
            draft_vocab=int(draft_vocab) if draft_vocab else vocab,
            target_vocab=vocab,
            taps=tuple(int(t) for t in taps) if taps else default_taps(target_layers),
            target_hidden=int(config.get("target_hidden_size") or hidden),
            norm_eps=float(layer.get("rms_norm_eps", 1e-5)),
            rope_theta=float(layer.get("rope_theta", 10000.0)),
            rope_scaling=layer.get("rope_scaling"),
            max_positions=int(layer.get("max_position_embeddings", 131072)),
            norm_before_fc=flag("norm_before_fc"),
            fc_norm=flag("fc_norm"),
            norm_before_residual=flag("norm_before_residual"),
            norm_output=flag("norm_output"),
            has_lm_head=bool(draft_vocab),
            extra={"format": fmt, "path": str(folder)},
        )
    except (KeyError, TypeError, ValueError) as exc:
        reason = f"{folder}/config.json: a number is missing or wrong ({exc})"
        raise DraftHeadError(reason) from None


def head_name(name: str) -> str | None:
    """A checkpoint's tensor name as `Eagle3Head` has it; None for one that is skipped;
    DraftHeadError for one an EAGLE-3 head does not hold."""
    name = name.removeprefix("model.")
    if name in SKIPPED:
        return None
    for prefix in ("layers.0.", "midlayer."):
        if name.startswith(prefix) and name[len(prefix) :] in LAYER:
            return LAYER[name[len(prefix) :]]
    if name in OWN or FC_NORM.fullmatch(name):
        return name
    raise DraftHeadError(f"the head holds a tensor an EAGLE-3 head does not: {name!r}")


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head's safetensors files, under `Eagle3Head`'s names."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in folder.glob("*") if p.suffix in (".bin", ".pt", ".pth"))
        if pickled:
            raise DraftHeadError(
                f"{folder} holds {pickled[0]}, a pickled checkpoint, which is never loaded: "
                "convert it to safetensors"
            )
        raise DraftHeadError(f"{folder} holds no .safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                ours = head_name(name)
                if ours is not None:
                    tensors[ours] = handle.get_tensor(name)
    return tensors


def load_eagle3(
    path: str | Path,
    target_hidden: int,
    target_vocab: int,
    target_layers: int,
    dtype: torch.dtype = torch.float32,
) -> Eagle3Head:
    """The released head in folder `path`, checked against the model it is to draft for;
    DraftHeadError, in one line, when it cannot be used with it."""
    folder = Path(path)
    cfg = read_config(folder, target_layers)
    check_fits(cfg, target_hidden, target_vocab, target_layers)
    tensors = read_tensors(folder)
    if cfg.fc_norm and "input_norm.weight" in tensors:
        raise DraftHeadError("the head norms its taps both together and one by one")
    head = Eagle3Head(cfg).to(dtype)
    want = head.state_dict()
    missing = [n for n in want if n not in tensors and n != "d2t"]
    if missing:
        raise DraftHeadError(f"the head has no {missing[0]!r} tensor")
    if "d2t" not in tensors and cfg.draft_vocab != cfg.target_vocab:
        raise DraftHeadError(
            f"the head drafts {cfg.draft_vocab} of the model's {cfg.target_vocab} tokens "
            "but has no d2t to say which"
        )
    for name, tensor in tensors.items():
        if name not in want:
            raise DraftHeadError(f"the head's {name!r} does not belong to its config")
        if tuple(tensor.shape) != tuple(want[name].shape):
            shape, says = list(tensor.shape), list(want[name].shape)
            raise DraftHeadError(f"the head's {name} is {shape}; its config says {says}")
    state = {n: t.to(torch.long if n == "d2t" else dtype) for n, t in tensors.items()}
    head.load_state_dict(state, strict=False)
    ids = head.token_ids()
    if len(ids) and (ids.min() < 0 or ids.max() >= target_vocab):
        raise DraftHeadError(f"the head's d2t maps drafts past the model's {target_vocab} tokens")
    return head.eval()


def check_fits(cfg: Eagle3Config, target_hidden: int, target_vocab: int, target_layers: int):
    """DraftHeadError unless a head of `cfg` can draft for a model of these numbers."""
    if cfg.tap_width != target_hidden:
        raise DraftHeadError(
            f"the head takes taps {cfg.tap_width} wide; this model's hidden size is {target_hidden}"
        )
    if cfg.target_vocab != target_vocab:
        raise DraftHeadError(
            f"the head drafts for {cfg.target_vocab} tokens; this model's vocabulary has "
            f"{target_vocab}"
        )
    if cfg.draft_vocab > target_vocab:
        raise DraftHeadError(f"the head's {cfg.draft_vocab} draft tokens exceed the model's")
    outside = [t for t in cfg.taps if not 0 <= t <= target_layers]
    if outside:
        raise DraftHeadError(
            f"the head taps the state entering layer {outside[0]}; "
            f"this model has {target_layers} layers"
        )
