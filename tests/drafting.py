"""Generations that draft from the tail's drafter alone, for the tests of heads and trees."""

from __future__ import annotations

from collections.abc import Sequence

from specpipe.core.sampling import SamplingParams
from specpipe.core.tree import TreeShape
from specpipe.decoding.generation import Generation
from specpipe.drafting.sources import named_sources


def head_generation(
    ring,
    session: str,
    prompt: Sequence[int],
    params: SamplingParams,
    n: int,
    draft_k: int = 4,
    tree: TreeShape | None = None,
    trees: bool = False,
) -> Generation:
    """A generation of `n` tokens whose drafts are the tail's drafter's: chains of `draft_k`,
    or with `trees` (or a `tree`, asked for every round) trees sized by their cost."""
    generation = Generation(
        ring,
        session,
        prompt,
        params,
        max_new_tokens=n,
        draft_k=draft_k,
        adaptive=trees or tree is not None,
        trees=trees or tree is not None,
        sources=named_sources("head", params),
    )
    if tree is not None:  # every round asks the tail for this tree
        generation.tree_size.choose = lambda limit=None: tree
    return generation
