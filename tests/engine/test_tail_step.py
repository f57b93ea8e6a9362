"""The tail's verify-and-draft step that every ring shares (`specpipe.decoding.tail`)."""

import math

import pytest
import torch

from specpipe.core.ring import Branches, Round
from specpipe.core.sampling import Sampler
from specpipe.core.tree import DraftTree, TreeShape
from specpipe.decoding.tail import finish_round

VOCAB = 8


class Tail:
    """The tail stage as the step sees it: the features its last forward kept per session."""

    def __init__(self, features: dict[str, torch.Tensor]) -> None:
        self.features = features


class RecordingHead:
    """A draft head that proposes `token_pos + i` and remembers what it was given."""

    def __init__(self) -> None:
        self.calls = []
        self.remembered = []
        self.started = []
        self.order = []

    def remember(self, session, features, tokens, first_pos):
        self.remembered.append((session, features, list(tokens), first_pos))
        self.order.append("remember")

    def starts_round(self, session, token, token_pos):
        self.started.append((session, token, token_pos))
        self.order.append("starts_round")

    def drafts_after(self, session, feature, token, token_pos, k, params):
        self.calls.append((feature, token, token_pos, k, params))
        return [token_pos + i for i in range(k)]

    def draft_tree(self, session, feature, token, token_pos, shape, params):
        self.calls.append((feature, token, token_pos, shape, params))
        return DraftTree(tuple(token_pos + i for i in range(len(shape))), shape.parents)

    def ranks_of(self, session, root_pos, root, committed):
        return [root_pos, root, *committed]


def peaked(*argmaxes: int) -> torch.Tensor:
    """Logits [len(argmaxes), VOCAB] whose row j peaks at argmaxes[j]."""
    rows = torch.zeros(len(argmaxes), VOCAB)
    for j, token in enumerate(argmaxes):
        rows[j, token] = 5.0
    return rows


def test_drafts_are_verified_up_to_the_first_mismatch():
    # Tokens (1, 4, 6) at position 10, the last two drafts: row 0 confirms 4, row 1 wants 3.
    result = finish_round(Tail({}), Round("s", (1, 4, 6), 10, 2), peaked(4, 3, 7), Sampler(temp=0))
    assert list(result) == [4, 3, -1]
    assert result.logprobs == [] and result.drafts == []  # neither was asked for


def test_only_the_last_rows_are_verified():
    """Logits of the whole round may come back: the step reads the last n_draft + 1 rows."""
    logits = torch.cat([torch.full((3, VOCAB), float("nan")), peaked(2, 5)])
    result = finish_round(Tail({}), Round("s", (0, 0, 0, 0, 2), 0, 1), logits, Sampler(temp=0))
    assert list(result) == [2, 5]


def test_the_committed_tokens_carry_their_logprobs_when_asked():
    sampler = Sampler(temp=0, logprobs=1)
    logits = peaked(4, 3, 7)
    result = finish_round(Tail({}), Round("s", (1, 4, 6), 10, 2), logits, sampler)
    assert [lp.token for lp in result.logprobs] == [4, 3]
    expected = torch.log_softmax(logits, dim=-1)
    for j, lp in enumerate(result.logprobs):
        assert math.isclose(lp.logprob, float(expected[j, lp.token]), abs_tol=1e-5)
        assert lp.top[0][0] == lp.token


def test_the_head_drafts_from_the_tail_features_after_the_result():
    features = torch.arange(6.0).reshape(3, 2)
    head, sampler = RecordingHead(), Sampler(temp=0, seed=3)
    result = finish_round(
        Tail({"s": features}), Round("s", (1, 4, 6), 10, 2, 3), peaked(4, 3, 7), sampler, head
    )
    # 4 (position 11) and 3 (position 12) committed; 3 was drawn from row 1.
    assert result.drafts == [12, 13, 14]
    ((seen, token, token_pos, k, params),) = head.calls
    assert torch.equal(seen, features[1]) and (token, token_pos, k) == (3, 12, 3)
    assert params == sampler.params
    assert result.ranks == [10, 1, 4, 3]  # the head was asked which ranks it had given
    # Its past: each committed token with the feature of the row that drew it.
    ((session, drew, tokens, first_pos),) = head.remembered
    assert session == "s" and torch.equal(drew, features[:2])
    assert (tokens, first_pos) == ([4, 3], 11)
    assert head.started == [("s", 1, 10)]  # told first which token the round starts from


