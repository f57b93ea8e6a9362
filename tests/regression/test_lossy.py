"""The test-only lossy tail: off unless switched on, and lossy when it is."""

from __future__ import annotations

import numpy as np

from specpipe.cli.worker import tail_sampling
from specpipe.core.coupling import GumbelSampler
from specpipe.core.sampling import Sampler, SamplingParams, committed_tokens
from specpipe.proofs.lossy import LossySampler
from specpipe.proofs.stats import total_variation


def test_the_lossy_tail_is_off_unless_switched_on(monkeypatch):
    icdf, gumbel = SamplingParams(temp=0.7), SamplingParams(temp=0.7, sampler="gumbel")
    monkeypatch.delenv("SPECPIPE_TEST_LOSSY_TAIL", raising=False)
    assert type(tail_sampling().sampler_for(icdf)) is Sampler
    assert type(tail_sampling().sampler_for(gumbel)) is GumbelSampler
    assert not tail_sampling().lossy
    monkeypatch.setenv("SPECPIPE_TEST_LOSSY_TAIL", "0")
    assert type(tail_sampling().sampler_for(icdf)) is Sampler
    monkeypatch.setenv("SPECPIPE_TEST_LOSSY_TAIL", "1")
    assert type(tail_sampling().sampler_for(icdf)) is LossySampler
    assert tail_sampling().lossy  # what flags the node's record and its log


def test_the_lossy_sampler_commits_a_biased_law_and_plain_sampling_is_untouched():
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]))
    honest, lossy = np.zeros(4), np.zeros(4)
    for seed in range(4000):
        for sampler, counts in ((Sampler(seed=seed), honest), (LossySampler(seed=seed), lossy)):
            first = committed_tokens([3], sampler.accept(logits, [3], 10))[0]
            counts[first] += 1
        assert LossySampler(seed=seed).sample(logits[0], 10) == Sampler(seed=seed).sample(
            logits[0], 10
        )
    target = np.array([0.4, 0.3, 0.2, 0.1]) * 4000
    assert total_variation(honest, target) < 0.03
    assert total_variation(lossy, target) > 0.2  # rejections all go to token 0
    assert lossy[1] == lossy[2] == 0
