"""HF checkpoint directories: config.json plus one or more safetensors files, read tensor by tensor.

A stage asks for the tensors of its layer range by name (`hf_name_map`); only the shard files
holding them are opened, and only those tensors are read. `bytes_read` and `files_opened` count
both, so tests can check that a stage reads its share and nothing else.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specpipe.transformer.config import ModelConfig
from specpipe.transformer.errors import ModelError
from specpipe.transformer.mxfp4 import mxfp4_dequantize

# local parameter name -> (source tensor names, function of those tensors giving the parameter)
NameMap = dict[str, tuple[tuple[str, ...], Callable[..., torch.Tensor]]]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _transpose_experts(t: torch.Tensor) -> torch.Tensor:
    # transformers keeps float experts as [E, in, out] for x @ W; the model uses [E, out, in].
    return t.transpose(1, 2).contiguous()


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """The tensor table of one safetensors file, checked for sanity (no tensor data read)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ModelError(f"{path}: corrupted safetensors header (file too short)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ModelError(f"{path}: corrupted safetensors header (length {n} > file)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ModelError(f"{path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelError(f"{path}: corrupted safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise ModelError(f"{path}: corrupted safetensors header (not a table)")
    header.pop("__metadata__", None)
    for name, info in header.items():
        ok = isinstance(info, dict) and {"dtype", "shape", "data_offsets"} <= info.keys()
        if not ok or info["data_offsets"][1] > size - 8 - n:
            raise ModelError(f"{path}: corrupted safetensors header (entry {name!r})")
    return header


class SafetensorsCheckpoint:
    """An HF checkpoint directory: config.json, model.safetensors or a sharded index."""

    kind = "safetensors"

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory)
        if not self.path.is_dir():
            raise ModelError(f"{self.path}: no such checkpoint directory")
        self.config = ModelConfig.from_file(self.path / "config.json")
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError):
                raise ModelError(f"{index}: unreadable shard index") from None
            self.files = {name: self.path / f for name, f in weight_map.items()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise ModelError(f"{self.path}: no safetensors files")
            self.files = {n: f for f in files for n in read_safetensors_header(f)}
        self._headers: dict[Path, dict] = {}
        self._open: dict[Path, object] = {}
        self.files_opened: set[str] = set()
        self.bytes_read = 0

    def names(self) -> list[str]:
        return list(self.files)

    def info(self, name: str) -> tuple[list[int], str, int]:
        """(shape, dtype name, stored bytes) of one tensor, from its file's header."""
        path = self._file(name)
        if path not in self._headers:
            self._headers[path] = read_safetensors_header(path)
        entry = self._headers[path].get(name)
        if entry is None:
            raise ModelError(f"{path}: tensor {name!r} is listed in the index but missing")
        lo, hi = entry["data_offsets"]
        return list(entry["shape"]), entry["dtype"], hi - lo

    def read(self, name: str) -> torch.Tensor:
        """Read one tensor (and only it) from its shard."""
        path = self._file(name)
        nbytes = self.info(name)[2]
        if path not in self._open:
            try:
                self._open[path] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as e:
                raise ModelError(f"{path}: cannot open safetensors file ({e})") from None
            self.files_opened.add(path.name)
        try:
            t = self._open[path].get_tensor(name)
        except SafetensorError as e:
            raise ModelError(f"{path}: cannot read tensor {name!r} ({e})") from None
        self.bytes_read += nbytes
        return t

    def _file(self, name: str) -> Path:
        try:
            return self.files[name]
        except KeyError:
            raise ModelError(f"{self.path}: checkpoint has no tensor {name!r}") from None

    def name_map(self, start: int, end: int, first: bool, last: bool, packed: bool) -> NameMap:
        return hf_name_map(self.config, start, end, first, last, packed)


def hf_name_map(
    cfg: ModelConfig, start: int, end: int, first: bool, last: bool, packed: bool
) -> NameMap:
    """Which transformers tensors make up the stage holding layers [start, end)."""
    m: NameMap = {}
    if first:
        m["embed.weight"] = (("model.embed_tokens.weight",), _same)
    for j, i in enumerate(range(start, end)):
        src, dst = f"model.layers.{i}.", f"layers.{j}."
        pairs = {
            "attn_norm.weight": "input_layernorm.weight",
            "mlp_norm.weight": "post_attention_layernorm.weight",
            "attn.wo.weight": "self_attn.o_proj.weight",
        }
        qkv = ("weight", "bias") if cfg.qkv_bias else ("weight",)
        for kind in qkv:
            m[f"{dst}attn.wqkv.{kind}"] = (
                tuple(f"{src}self_attn.{x}_proj.{kind}" for x in "qkv"),
                concat_rows,
            )
        if cfg.o_bias:
            pairs["attn.wo.bias"] = "self_attn.o_proj.bias"
        if cfg.has_sinks:
            pairs["attn.sinks"] = "self_attn.sinks"
        if cfg.is_moe:
            pairs.update(
                {
                    "mlp.router.weight": "mlp.router.weight",
                    "mlp.router.bias": "mlp.router.bias",
                    "mlp.experts.gate_up_bias": "mlp.experts.gate_up_proj_bias",
                    "mlp.experts.down_bias": "mlp.experts.down_proj_bias",
                }
            )
        else:
            pairs.update(
                {
                    "mlp.w_down.weight": "mlp.down_proj.weight",
                }
            )
            m[dst + "mlp.w_gate_up.weight"] = (
                (src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"),
                concat_rows,
            )
        for a, b in pairs.items():
            m[dst + a] = ((src + b,), _same)
        if cfg.is_moe:
            m.update(_expert_map(cfg, src + "mlp.experts.", dst + "mlp.experts.", packed))
    if last:
        m["norm.weight"] = (("model.norm.weight",), _same)
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        m["head.weight"] = ((head,), _same)
    return m


def concat_rows(*parts: torch.Tensor) -> torch.Tensor:
    """One weight (or bias) from several stacked along the output dimension: q|k|v, gate|up."""
    return torch.cat(parts, dim=0)


def _expert_map(cfg: ModelConfig, src: str, dst: str, packed: bool) -> NameMap:
    m: NameMap = {}
    for a, b in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
        if cfg.mxfp4 and packed:
            m[f"{dst}{a}_blocks"] = ((f"{src}{b}_blocks",), _same)
            m[f"{dst}{a}_scales"] = ((f"{src}{b}_scales",), _same)
        elif cfg.mxfp4:  # dequantise on load

            def unpack(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
                return mxfp4_dequantize(blocks, scales, torch.float32)

            m[dst + a] = ((f"{src}{b}_blocks", f"{src}{b}_scales"), unpack)
        else:
            m[dst + a] = ((src + b,), _transpose_experts)
    return m
