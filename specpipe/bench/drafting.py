"""What drafting costs the tail each round: the model's shipped head against an EAGLE-3 head of
the model's own shapes, the same trees for both.

Both heads sit on the tail of a one-process ring of the model, as a stage worker holds them
(`Target.local_ring`). A prompt of `context` tokens goes through one round, so each head has
the session's rows it drafts after; then each tree size is drafted `repeats` times from the
last row, the tree of that many nodes that the prior acceptance makes best (`TreeSize` with its
size fixed), and each round's drafter work is timed: `remember` of one committed row, then
`draft_tree`, the two heads taking turns. The EAGLE-3 head is synthesized (random weights in
the released layout, the target's width and MLP) with the shipped head's draft vocabulary size
(the published heads' 32 000 when the model ships none). Its layer's cost does not depend on
what its weights learned; its ranking's does: random weights draft from a nearly flat
distribution (top-p 0.95 kept 6,800 of 8,192 tokens a node on the default model), a trained
head from a peaked one (the shipped head's: 18 on average), and the noise and the cut are drawn
over what is kept. Its lm_head is scaled by `PEAK`, which makes it keep about 26.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from specpipe.core.ring import Round
from specpipe.core.sampling import SamplingParams
from specpipe.core.tree import TreeShape

DRAFT_VOCAB = 32_000  # the published EAGLE-3 heads' draft vocabulary
MAX_DEPTH = 8
PEAK = 5.0  # the synthesized head's lm_head scale: a distribution about as peaked as a trained one


def tree_of(size: int) -> TreeShape:
    """The best-first tree of `size` drafts under the prior acceptance."""
    from specpipe.drafting.length import DraftLength
    from specpipe.drafting.tree_size import TreeSize

    return TreeSize(MAX_DEPTH, DraftLength(MAX_DEPTH), size).choose()


def write_eagle3_head(model: str, folder: Path, draft_vocab: int) -> Path:
    """A random EAGLE-3 head (EAGLE format) for `model` in `folder`."""
    from safetensors.torch import save_file

    from specpipe.drafting.eagle3_synth import head_config, head_tensors, model_fields
    from specpipe.transformer.resolve import open_checkpoint

    cfg = open_checkpoint(model).config
    vocab = min(draft_vocab, cfg.vocab_size)
    config = head_config(model_fields(cfg), "eagle", cfg.intermediate_size, vocab)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = head_tensors(config, "eagle")
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * PEAK
    save_file(tensors, folder / "model.safetensors")
    return folder


class DraftingRound:
    """One head's drafter work of a round, after a prompt went through its ring."""

    def __init__(self, ring, prompt: Sequence[int], params: SamplingParams) -> None:
        self.ring, self.params, self.session = ring, params, "bench-drafting"
        ring.reset(self.session, params)
        result = ring.round(Round(self.session, prompt, 0, head_k=1))
        self.token, self.token_pos = int(result[0]), len(prompt)
        self.feature = ring.stages[-1].features[self.session][-1]

    def seconds(self, shape: TreeShape) -> float:
        """Remember the last committed row, then draft a tree of `shape`: the time it took."""
        drafter, feature = self.ring.head, self.feature
        started = time.perf_counter()
        drafter.remember(self.session, feature.reshape(1, -1), [self.token], self.token_pos)
        drafter.draft_tree(self.session, feature, self.token, self.token_pos, shape, self.params)
        return time.perf_counter() - started


def interleaved_medians(
    rounds: dict[str, DraftingRound], shape: TreeShape, repeats: int
) -> dict[str, float]:
    """Each head's median milliseconds for `shape`, the heads taking turns repetition by
    repetition, so that a machine that slows down meanwhile slows both alike."""
    spent: dict[str, list[float]] = {name: [] for name in rounds}
    for _ in range(repeats + 1):  # the first warms up
        for name, one in rounds.items():
            spent[name].append(one.seconds(shape))
    return {name: 1000 * statistics.median(times[1:]) for name, times in spent.items()}


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
    with tempfile.TemporaryDirectory() as folder:
        head = str(write_eagle3_head(model, Path(folder), draft_vocab))
        rounds = {
            "shipped": DraftingRound(ring, prompt, params),
            "eagle3": DraftingRound(target.local_ring(1, draft_head=head), prompt, params),
        }
    times = {size: interleaved_medians(rounds, shape, repeats) for size, shape in shapes.items()}
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
                "shipped_ms": round(times[size]["shipped"], 2),
                "eagle3_ms": round(times[size]["eagle3"], 2),
                "ratio": round(times[size]["eagle3"] / times[size]["shipped"], 2),
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
