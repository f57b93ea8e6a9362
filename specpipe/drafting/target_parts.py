"""What a draft head borrows from the target (its embedding, final norm and head), and the error
of a head that cannot be used: shared by every kind of head."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F


class DraftHeadError(ValueError):
    """A head file that cannot be used: missing, malformed, or for another model."""


@dataclass(frozen=True)
class TargetParts:
    """What the head borrows from the target, all frozen: token embedding, final norm, LM head."""

    embed: Callable[[torch.Tensor], torch.Tensor]  # ids [N] -> [N, D]
    norm: Callable[[torch.Tensor], torch.Tensor]  # [N, D] -> [N, D]
    head: Callable[[torch.Tensor], torch.Tensor]  # [N, D] -> logits [N, V]
    head_weight: torch.Tensor | None = None  # [V, D] plain, for a head on part of the vocabulary
    embed_weight: torch.Tensor | None = None  # [V, D] a table held for `embed` alone (a tail's)

    @classmethod
    def from_stage(cls, stage, embed_weight: torch.Tensor | None = None) -> TargetParts:
        """The parts of a `StageModel` that is stage 0 and the tail at once (the whole model),
        a tail given the embedding table `embed_weight` [V, D], or a tail whose head is tied to
        the embedding and still held plain."""
        if not stage.last:
            raise DraftHeadError("a draft head needs the tail: its final norm and head")
        if stage.embed is not None:
            embed = stage.embed
        elif embed_weight is not None:
            embed = partial(embed_rows, embed_weight)
        elif stage.cfg.tie_word_embeddings and stage.head.weight is not None:
            weight = stage.head.weight  # [V, D], tied: the embedding table itself
            embed = lambda ids: F.embedding(ids, weight)  # noqa: E731
        else:
            raise DraftHeadError("this tail holds no token embedding for the draft head")
        # Drafts need no row stability: the head's product on its one row, unpadded.
        head, head_weight = stage.head, stage.head.weight
        if head_weight is None and stage.cfg.tie_word_embeddings and stage.embed is not None:
            head_weight = stage.embed.weight
        if head_weight is not None:
            head = lambda x: F.linear(x, head_weight)  # noqa: E731
        own_table = embed_weight if stage.embed is None else None
        return cls(embed, stage.norm, head, head_weight, own_table)


def embed_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The rows of `table` [V, D] for `ids` [N], on the ids' device: a table kept in host memory
    gathers there, and only its N rows cross to the card."""
    return F.embedding(ids.to(table.device), table).to(ids.device)
