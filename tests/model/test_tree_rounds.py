"""Tree rounds end to end in one process: the tail's head proposes trees, the ring verifies them
in one round each, and the output is plain sampling's for every seed, whatever the tree."""

from __future__ import annotations

import pytest
import torch

from specpipe.core.sampling import SamplingParams
from specpipe.core.tree import DraftTree, TreeShape
from specpipe.decoding.generation import Generation
from specpipe.decoding.local_ring import LocalRing
from specpipe.drafting.head import DraftHead, TailHead, TargetParts
from specpipe.drafting.length import DraftLength
from specpipe.drafting.tree_size import TreeSize
from specpipe.transformer.resolve import load_stages
from tests.drafting import head_generation
from tests.swarmprocs import write_tiny_model

PROMPT = [5, 17, 42, 8, 23, 61, 9]
# Root -> (a, b, c); a -> (d, e); d -> f; b -> g.
WIDE = TreeShape((0, 0, 0, 1, 1, 4, 2), (0, 1, 2, 0, 1, 0, 0))


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("trees") / "tiny")
    stages = load_stages(model, 2, pack=False)
    torch.manual_seed(0)  # an untrained head: its trees are verified all the same
    head = DraftHead(stages[-1].cfg.dim, 32, heads=2)
    torch.nn.init.normal_(head.attention.out.weight, std=0.02)  # its past counts
    parts = TargetParts.from_stage(stages[-1], stages[0].embed.weight)
    stages[-1].keep_features = True
    return LocalRing(stages, TailHead(head, parts))


def plain(ring, params, n):
    return Generation(ring, "plain", PROMPT, params, max_new_tokens=n, draft_k=0).run()


def with_trees(ring, params, n, shape=None, session="trees"):
    return head_generation(ring, session, PROMPT, params, n, tree=shape, trees=True)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temp=0.0)]
    + [
        SamplingParams(temp=t, top_p=p, seed=s, sampler="gumbel")
        for t, p, s in [(0.7, 0.95, 1), (1.0, 1.0, 2), (1.3, 0.9, 3), (0.8, 1.0, 4)]
    ],
)
def test_tree_rounds_commit_plain_samplings_tokens(ring, params):
    expected = plain(ring, params, 40)
    for shape in (WIDE, TreeShape.chain(3), None):
        generation = with_trees(ring, params, 40, shape)
        assert generation.run() == expected, shape
        if shape is WIDE:
            assert generation.stats.tree_rounds > 10
            assert generation.stats.rounds < 40  # drafts were taken on the way


def test_an_untrained_head_still_gets_its_trees_measured_and_sized(ring):
    params = SamplingParams(temp=0.0)
    generation = with_trees(ring, params, 60)
    assert generation.run() == plain(ring, params, 60)
    size = generation.tree_size
    # The ranks came back each round: the estimate moved off the prior.
    assert size.acceptance(0, 0) != pytest.approx(0.5, abs=1e-3)


def test_the_heads_tree_holds_its_chain_as_the_main_branch_and_ranks_are_reported(ring):
    stages, head = ring.stages, ring.head
    params = SamplingParams(temp=0.9, top_p=0.95, seed=8, sampler="gumbel")
    feature = torch.randn(stages[-1].cfg.dim)
    chain = head.drafts_after("s", feature, 7, 20, 3, params)
    tree = head.draft_tree("s", feature, 7, 20, WIDE, params)
    assert tree.main_branch() == chain and not tree.is_chain
    assert len({tree.tokens[i] for i, p in enumerate(tree.parents) if p == 0}) == 3
    # The walk took rank 0, then the rank-1 child under it, then left the tree.
    walked = [tree.tokens[0], tree.tokens[4], 3]
    ranks = head.ranks_of("s", 20, 7, walked)
    assert ranks[:2] == [0, 1] and len(ranks) <= 3
    assert head.ranks_of("s", 21, 7, walked) == []  # another root: not this tree
    head.forget("s")
    assert head.ranks_of("s", 20, 7, walked) == []


def test_tree_size_grows_with_acceptance_and_ring_time():
    def chosen(ranks: list[int], base_s: float, per_row_s: float) -> TreeShape:
        """The tree for a head whose candidates the target takes by `ranks` (-1: none) at
        every depth, on a ring whose rounds cost base_s plus per_row_s per draft."""
        length = DraftLength(6)
        for sent in (0, 4, 8) * 20:
            length.observe([], [], sent, base_s + sent * per_row_s)
        size = TreeSize(6, length)
        for _ in range(20):
            for rank in ranks:
                size.observe([rank] * 6)
        return size.choose()

    spread = [0] * 6 + [1] * 2 + [2, -1]  # rank 0 60 %, rank 1 20 %, rank 2 10 %
    slow = chosen(spread, 0.1, 0.001)
    assert len(slow) >= 12 and max(slow.depths) >= 5 and max(slow.ranks) >= 2
    fast = chosen(spread, 0.01, 0.004)  # a fast ring whose rows are dear: a smaller tree
    assert 0 < len(fast) < len(slow)
    assert chosen([0], 0.1, 0.001) == TreeShape.chain(6)  # a perfect chain needs no siblings
    assert len(chosen([-1], 0.01, 0.004)) == 0  # plain decoding is faster


