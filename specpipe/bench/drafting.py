"""What drafting costs the tail each round: the model's shipped head against an EAGLE-3 head of
the model's own shapes, the same trees for both.

Both heads sit on the tail of a one-process ring of the model, as a stage worker holds them
(`Target.local_ring`). A prompt of `context` tokens goes through one round, so each head has
the session's rows it drafts after; then each tree size is drafted `repeats` times from the
last row, the tree of that many nodes that the prior acceptance makes best (`TreeSize` with its
size fixed), and each round's drafter work is timed: `remember` of one committed row, then
`draft_tree`. The EAGLE-3 head is synthesized (random weights in the released layout, the
target's width and MLP) with the shipped head's draft vocabulary size (the published heads'
32 000 when the model ships none): its cost does not depend on what its weights learned.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from specpipe.core.sampling import SamplingParams
from specpipe.core.tree import TreeShape

DRAFT_VOCAB = 32_000  # the published EAGLE-3 heads' draft vocabulary
MAX_DEPTH = 8


def tree_of(size: int) -> TreeShape:
    """The best-first tree of `size` drafts under the prior acceptance."""
    from specpipe.drafting.length import DraftLength
    from specpipe.drafting.tree_size import TreeSize

    return TreeSize(MAX_DEPTH, DraftLength(MAX_DEPTH), size).choose()


def write_eagle3_head(model: str, folder: Path, draft_vocab: int) -> Path:
    """A random EAGLE-3 head (EAGLE format) for `model` in `folder`."""
    from safetensors.torch import save_file

    from specpipe.drafting.eagle3_synth import head_config, head_tensors, model_fields
    from specpipe.model.resolve import open_checkpoint

    cfg = open_checkpoint(model).config
    vocab = min(draft_vocab, cfg.vocab_size)
    config = head_config(model_fields(cfg), "eagle", cfg.intermediate_size, vocab)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(head_tensors(config, "eagle"), folder / "model.safetensors")
    return folder


def time_head(
    ring, prompt: Sequence[int], shapes: dict[int, TreeShape], params: SamplingParams, repeats: int
) -> dict[int, float]:
    """Per tree size, the median milliseconds of one round's drafter work on `ring`'s tail."""
    session = "bench-drafting"
    ring.reset(session, params)
    result = ring.round(session, list(prompt), 0, 0, head_k=1)
    tail, drafter = ring.stages[-1], ring.head
    token, token_pos = int(result[0]), len(prompt)
    feature = tail.features[session][-1]
    medians = {}
    for size, shape in shapes.items():
        spent = []
        for _ in range(repeats + 1):  # the first warms up
            started = time.perf_counter()
            drafter.remember(session, feature.reshape(1, -1), [token], token_pos)
            drafter.draft_tree(session, feature, token, token_pos, shape, params)
            spent.append(time.perf_counter() - started)
        medians[size] = 1000 * statistics.median(spent[1:])
    ring.drop(session)
    return medians


def measure(
    model: str, sizes: Sequence[int], context: int, repeats: int, params: SamplingParams
) -> dict:
    """Both heads' drafting milliseconds per round for each tree size, and their ratio."""
    import torch

    from specpipe.decoding.target import open_target
    from specpipe.drafting.train import EVAL_PROMPTS

    target = open_target(model)
    prompt = target.prompt_ids(" ".join(EVAL_PROMPTS), raw=True)
    while len(prompt) < context:
        prompt = prompt + prompt
    prompt = prompt[:context]
    shapes = {size: tree_of(size) for size in sizes}
    torch.set_num_threads(1)  # as a stage worker runs by default on these machines
    ring = target.local_ring(1)
    if ring.head is None:
        raise ValueError(f"model {model!r} ships no draft head to compare with")
    columns = ring.head.head.token_ids()  # the shipped head's draft vocabulary (None: all)
    draft_vocab = DRAFT_VOCAB if columns is None else len(columns)
    shipped = time_head(ring, prompt, shapes, params, repeats)
    with tempfile.TemporaryDirectory() as folder:
        head = str(write_eagle3_head(model, Path(folder), draft_vocab))
        eagle3 = time_head(target.local_ring(1, draft_head=head), prompt, shapes, params, repeats)
    return {
        "model": model,
        "context": context,
        "repeats": repeats,
        "temp": params.temp,
        "draft_vocab": draft_vocab,
        "sizes": [
            {
                "drafts": size,
                "depth": max(shapes[size].depths),
                "shipped_ms": round(shipped[size], 2),
                "eagle3_ms": round(eagle3[size], 2),
                "ratio": round(eagle3[size] / shipped[size], 2),
            }
            for size in sizes
        ],
    }


def report(result: dict) -> list[str]:
    lines = [
        f"{result['model']}: drafting per round after {result['context']} tokens, "
        f"temp {result['temp']}, draft vocabulary {result['draft_vocab']}, median of "
        f"{result['repeats']} (remember one row + draft the tree)",
        f"{'drafts':>6} {'depth':>5} {'shipped ms':>10} {'EAGLE-3 ms':>10} {'ratio':>6}",
    ]
    for row in result["sizes"]:
        lines.append(
            f"{row['drafts']:>6} {row['depth']:>5} {row['shipped_ms']:>10.2f} "
            f"{row['eagle3_ms']:>10.2f} {row['ratio']:>6.2f}"
        )
    return lines
