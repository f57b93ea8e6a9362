"""Proof 1's tree cases: the walk's committed law is the target's, lossy walks are caught, and
the real `accept_tree` commits plain sampling's tokens seed by seed."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
from scipy.stats import binom

from specpipe.core.coupling import gumbel_noise
from specpipe.core.sampling import Sampler
from specpipe.proofs import tree_cases
from specpipe.proofs.local import LocalProofConfig, run_local_proof
from specpipe.proofs.report import LocalProofSummary, format_local_summary

DRAWS = 6_000
EXACT_TRIALS = 120
# Proof 1 at the small sizes of its own tests, where every other part passes.
SMALL = dict(
    draws=20_000,
    temps=(0.8, 1.3),
    top_ps=(0.9, 1.0),
    top_ks=(0, 10),
    greedy_rows=500,
    coupling_trials=3_200,
    sampler_trials=100,
    gumbel_sampler_trials=100,
)


@pytest.fixture(scope="module")
def result() -> dict:
    return tree_cases.run_tree_proof(DRAWS, exact_trials=EXACT_TRIALS)


def failed_cases(result: dict, mutant: str) -> list[str]:
    (summary,) = [m for m in result["mutants"] if m["name"] == mutant]
    return [f["case"] for f in summary["failed"]]


def test_the_honest_cases_pass(result):
    assert result["pass"]
    assert len(result["cases"]) == len(tree_cases.CONFIGS) * len(tree_cases.SHAPES) == 12
    assert all(case["pass"] for case in result["cases"])
    assert result["worst_tv_over_floor"] <= result["gate"]
    for case in result["cases"]:
        depth = case["length"] - 1
        assert 0.5 < case["mean_accepted"] <= depth  # drafts are accepted, not all of them
        if case["shape"] == "chain of 3":
            assert case["mean_accepted"] < depth


@pytest.mark.parametrize("mutant", list(tree_cases.MUTANTS))
def test_each_lossy_walk_is_caught(result, mutant):
    assert failed_cases(result, mutant)


def test_each_lossy_walk_fails_where_it_does_harm(result):
    # Accepting a sibling after a miss shows on a chain; so does noise keyed by rank.
    assert "chain of 3 at 1/1/0" in failed_cases(result, "sibling_after_miss")
    assert "chain of 3 at 1/1/0" in failed_cases(result, "noise_by_rank")
    # A cache of the rank-0 branch is harmless on a chain (its only branch) and on one level
    # of children (no token follows the walk); on the uneven tree it is not.
    rejected = failed_cases(result, "rejected_branch_cached")
    assert "uneven at 1/1/0" in rejected
    assert not [case for case in rejected if "chain" in case or "3 children" in case]


def test_accept_tree_commits_plain_samplings_tokens(result):
    exact = result["exact"]
    assert exact["trials"] == EXACT_TRIALS and exact["mismatches"] == 0
    assert exact["tree_mismatches"] == 0  # the trees are the head's
    assert exact["walk_mismatches"] == 0  # the law check walks as the sampler does
    assert exact["chain_trials"] >= EXACT_TRIALS // 4 and exact["chain_mismatches"] == 0
    assert exact["drafts_accepted"] > EXACT_TRIALS // 2


def test_accept_tree_at_the_wrong_position_fails_the_exact_check(monkeypatch):
    accept_tree = Sampler.accept_tree
    monkeypatch.setattr(
        Sampler, "accept_tree", lambda self, z, tree, start: accept_tree(self, z, tree, start + 1)
    )
    exact = tree_cases.exact_check(0, 48)
    assert exact["mismatches"] > 24 and exact["walk_mismatches"] > 24
    assert exact["chain_mismatches"] > 0


def test_trees_drafted_under_the_wrong_positions_noise_fail_the_exact_check(monkeypatch):
    draft_trees = tree_cases.draft_trees
    monkeypatch.setattr(
        tree_cases,
        "draft_trees",
        lambda shape, target, noise: draft_trees(shape, target, np.roll(noise, 1, axis=0)),
    )
    exact = tree_cases.exact_check(0, 48)
    assert exact["tree_mismatches"] > 24
    assert exact["mismatches"] == 0  # whatever the tree, the walk commits plain sampling's


class DraftFavouringWalk(tree_cases.TreeWalk):
    """Lossy: at a drafted row the children's tokens score log 1.5 more than the target gives
    them, so drafts are committed more often than p says."""

    def draw(self, j, codes, row):
        scores = self.target.log_p[codes] + self.noise[j]
        for parent, kids in enumerate(self.trees.children):
            at = np.flatnonzero(row == parent)
            for kid in kids:
                scores[at, self.trees.tokens[at, kid - 1]] += np.log(1.5)
        return np.argmax(scores, axis=1)


def test_a_lossy_walk_in_place_of_the_real_one_fails_the_law_check():
    lossy = tree_cases.run_tree_proof(DRAWS, exact_trials=12, walk=DraftFavouringWalk)
    assert not lossy["pass"]
    assert sum(not case["pass"] for case in lossy["cases"]) >= 6
    assert all(m["caught"] for m in lossy["mutants"])  # the mutants are judged as before


def test_the_trees_are_drafted_under_the_targets_noise():
    seeds, starts = tree_cases.trial_keys(0, 11, 20)
    noise = tree_cases.noise_banks(seeds, starts)
    logits, draft_logits = tree_cases.prefix_logits(0)
    target = tree_cases.PrefixTarget.make((1.0, 1.0, 0), logits, draft_logits)
    drafted = tree_cases.draft_trees(tree_cases.SHAPES["2 × 2"], target, noise)
    for n in range(20):
        tree = drafted.tree(n)
        # The root's children: the drafter's best two by log q + g, g keyed by token id at the
        # root's position, as `core.coupling` keys the target's own draw there.
        g = gumbel_noise(int(seeds[n]), int(starts[n]), range(tree_cases.VOCAB))
        best = np.argsort(-(np.log(target.drafter[0]) + g))
        assert list(tree.tokens[:2]) == list(best[:2])
        # Under the rank-1 child: the drafter after that token, noise one position on.
        g1 = gumbel_noise(int(seeds[n]), int(starts[n]) + 1, range(tree_cases.VOCAB))
        after = np.log(target.drafter[tree_cases.prefix_code([tree.tokens[1]])]) + g1
        assert list(tree.tokens[4:6]) == list(np.argsort(-after)[:2])
        assert tree.parents == (0, 0, 1, 1, 2, 2)


def test_the_sequence_law_is_the_targets_product():
    logits, draft_logits = tree_cases.prefix_logits(3)
    target = tree_cases.PrefixTarget.make((1.3, 0.9, 3), logits, draft_logits)
    law = tree_cases.sequence_law(target, 3)
    assert law.sum() == pytest.approx(1.0, abs=1e-12)
    x = (4, 0, 2)  # code 4 + 0·5 + 2·25
    p = target.probs
    expected = p[0, 4] * p[tree_cases.prefix_code([4]), 0] * p[tree_cases.prefix_code([4, 0]), 2]
    assert law[4 + 2 * 25] == pytest.approx(expected, rel=1e-12)
    assert tree_cases.sequence_codes(np.array([x])) == [54]
    # top-k 3 at every step: at most 3^3 sequences have mass
    assert 0 < np.count_nonzero(law) <= 27


def test_the_tv_floor_is_an_honest_samples_mean_tv():
    law = np.array([0.5, 0.3, 0.15, 0.05, 0.0])
    n = 40
    mean_abs = [
        (np.abs(np.arange(n + 1) - n * p) * binom.pmf(np.arange(n + 1), n, p)).sum() for p in law
    ]
    assert tree_cases.expected_tv(law, n) == pytest.approx(sum(mean_abs) / (2 * n), rel=1e-9)
    rng = np.random.default_rng(0)
    tvs = [
        tree_cases.total_variation(np.bincount(rng.choice(5, n, p=law), minlength=5), law)
        for _ in range(4000)
    ]
    assert np.mean(tvs) == pytest.approx(tree_cases.expected_tv(law, n), rel=0.03)


def test_proof_1_carries_the_tree_part_and_fails_with_a_lossy_walk(monkeypatch):
    small = {**SMALL, "tree_draws": DRAWS, "tree_exact_trials": 24}
    honest = run_local_proof(LocalProofConfig(**small))
    assert honest["proof_1_local_math"]["verdict"] == "PASS" and honest["trees"]["pass"]
    assert honest["trees"]["draws_per_case"] == DRAWS
    assert honest["timing"]["tree_seconds"] > 0
    lines = format_local_summary(LocalProofSummary.from_result(honest), 1.0).splitlines()
    assert any(line.startswith("  tree cases ") and "12 (config × shape)" in line for line in lines)
    assert sum(line.startswith("  tree mutant ") and "caught on" in line for line in lines) == 3
    missed = copy.deepcopy(honest)
    missed["trees"]["mutants"][1].update(caught=False, cases_failed=0)
    lines = format_local_summary(LocalProofSummary.from_result(missed), 1.0).splitlines()
    assert any(
        line.startswith("  tree mutant rejected_branch_cached") and line.endswith("NOT CAUGHT")
        for line in lines
    )

    lossy_proof = functools.partial(tree_cases.run_tree_proof, walk=DraftFavouringWalk)
    monkeypatch.setattr(tree_cases, "run_tree_proof", lossy_proof)
    lossy = run_local_proof(LocalProofConfig(**small))
    assert lossy["proof_1_local_math"]["verdict"] == "FAIL" and not lossy["trees"]["pass"]
    assert all(case["pass"] for case in lossy["cases"])  # only the tree part failed
