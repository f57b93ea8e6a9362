"""Our stages against transformers' GptOss at gpt-oss's real shapes, on the CPU.

A model of the released layout cut to its first layers (`synth.synthesize(n_layers=…)`: the
real embedding, layers, norm and head, random MXFP4 experts) is run by our `StageModel` (experts
kept packed, unpacked one routed expert at a time) and by transformers (every expert unpacked by
transformers' own MXFP4 decoder), both in float32, one after the other so that only one model is
in memory: the logits of a prompt, and greedy decoding from it, token by token.

transformers holds every expert unpacked: gpt-oss-20b's 32 experts take 3.2 GB a layer in
float32, gpt-oss-120b's 128 take 12.7 GB, so on a 24 GB machine two layers of the 20b's shapes
(the same layer shapes, fewer experts) is what fits.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch

TOLERANCE = 1e-4  # the tiny fixtures' absolute tolerance on float32 logits


def _ours(path: Path, n_layers: int, ids: torch.Tensor, steps: int) -> tuple:
    from specpipe.transformer.layer_range import load_stage
    from specpipe.transformer.resolve import open_checkpoint

    stage = load_stage(open_checkpoint(path), 0, n_layers)  # float32
    logits = stage.forward("p", ids, 0)
    tokens, pos, last = [], len(ids), logits[-1]
    for _ in range(steps):
        token = int(last.argmax())
        tokens.append(token)
        last = stage.forward("p", torch.tensor([token]), pos)[-1]
        pos += 1
    return logits, tokens


def _theirs(path: Path, ids: torch.Tensor, steps: int) -> tuple:
    import json
    import warnings

    import transformers
    from safetensors import safe_open
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config")
    config = transformers.GptOssConfig(**config)
    # Built without weights (no random init to overwrite: time, and a second copy in memory),
    # then given the checkpoint's tensors in float32, the experts unpacked by transformers.
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = transformers.GptOssForCausalLM(config).eval()
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith("_scales"):
                    continue
                if name.endswith("_blocks"):
                    name = name.removesuffix("_blocks")
                    blocks, scales = f.get_tensor(name + "_blocks"), f.get_tensor(name + "_scales")
                    state[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                else:
                    state[name] = f.get_tensor(name).float()
    model.load_state_dict(state, strict=True, assign=True)  # a name either side lacks: an error
    del state
    # The rotary frequencies are computed, not loaded: made again, on the CPU.
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    with torch.no_grad():  # greedy by whole forwards: ours decodes from its cache, step by step
        logits = model(ids[None]).logits[0]
        tokens, last = [], logits[-1]
        for _ in range(steps):
            tokens.append(int(last.argmax()))
            last = model(torch.cat([ids, torch.tensor(tokens)])[None]).logits[0, -1]
    return logits, tokens


def run(like: str = "gpt-oss-20b", n_layers: int = 2, tokens: int = 12, steps: int = 8) -> dict:
    """Make the cut model, run both, compare; the checkpoint is removed after."""
    from specpipe.transformer.config import ModelConfig
    from specpipe.transformer.synth import synthesize

    root = Path(tempfile.mkdtemp(prefix="parity-"))
    try:
        started = time.perf_counter()
        made = synthesize(like, root / "model", n_layers=n_layers)
        made_s = time.perf_counter() - started
        vocab = ModelConfig.from_file(made.path / "config.json").vocab_size
        ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0))
        started = time.perf_counter()
        ours, our_tokens = _ours(made.path, n_layers, ids, steps)
        ours_s = time.perf_counter() - started
        started = time.perf_counter()
        theirs, their_tokens = _theirs(made.path, ids, steps)
        theirs_s = time.perf_counter() - started
    finally:
        shutil.rmtree(root, ignore_errors=True)
    diff = float((ours - theirs).abs().max())
    same_argmax = bool(torch.equal(ours.argmax(-1), theirs.argmax(-1)))
    passed = diff <= TOLERANCE and same_argmax and our_tokens == their_tokens
    return {
        "model": like,
        "layers": n_layers,
        "checkpoint_bytes": made.bytes,
        "prompt_tokens": tokens,
        "logits_scale": float(theirs.abs().max()),
        "max_abs_diff": diff,
        "tolerance": TOLERANCE,
        "argmax_identical": same_argmax,
        "greedy_ours": our_tokens,
        "greedy_transformers": their_tokens,
        "greedy_identical": our_tokens == their_tokens,
        "seconds": {
            "make": round(made_s, 1),
            "ours": round(ours_s, 1),
            "transformers": round(theirs_s, 1),
        },
        "verdict": "PASS" if passed else "FAIL",
    }
