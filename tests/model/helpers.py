"""Running a model split into stages, as the ring would, inside one test process."""

from __future__ import annotations

import torch

from specpipe.transformer.layer_range import StageModel, load_stage


def load_split(source_factory, sizes: list[int], **kw) -> list[StageModel]:
    """Stages of the given sizes, each loaded from its own freshly opened source."""
    stages, start = [], 0
    for n in sizes:
        stages.append(load_stage(source_factory(), start, start + n, **kw))
        start += n
    return stages


def run_split(stages: list[StageModel], session: str, ids: torch.Tensor, pos: int) -> torch.Tensor:
    """Pass ids at absolute position `pos` through every stage; return the tail's logits."""
    x = ids
    for stage in stages:
        x = stage.forward(session, x, pos)
    return x
