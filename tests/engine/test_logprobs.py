"""Log-probabilities of committed tokens: the same numbers as the target distribution computed
independently from the model's logits, the same whether the tokens came from drafts or not, and
nothing at all unless a session asks."""

import numpy as np
import pytest
import torch

from specpipe.core.sampling import (
    Sampler,
    SamplingParams,
    target_probs,
    token_logprobs,
)
from specpipe.decoding.generation import Generation
from specpipe.decoding.local_ring import LocalRing
from tests.engine.toy_stages import toy_stages

PROMPT = [3, 7, 1, 9, 3, 7, 1, 9, 3, 7, 1, 9, 3, 7]


def run(params: SamplingParams, draft_k: int, max_new: int = 30) -> Generation:
    gen = Generation(
        LocalRing(toy_stages()), "s", PROMPT, params, max_new_tokens=max_new, draft_k=draft_k
    )
    gen.run()
    return gen


def full_logits(tokens: list[int]) -> np.ndarray:
    """The toy model's logits at every position of `tokens`, from one plain forward."""
    hidden = torch.tensor(tokens, dtype=torch.long)
    stages = toy_stages()
    for stage in stages:
        hidden = stage.forward("check", hidden, 0)
    return hidden.double().numpy()


@pytest.mark.parametrize(
    "temp,top_p,top_k", [(0.8, 0.9, 0), (1.0, 1.0, 0), (1.3, 0.95, 6), (0.0, 1.0, 0)]
)
def test_logprobs_match_the_target_distribution_and_spec_equals_plain(temp, top_p, top_k):
    params = SamplingParams(temp=temp, top_p=top_p, top_k=top_k, seed=4, logprobs=3)
    plain, spec = run(params, draft_k=0), run(params, draft_k=4)
    assert spec.generated == plain.generated and len(plain.logprobs) == len(plain.generated)
    assert spec.stats.accepted > 0 or temp > 0  # greedy on the toy model accepts drafts
    assert spec.logprobs == plain.logprobs  # bit for bit: the same rows of logits
    logits = full_logits(PROMPT + plain.generated)
    for j, entry in enumerate(plain.logprobs):
        row = logits[len(PROMPT) - 1 + j]
        if temp > 0:
            with np.errstate(divide="ignore"):  # cut tokens: log 0
                want = np.log(target_probs(row, temp, top_p, top_k))
        else:  # greedy reports the model's own distribution
            want = row - np.log(np.exp(row - row.max()).sum()) - row.max()
        assert entry.token == plain.generated[j]
        assert entry.logprob == pytest.approx(want[entry.token], abs=1e-9)
        finite = np.flatnonzero(np.isfinite(want))
        best = finite[np.argsort(-want[finite], kind="stable")][:3]
        assert [i for i, _ in entry.top] == best.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(want[best].tolist(), abs=1e-9)


def test_no_logprobs_unless_asked():
    gen = run(SamplingParams(temp=0.7, seed=1), draft_k=3)
    assert gen.generated and gen.logprobs == []
    assert Sampler(temp=0.7).result_logprobs(np.zeros((2, 5)), [1, -1]) == []


def test_zero_alternatives_gives_the_token_alone():
    gen = run(SamplingParams(temp=0.7, seed=2, logprobs=0), draft_k=3, max_new=10)
    assert len(gen.logprobs) == 10 and all(lp.top == () and lp.logprob <= 0 for lp in gen.logprobs)


def test_cut_tokens_are_never_alternatives_and_bad_requests_are_refused():
    logits = np.array([[5.0, 4.0, -1.0, 3.0]])
    (entry,) = token_logprobs(logits, [0], temp=1.0, top_k=2, n_top=5)
    assert [i for i, _ in entry.top] == [0, 1]  # ids 2 and 3 are cut by top-k
    assert entry.logprob == pytest.approx(np.log(1 / (1 + np.exp(-1.0))))
    with pytest.raises(ValueError):
        token_logprobs(logits, [0], temp=1.0, n_top=6)
    with pytest.raises(ValueError):
        token_logprobs(logits, [0, 1], temp=1.0)
    with pytest.raises(ValueError):
        Sampler(logprobs=9)
