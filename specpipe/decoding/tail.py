"""The tail's end of a round, written once for every ring: verify the drafts against the logits
(the sampler's doctored result vector and the committed tokens' log-probabilities), then let the
draft head propose the next round's drafts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specpipe.core.ring import RoundResult, Stage
from specpipe.core.sampling import Sampler

if TYPE_CHECKING:
    from specpipe.drafting.head import TailHead


def finish_round(
    tail: Stage,
    session: str,
    logits: torch.Tensor,
    tokens: Sequence[int],
    start_pos: int,
    n_draft: int,
    sampler: Sampler,
    head: TailHead | None = None,
    head_k: int = 0,
) -> RoundResult:
    """The round's result from the tail stage's `logits` (at least its last `n_draft + 1` rows)
    for `tokens` at `start_pos`, whose last `n_draft` are drafts; with up to `head_k` drafts for
    the next round from `head`, which drafts from `tail.features[session]`. ValueError when
    the drafts or the logits cannot be verified (a draft id outside the vocabulary, NaN)."""
    drafts = list(tokens)[len(tokens) - n_draft :] if n_draft else []
    rows = logits[-(n_draft + 1) :]
    first_sampled = start_pos + len(tokens) - n_draft
    result = sampler.accept(rows, drafts, first_sampled)
    logprobs = sampler.result_logprobs(rows, result)
    proposal: list[int] = []
    if head is not None and head_k > 0:
        features = tail.features[session]
        proposal = head.drafts_after(features, result, first_sampled, head_k, sampler.params)
    return RoundResult(result, logprobs, proposal)