def test_a_prompt_rounds_head_is_told_its_first_token_before_its_rows():
    """A round of a prompt's tokens 1, 2, 3 at position 5 (a prefill chunk's, say): the head
    hears that it starts from 1 (the row before it, of an earlier round, may have been paired
    with a token the loop dropped), then the rows before the last paired with 2 and 3, then
    the last row with the token it sampled."""
    features = torch.arange(6.0).reshape(3, 2)
    head = RecordingHead()
    finish_round(
        Tail({"s": features}), Round("s", (1, 2, 3), 5), peaked(0, 0, 7), Sampler(temp=0), head
    )
    assert head.started == [("s", 1, 5)]
    assert head.order == ["starts_round", "remember", "remember"]
    (_, rows, tokens, first_pos), (_, last, sampled, at) = head.remembered
    assert torch.equal(rows, features[:2]) and (tokens, first_pos) == ([2, 3], 6)
    assert torch.equal(last, features[2:]) and (sampled, at) == ([7], 8)


def test_a_tree_round_commits_the_walk_and_the_head_drafts_after_its_last_row():
    # Root 1 at position 10; rows: 1 -> 5 (row 1), 1 -> 4 (row 2), 4 -> 6 (row 3).
    # The target wants 4 at the root, 6 after it, then 2: rows 0, 2, 3 walked.
    logits = peaked(4, 0, 6, 2)
    features = torch.arange(8.0).reshape(4, 2)
    head, sampler = RecordingHead(), Sampler(temp=0)
    shape = TreeShape((0, 0), (0, 1))
    branches = Branches(parents=(0, 0, 2), shape=shape)
    result = finish_round(
        Tail({"s": features}),
        Round("s", (1, 5, 4, 6), 10, 3, branches=branches),
        logits,
        sampler,
        head,
    )
    assert list(result) == [4, 6, 2, -1] and result.path == [0, 2, 3]
    ((seen, token, token_pos, asked, _),) = head.calls
    assert torch.equal(seen, features[3]) and (token, token_pos, asked) == (2, 13, shape)
    assert result.drafts == [13, 14] and result.draft_parents == [0, 0]
    assert result.draft_tree == DraftTree((13, 14), (0, 0))
    ((_, drew, tokens, first_pos),) = head.remembered  # the rows walked, not the tree's
    assert torch.equal(drew, features[[0, 2, 3]]) and (tokens, first_pos) == ([4, 6, 2], 11)


def test_a_malformed_tree_is_refused():
    bad = Branches(parents=(0, 0))  # two children of the root holding one token
    with pytest.raises(ValueError):
        finish_round(
            Tail({}), Round("s", (1, 5, 5), 10, 2, branches=bad), peaked(4, 0, 6), Sampler(temp=0)
        )
    with pytest.raises(ValueError):  # a tree's round is its root and drafts alone
        finish_round(
            Tail({}),
            Round("s", (7, 1, 5, 4), 9, 2, branches=Branches(parents=(0, 0))),
            peaked(7, 4, 0, 6),
            Sampler(temp=0),
        )


def test_a_head_is_not_asked_for_zero_drafts_and_needs_no_features_then():
    head = RecordingHead()
    result = finish_round(Tail({}), Round("s", (2,), 0), peaked(2), Sampler(temp=0), head)
    assert list(result) == [2] and result.drafts == [] and head.calls == []


def test_a_draft_outside_the_vocabulary_is_a_value_error():
    with pytest.raises(ValueError, match="draft ids"):
        finish_round(Tail({}), Round("s", (0, VOCAB + 1), 0, 1), peaked(1, 2), Sampler(temp=0))
