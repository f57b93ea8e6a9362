"""A draft tree in one forward: every row sees the prefix and its own ancestors only, the rows of
any branch give plain decoding's logits bit for bit, and keeping the accepted branch leaves the
cache plain decoding would have."""

from __future__ import annotations

import pytest
import torch

from specpipe.core.ring import GapError, Request, Round
from specpipe.transformer.checkpoint import SafetensorsCheckpoint
from tests.model.helpers import load_split

#        root (the last committed token)
#       /    \
#     r1      r2
#    /  \       \
#  r3    r4      r5
#  |
#  r6
PARENTS = (0, 0, 1, 1, 2, 3)
PROMPT = 23  # long enough that gpt-oss's sliding layers (window 4 here) drop keys


def tree_forward(stage, session, tokens, pos):
    (out,) = stage.forward_many([Request(session, tokens, pos, parents=PARENTS)])
    if isinstance(out, BaseException):
        raise out
    return out


@pytest.mark.parametrize("family", ["llama", "gptoss-mxfp4"])
def test_each_branch_of_a_tree_gives_plain_decodings_logits_and_cache(checkpoints, family):
    (stage,) = load_split(lambda: SafetensorsCheckpoint(checkpoints[family]), [4])
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 97, (PROMPT,), generator=g)
    tokens = torch.randint(0, 97, (len(PARENTS) + 1,), generator=g)  # the root and six drafts
    stage.forward("tree", prompt[:-1], 0)
    pos = PROMPT - 1  # the root: the prompt's last token
    tree = tree_forward(stage, "tree", torch.cat([prompt[-1:], tokens[1:]]), pos)
    assert tree.shape[0] == len(PARENTS) + 1
    branches = [[0, 1, 3, 6], [0, 1, 4], [0, 2, 5]]
    for rows in branches:
        stage.forward("plain", prompt[:-1], 0)
        ids = [int(prompt[-1])] + [int(tokens[r]) for r in rows[1:]]
        plain = torch.cat(
            [stage.forward("plain", torch.tensor([t]), pos + d) for d, t in enumerate(ids)]
        )
        assert torch.equal(tree[rows], plain), rows
        stage.drop("plain")

    # Keep the longest branch: the cache is plain decoding's, the next step's logits too.
    stage.keep_path("tree", branches[0])
    assert stage.held_tokens()["tree"] == pos + 4
    stage.forward("plain", prompt[:-1], 0)
    for d, r in enumerate(branches[0]):
        stage.forward(
            "plain", torch.tensor([int(prompt[-1]) if r == 0 else int(tokens[r])]), pos + d
        )
    following = torch.tensor([11])
    assert torch.equal(
        stage.forward("tree", following, pos + 4), stage.forward("plain", following, pos + 4)
    )


def test_a_tree_is_checked_and_its_branch_kept_once(checkpoints):
    (stage,) = load_split(lambda: SafetensorsCheckpoint(checkpoints["llama"]), [4])
    stage.forward("s", torch.arange(1, 9), 0)
    with pytest.raises(GapError, match="no draft tree"):
        stage.keep_path("s", [0])
    bad = stage.forward_many([Request("s", torch.arange(3), 8, parents=(0, 2))])
    assert isinstance(bad[0], ValueError) and "parent row 2" in str(bad[0])
    short = stage.forward_many([Request("s", torch.arange(3), 8, parents=(0,))])
    assert isinstance(short[0], ValueError) and "needs 2 parents" in str(short[0])
    tree_forward(stage, "s", torch.arange(7), 8)
    assert stage.held_tokens()["s"] == 8  # the tree's rows wait for their branch
    for not_a_branch in ([1, 3], [0, 3], [0, 2, 5, 6], [], [0, 9]):
        with pytest.raises(ValueError, match="not a branch"):
            stage.keep_path("s", not_a_branch)
    stage.keep_path("s", [0, 2])
    assert stage.held_tokens()["s"] == 10
    with pytest.raises(GapError, match="no draft tree"):
        stage.keep_path("s", [0, 2])


