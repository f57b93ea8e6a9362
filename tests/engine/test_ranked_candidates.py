"""A drafter's ranked candidates: the nodes of one depth ranked together, each as it would be
alone, the first of each the coupled draft."""

from __future__ import annotations

import numpy as np
import pytest

from specpipe.core.coupling import gumbel_noise
from specpipe.core.sampling import SamplingParams, target_probs
from specpipe.drafting.coupled import coupled_draft, ranked_at

RNG = np.random.default_rng(3)
# Rows of different peakiness, so that each keeps other tokens under top-p.
LOGITS = RNG.normal(size=(5, 300)) * np.array([[0.5], [1.0], [3.0], [6.0], [0.1]])
IDS = np.arange(300) * 7 + 2  # a draft vocabulary: column c is token 7c + 2


def alone(row, params, position, ids, n):
    """The row's candidates written out: its own kept tokens and their noise, best first."""
    if params.temp <= 0:
        order = sorted(range(len(row)), key=lambda c: (-row[c], c))
        return [int(ids[c]) for c in order[:n]]
    q = target_probs(row, params.temp, params.top_p, params.top_k)
    kept = np.flatnonzero(q > 0)
    scores = np.log(q[kept]) + gumbel_noise(params.seed, position, ids[kept])
    order = sorted(range(len(kept)), key=lambda i: (-scores[i], kept[i]))
    return [int(ids[kept[i]]) for i in order[:n]]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temp=0.0),
        SamplingParams(temp=0.7, top_p=0.95, seed=11),
        SamplingParams(temp=1.0, top_k=20, seed=5),
        SamplingParams(temp=0.9, top_p=0.5, top_k=40, seed=2),
    ],
    ids=["greedy", "top-p", "top-k", "both"],
)
def test_each_row_is_ranked_as_it_would_be_alone_and_leads_with_the_coupled_draft(params):
    ranked = ranked_at(LOGITS, params, 41, IDS, 4)
    assert ranked == [alone(row, params, 41, IDS, 4) for row in LOGITS]
    assert [r[0] for r in ranked] == [coupled_draft(row, params, 41, IDS) for row in LOGITS]
    if params.temp > 0:  # another position draws other noise
        assert ranked_at(LOGITS, params, 42, IDS, 4) != ranked
