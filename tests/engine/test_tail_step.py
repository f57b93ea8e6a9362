"""The tail's verify-and-draft step that every ring shares (`specpipe.decoding.tail`)."""

import math

import pytest
import torch

from specpipe.core.sampling import Sampler
from specpipe.decoding.tail import finish_round

VOCAB = 8


class Tail:
    """The tail stage as the step sees it: the features its last forward kept per session."""

    def __init__(self, features: dict[str, torch.Tensor]) -> None:
        self.features = features


class RecordingHead:
    """A draft head that proposes `first_sampled + i` and remembers what it was given."""

    def __init__(self) -> None:
        self.calls = []

    def drafts_after(self, features, result, first_sampled, k, params):
        self.calls.append((features, list(result), first_sampled, k, params))
        return [first_sampled + i for i in range(k)]


def peaked(*argmaxes: int) -> torch.Tensor:
    """Logits [len(argmaxes), VOCAB] whose row j peaks at argmaxes[j]."""
    rows = torch.zeros(len(argmaxes), VOCAB)
    for j, token in enumerate(argmaxes):
        rows[j, token] = 5.0
    return rows


def test_drafts_are_verified_up_to_the_first_mismatch():
    # Tokens (1, 4, 6) at position 10, the last two drafts: row 0 confirms 4, row 1 wants 3.
    result = finish_round(Tail({}), "s", peaked(4, 3, 7), (1, 4, 6), 10, 2, Sampler(temp=0))
    assert list(result) == [4, 3, -1]
    assert result.logprobs == [] and result.drafts == []  # neither was asked for


def test_only_the_last_rows_are_verified():
    """Logits of the whole round may come back: the step reads the last n_draft + 1 rows."""
    logits = torch.cat([torch.full((3, VOCAB), float("nan")), peaked(2, 5)])
    result = finish_round(Tail({}), "s", logits, (0, 0, 0, 0, 2), 0, 1, Sampler(temp=0))
    assert list(result) == [2, 5]


def test_the_committed_tokens_carry_their_logprobs_when_asked():
    sampler = Sampler(temp=0, logprobs=1)
    logits = peaked(4, 3, 7)
    result = finish_round(Tail({}), "s", logits, (1, 4, 6), 10, 2, sampler)
    assert [lp.token for lp in result.logprobs] == [4, 3]
    expected = torch.log_softmax(logits, dim=-1)
    for j, lp in enumerate(result.logprobs):
        assert math.isclose(lp.logprob, float(expected[j, lp.token]), abs_tol=1e-5)
        assert lp.top[0][0] == lp.token


def test_the_head_drafts_from_the_tail_features_after_the_result():
    features = torch.arange(6.0).reshape(3, 2)
    head, sampler = RecordingHead(), Sampler(temp=0, seed=3)
    result = finish_round(
        Tail({"s": features}), "s", peaked(4, 3, 7), (1, 4, 6), 10, 2, sampler, head, 3
    )
    assert result.drafts == [11, 12, 13]  # first sampled at 13 - 2 = 11
    ((seen, verified, first_sampled, k, params),) = head.calls
    assert seen is features and verified == [4, 3, -1] and (first_sampled, k) == (11, 3)
    assert params == sampler.params


def test_a_head_is_not_asked_for_zero_drafts_and_needs_no_features_then():
    head = RecordingHead()
    result = finish_round(Tail({}), "s", peaked(2), (2,), 0, 0, Sampler(temp=0), head, 0)
    assert list(result) == [2] and result.drafts == [] and head.calls == []


def test_a_draft_outside_the_vocabulary_is_a_value_error():
    with pytest.raises(ValueError, match="draft ids"):
        finish_round(Tail({}), "s", peaked(1, 2), (0, VOCAB + 1), 0, 1, Sampler(temp=0))
