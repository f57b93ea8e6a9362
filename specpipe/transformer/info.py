"""What a checkpoint holds, from its headers alone: sizes per layer and an even stage split."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from specpipe.transformer.resolve import Checkpoint, even_split

_LAYER = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d+)\.")


def model_info(checkpoint: Checkpoint, n_stages: int = 1) -> dict[str, Any]:
    """Architecture, layer count, parameters, stored dtypes, bytes per layer, a stage split."""
    cfg = checkpoint.config
    per_layer = [0] * cfg.n_layers
    shared = params = 0
    dtypes: Counter[str] = Counter()
    for name in checkpoint.names():
        shape, dtype, nbytes = checkpoint.info(name)
        params += _n_params(checkpoint, name, shape, dtype)
        dtypes[dtype] += nbytes
        match = _LAYER.search(name)
        if match:
            per_layer[int(match.group(1))] += nbytes
        else:
            shared += nbytes
    embed = sum(
        checkpoint.info(n)[2]
        for n in checkpoint.names()
        if n in ("model.embed_tokens.weight", "token_embd.weight")
    )
    tail_extra = shared - embed if not cfg.tie_word_embeddings else shared
    stages = []
    for a, b in even_split(cfg.n_layers, n_stages):
        nbytes = sum(per_layer[a:b])
        nbytes += embed if a == 0 else 0
        nbytes += tail_extra if b == cfg.n_layers else 0
        stages.append({"layers": [a, b], "bytes": nbytes})
    return {
        "path": str(checkpoint.path),
        "format": checkpoint.kind,
        "architecture": cfg.arch,
        "layers": cfg.n_layers,
        "hidden_size": cfg.dim,
        "vocab_size": cfg.vocab_size,
        "parameters": params,
        "dtype": dtypes.most_common(1)[0][0],
        "dtypes": dict(dtypes),
        "bytes": sum(dtypes.values()),
        "bytes_per_layer": max(per_layer),
        "experts": cfg.n_experts,
        "mxfp4": cfg.mxfp4,
        "tied_embeddings": cfg.tie_word_embeddings,
        "stages": stages,
    }


def _n_params(checkpoint: Checkpoint, name: str, shape: list[int], dtype: str) -> int:
    if hasattr(checkpoint, "n_elements"):  # GGUF knows the logical size of quantised tensors
        return checkpoint.n_elements(name)
    n = 1
    for d in shape:
        n *= d
    if name.endswith("_scales"):
        return 0
    if name.endswith("_blocks"):
        return 2 * n  # two 4-bit values per byte
    return n