def test_the_round_after_a_tree_keeps_the_rows_it_names_or_forgets_the_tree(checkpoints):
    (stage,) = load_split(lambda: SafetensorsCheckpoint(checkpoints["llama"]), [4])

    def step(session, tokens, pos, **branches):
        (out,) = stage.forward_many([Request(session, torch.tensor(tokens), pos, **branches)])
        if isinstance(out, BaseException):
            raise out
        return out

    prompt = list(range(1, 9))
    step("plain", prompt + [5, 7, 11], 0)  # the branch 5, 7 kept, then 11
    expected = step("plain", [13], 11)

    step("s", prompt, 0)
    first = tree_forward(stage, "s", torch.tensor([8, 5, 6, 7, 2, 3, 4]), 7)
    # Sent again (its reply was late): the tree is recomputed from its root, the same rows.
    assert torch.equal(tree_forward(stage, "s", torch.tensor([8, 5, 6, 7, 2, 3, 4]), 7), first)
    # The next round names the walked rows (root, 5, 7) and starts right after them.
    assert torch.equal(step("s", [11, 13], 10, keep=(0, 1, 3))[-1:], expected)
    assert stage.held_tokens()["s"] == 12

    # A round that names no rows (or rows it does not start after) forgets the tree: it goes
    # on from the root, and one that starts past the root gets a gap.
    step("t", prompt, 0)
    tree_forward(stage, "t", torch.tensor([8, 5, 6, 7, 2, 3, 4]), 7)
    with pytest.raises(GapError):
        step("t", [11, 13], 10)
    step("u", prompt, 0)
    tree_forward(stage, "u", torch.tensor([8, 5, 6, 7, 2, 3, 4]), 7)
    with pytest.raises(GapError):
        step("u", [11, 13], 10, keep=(0, 2))  # rows 0, 2 end at position 9, not 10
    step("v", prompt, 0)
    tree_forward(stage, "v", torch.tensor([8, 5, 6, 7, 2, 3, 4]), 7)
    assert torch.equal(step("v", [8, 5, 7, 11, 13], 7)[-1:], expected)


@pytest.mark.parametrize("sampler", ["gumbel", "icdf"])
@pytest.mark.parametrize("family", ["llama", "gptoss-mxfp4"])
def test_tree_rounds_through_two_stages_commit_plain_samplings_tokens(checkpoints, family, sampler):
    """Rounds of random trees, some branches holding plain decoding's next tokens, through a
    two-stage ring: the same tokens as plain sampling with the same seed, round after round
    (each round's branch kept on both stages is the cache the next one builds on)."""
    import numpy as np

    from specpipe.core.ring import Branches
    from specpipe.core.sampling import SamplingParams
    from specpipe.core.tree import DraftTree
    from specpipe.decoding.local_ring import LocalRing

    ring = LocalRing(load_split(lambda: SafetensorsCheckpoint(checkpoints[family]), [2, 2]))
    params = SamplingParams(temp=0.9, top_p=0.95, seed=41, sampler=sampler)
    prompt, n = list(range(3, 15)), 24
    ring.reset("plain", params)
    plain = [ring.round(Round("plain", prompt, 0))[0]]
    while len(plain) < n:
        plain.append(ring.round(Round("plain", [plain[-1]], len(prompt) + len(plain) - 1))[0])

    rng = np.random.default_rng(3)
    ring.reset("tree", params)
    out = [ring.round(Round("tree", prompt, 0))[0]]
    accepted, keep = 0, ()
    while len(out) < n:
        # Two branches: one that follows plain decoding for a while (then strays), one random.
        truth = plain[len(out) : len(out) + 3]
        follow = truth[: int(rng.integers(0, len(truth) + 1))] + [int(rng.integers(0, 97))]
        tokens, parents = [], []
        for d, token in enumerate(follow):
            tokens.append(token)
            parents.append(0 if d == 0 else len(tokens) - 1)
        other = int(rng.integers(0, 97))
        if other != tokens[0]:
            tokens.append(other)
            parents.append(0)
        tree = DraftTree(tuple(tokens), tuple(parents))
        root_pos = len(prompt) + len(out) - 1
        branches = Branches(tree.parents, keep)  # the last tree's walked rows ride along
        result = ring.round(
            Round("tree", [out[-1], *tree.tokens], root_pos, len(tokens), branches=branches)
        )
        keep = tuple(result.path)
        accepted += len(keep) - 1
        out += [t for t in result if t >= 0]
    assert out[:n] == plain
    assert accepted >= 5  # the branches that followed plain decoding were taken