def test_rows_off_the_longest_branch_are_priced_as_measured():
    length = DraftLength(6)
    for sent in (0, 4, 8) * 20:
        length.observe([], [], sent, 0.05 + sent * 0.002)
    base, per_row = length.cost()
    size = TreeSize(6, length)
    assert size.side_cost(per_row) == pytest.approx(1.5 * per_row)  # the prior
    for _ in range(100):
        size.observe_cost(4, 4 * 0.006)  # side rows cost three times a branch row here
    assert size.side_cost(per_row) == pytest.approx(0.006, rel=0.05)
    for _ in range(20):
        for rank in [0] * 6 + [1] * 2 + [2, -1]:
            size.observe([rank] * 6)
    dear = size.choose()
    cheap = TreeSize(6, length)
    cheap._counts = size._counts
    for _ in range(100):
        cheap.observe_cost(4, 0.0)  # side rows free: a wider tree
    assert len(cheap.choose()) > len(dear)
    assert len(dear) - max(dear.depths) < len(cheap.choose()) - max(cheap.choose().depths)


def test_a_busy_tail_shrinks_the_tree():
    length = DraftLength(6)
    for sent in (0, 4, 8) * 20:
        length.observe([], [], sent, 0.05 + sent * 0.002)
    size = TreeSize(6, length)
    for _ in range(20):
        for rank in [0] * 6 + [1] * 2 + [2, -1]:
            size.observe([rank] * 6)
    alone = size.choose()
    for _ in range(30):
        size.observe_batch(8)
    assert size.batch == pytest.approx(8.0, rel=0.05)
    busy = size.choose()
    assert 0 < len(busy) < len(alone)


def test_a_fixed_size_sends_that_many_drafts_whatever_they_cost():
    length = DraftLength(6)
    for sent in (0, 4, 8) * 20:
        length.observe([], [], sent, 0.01 + sent * 0.004)  # rows dear: few or none pay
    sized, fixed = TreeSize(6, length), TreeSize(6, length, drafts=24)
    for size in (sized, fixed):
        for _ in range(20):
            for rank in [0] * 6 + [1] * 2 + [2, -1]:
                size.observe([rank] * 6)
    tree = fixed.choose()
    assert len(tree) == 24 > len(sized.choose())
    assert max(tree.ranks) >= 1 and max(tree.depths) <= 6
    assert len(TreeSize(1, length, drafts=24).choose()) == 4  # one level: its 4 candidates
    with pytest.raises(ValueError):
        TreeSize(6, length, drafts=33)


def test_a_trees_side_rows_are_priced_once(ring):
    generation = with_trees(ring, SamplingParams(temp=0.0), 8)
    tree = DraftTree((1, 2, 3, 4, 5, 6), (0, 1, 2, 0, 1, 0))  # longest branch 3, 3 rows off it
    base, per_row, per_side = 0.05, 0.002, 0.006
    for _ in range(60):
        for k in (0, 2, 4):
            chain = DraftTree.chain([1] * k)
            generation._observe_cost(chain, None, [1] * k, [1], base + k * per_row, True)
        seconds = base + 3 * per_row + 3 * per_side
        generation._observe_cost(tree, tree.parents, [*tree.tokens], [1], seconds, True)
    got_base, got_per_row = generation.draft_length.cost()
    # The rounds' line is the longest branch's alone: the side rows are not in it as well.
    assert got_base == pytest.approx(base, rel=0.05)
    assert got_per_row == pytest.approx(per_row, rel=0.1)
    assert generation.tree_size.side_cost(got_per_row) == pytest.approx(per_side, rel=0.1)


def test_a_tree_is_cut_to_the_rounds_budget():
    tree = DraftTree((1, 2, 3, 4, 5), (0, 1, 2, 0, 4))
    assert tree.within_depth(2) == DraftTree((1, 2, 4, 5), (0, 1, 0, 3))
    assert tree.within_depth(0) == DraftTree((), ())
    assert tree.main_branch() == [1, 2, 3]


def test_proof_2_with_the_heads_trees_passes_and_flags_its_mutant(ring):
    from specpipe.proofs.swarm import SwarmProofConfig, proof_shape, run_swarm_proof

    cfg = SwarmProofConfig(
        stops=2, draws=150, temp=1.0, top_p=1.0, generation_tokens=16, draft_head=True
    )
    result = run_swarm_proof(ring, [PROMPT, PROMPT[:4]], cfg)
    assert result["proof_2_on_swarm"]["verdict"] == "PASS", result["reasons"]
    assert result["draft_trees"] and result["mutant"]["flagged"]
    assert result["exact_check"] == {"pairs": 300, "identical": 300}
    head = result["head"]
    assert head["rounds"] == head["tree_rounds"] == 300
    assert head["drafted"] == 300 * len(proof_shape(cfg.draft_k))  # temp 1.0: no rank is cut
