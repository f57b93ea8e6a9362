"""ModelConfig: the architecture numbers of one decoder-only transformer, from config.json or GGUF.

One dataclass serves both families. The Llama family (Llama, SmolLM2, Qwen2, Mistral) needs the
first block of fields; gpt-oss adds experts, sinks, sliding windows and YaRN. Derived fields are
filled in `__post_init__`, so a config built by hand and one read from a file look the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specpipe.transformer.errors import ModelError

ARCHITECTURES = ("llama", "gpt_oss")
# model_type values in config.json that run on the Llama code path.
LLAMA_LIKE = {"llama": False, "mistral": False, "qwen2": True}  # value: q/k/v carry biases


@dataclass
class ModelConfig:
    """The numbers that define the network; everything else is derived from them."""

    arch: str  # "llama" or "gpt_oss"
    vocab_size: int
    dim: int  # hidden size
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # rope_type "llama3" or "yarn" and its numbers
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    # gpt-oss
    n_experts: int = 0
    experts_per_token: int = 0
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # "sliding_attention" / "full_attention"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mxfp4: bool = False  # expert weights stored as *_blocks / *_scales
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ModelError(f"unknown architecture {self.arch!r}")
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.n_layers
        if self.n_heads % self.n_kv_heads:
            raise ModelError(f"{self.n_heads} heads do not split into {self.n_kv_heads} kv heads")

    @property
    def has_sinks(self) -> bool:
        return self.arch == "gpt_oss"

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def window(self, layer: int) -> int | None:
        """The sliding window of one layer (None: full attention)."""
        if self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @classmethod
    def from_hf(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a transformers `config.json` dictionary."""
        model_type = d.get("model_type")
        if model_type not in LLAMA_LIKE and model_type != "gpt_oss":
            raise ModelError(f"{source}: unknown model_type {model_type!r}")
        try:
            rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
            theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            eos = d.get("eos_token_id")
            eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
            quant = d.get("quantization_config") or {}
            kw: dict[str, Any] = dict(
                vocab_size=d["vocab_size"],
                dim=d["hidden_size"],
                n_layers=d["num_hidden_layers"],
                n_heads=d["num_attention_heads"],
                n_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
                intermediate_size=d["intermediate_size"],
                head_dim=d.get("head_dim") or 0,
                norm_eps=d.get("rms_norm_eps", 1e-5),
                rope_theta=float(theta),
                rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
                max_position_embeddings=d.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
            if model_type == "gpt_oss":
                n = d["num_hidden_layers"]
                kw.update(
                    arch="gpt_oss",
                    qkv_bias=d.get("attention_bias", True),
                    o_bias=d.get("attention_bias", True),
                    n_experts=d["num_local_experts"],
                    experts_per_token=d["num_experts_per_tok"],
                    sliding_window=d.get("sliding_window"),
                    layer_types=list(d.get("layer_types") or ["full_attention"] * n),
                    swiglu_alpha=d.get("swiglu_alpha", 1.702),
                    swiglu_limit=d.get("swiglu_limit", 7.0),
                    mxfp4=quant.get("quant_method") == "mxfp4",
                )
            else:
                bias = d.get("attention_bias", LLAMA_LIKE[model_type])
                kw.update(arch="llama", qkv_bias=bias, o_bias=bias and model_type != "qwen2")
                if model_type == "mistral" and d.get("sliding_window"):
                    kw.update(
                        sliding_window=d["sliding_window"],
                        layer_types=["sliding_attention"] * d["num_hidden_layers"],
                    )
            return cls(**kw)
        except KeyError as e:
            raise ModelError(f"{source}: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ModelError):
                raise
            raise ModelError(f"{source}: {e}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read a `config.json`."""
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except OSError as e:
            raise ModelError(f"{path}: cannot read ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise ModelError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
        if not isinstance(d, dict):
            raise ModelError(f"{path}: not a JSON object")
        return cls.from_hf(d, str(path))
