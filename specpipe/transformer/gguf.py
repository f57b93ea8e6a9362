"""GGUF files (llama.cpp's format) as a checkpoint: config from metadata, tensors dequantised.

Only the tensors of the requested layer range are dequantised (the file is memory-mapped, so
nothing else is read). GGUF conversion permutes the rows of Llama-family q and k projections to
llama.cpp's interleaved RoPE pairs; `read` undoes that so the half-split RoPE of `layers` applies.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specpipe.transformer.checkpoint import NameMap, concat_rows
from specpipe.transformer.config import ModelConfig
from specpipe.transformer.errors import ModelError

GGUF_MAGIC = b"GGUF"
# GGUF architecture -> (q/k rows permuted by the converter, q/k/v carry biases)
ARCHITECTURES = {"llama": (True, False), "qwen2": (False, True)}


def is_gguf(path: Path) -> bool:
    """True when the file starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


@lru_cache(maxsize=4)
def _parsed(path: str, mtime: float) -> tuple[dict[str, Any], dict[str, Any]]:
    # Parsing the metadata (a 49k-token vocabulary) takes a while: parse each file once. The
    # reader itself is not kept: it holds a numpy view per vocabulary string (hundreds of MB).
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError, IndexError, KeyError) as e:
        raise ModelError(f"{path}: not a readable GGUF file ({e})") from None
    return metadata(reader), {t.name: t for t in reader.tensors}


def open_parsed(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A GGUF file's metadata (plain values) and tensors (by name), parsed once; or ModelError."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: no such file")
    if not is_gguf(path):
        raise ModelError(f"{path}: not a GGUF file (bad magic)")
    return _parsed(str(path), os.stat(path).st_mtime)


def metadata(reader) -> dict[str, Any]:
    """The key/value metadata as plain Python values."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


class GGUFCheckpoint:
    """A GGUF file holding a Llama-family model."""

    kind = "gguf"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.meta, self.tensors = open_parsed(self.path)
        self.arch = self.meta.get("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ModelError(f"{self.path}: unknown GGUF architecture {self.arch!r}")
        if "rope_freqs.weight" in self.tensors:
            raise ModelError(f"{self.path}: per-frequency rope factors are not supported")
        self.permuted, bias = ARCHITECTURES[self.arch]
        self.config = self._config(bias)
        self.files_opened: set[str] = set()
        self.bytes_read = 0

    def _config(self, bias: bool) -> ModelConfig:
        m, a = self.meta, self.arch
        try:
            eos = m.get("tokenizer.ggml.eos_token_id")
            vocab = m.get(f"{a}.vocab_size") or len(m["tokenizer.ggml.tokens"])
            n_heads = m[f"{a}.attention.head_count"]
            dim = m[f"{a}.embedding_length"]
            return ModelConfig(
                arch="llama",
                vocab_size=vocab,
                dim=dim,
                n_layers=m[f"{a}.block_count"],
                n_heads=n_heads,
                n_kv_heads=m.get(f"{a}.attention.head_count_kv") or n_heads,
                intermediate_size=m[f"{a}.feed_forward_length"],
                head_dim=m.get(f"{a}.attention.key_length") or dim // n_heads,
                norm_eps=m[f"{a}.attention.layer_norm_rms_epsilon"],
                rope_theta=float(m.get(f"{a}.rope.freq_base", 10000.0)),
                max_position_embeddings=m.get(f"{a}.context_length", 2048),
                tie_word_embeddings="output.weight" not in self.tensors,
                qkv_bias=bias,
                bos_token_id=m.get("tokenizer.ggml.bos_token_id"),
                eos_token_ids=[] if eos is None else [eos],
            )
        except KeyError as e:
            raise ModelError(f"{self.path}: missing metadata {e.args[0]!r}") from None

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> tuple[list[int], str, int]:
        """(shape in PyTorch order, storage type, stored bytes) of one tensor."""
        t = self._tensor(name)
        return [int(d) for d in reversed(t.shape)], t.tensor_type.name, int(t.n_bytes)

    def n_elements(self, name: str) -> int:
        return int(self._tensor(name).n_elements)

    def read(self, name: str) -> torch.Tensor:
        """Dequantise one tensor to float32, undoing the q/k row permutation."""
        from gguf.quants import dequantize

        t = self._tensor(name)
        try:
            values = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ModelError(f"{self.path}: {name} uses unsupported {t.tensor_type.name}") from None
        shape = [int(d) for d in reversed(t.shape)]
        values = np.ascontiguousarray(values, dtype=np.float32)
        if not values.flags.writeable:  # a view of the read-only memory map
            values = values.copy()
        w = torch.from_numpy(values).reshape(shape)
        self.files_opened.add(self.path.name)
        self.bytes_read += int(t.n_bytes)
        if self.permuted and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = self.config.n_heads if "attn_q" in name else self.config.n_kv_heads
            w = unpermute_rows(w, heads)
        return w

    def _tensor(self, name: str):
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelError(f"{self.path}: GGUF file has no tensor {name!r}") from None

    def name_map(self, start: int, end: int, first: bool, last: bool, packed: bool) -> NameMap:
        """Which GGUF tensors make up the stage holding layers [start, end)."""
        same = _same
        m: NameMap = {}
        if first:
            m["embed.weight"] = (("token_embd.weight",), same)
        for j, i in enumerate(range(start, end)):
            pairs = {
                "attn_norm.weight": "attn_norm.weight",
                "mlp_norm.weight": "ffn_norm.weight",
                "attn.wo.weight": "attn_output.weight",
                "mlp.w_down.weight": "ffn_down.weight",
            }
            for a, b in pairs.items():
                m[f"layers.{j}.{a}"] = ((f"blk.{i}.{b}",), same)
            qkv = ("weight", "bias") if self.config.qkv_bias else ("weight",)
            for kind in qkv:
                parts = tuple(f"blk.{i}.attn_{x}.{kind}" for x in "qkv")
                m[f"layers.{j}.attn.wqkv.{kind}"] = (parts, concat_rows)
            gate_up = (f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight")
            m[f"layers.{j}.mlp.w_gate_up.weight"] = (gate_up, concat_rows)
        if last:
            m["norm.weight"] = (("output_norm.weight",), same)
            head = "token_embd.weight" if self.config.tie_word_embeddings else "output.weight"
            m["head.weight"] = ((head,), same)
        return m


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave: (pairs, 2) back to (2, half) within each head."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
