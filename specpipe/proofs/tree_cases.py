"""Proof 1's tree cases: a draft tree verified by walking it commits the target's law.

A tree round (`specpipe.core.tree`) drafts several candidates per position and commits the
target's own draws down the branch they match. Here the trees are what a tail's head drafts
(`DraftHead.draft_tree`): under each row, the drafter's candidates ranked by log q + g, g the
target's own noise at the position they hold (`core.coupling`), the slot of rank r holding the
candidate of rank r. The tree thus depends on the very noise the target draws with; the walk
must still commit the target's law, not one tilted towards the drafter, and a round must not
leak a rejected branch into what follows.

The target is synthetic: a small vocabulary, and after every prefix logits of its own (drawn
once from a seeded generator), under each config's temperature / top-p / top-k; the drafter's
logits after a prefix are the target's perturbed, under the same config, as the head's are.
For each case (config × tree shape) every trial (a seed and a position) drafts its tree, walks
it with the target's Gumbel draws, then goes on with plain draws to a fixed length (the tree's
depth + 1), so every trial yields a sequence of that length. The sequences are compared with
the target's sequential law p(x1) p(x2|x1) …, enumerated exactly: TV and chi-square gates,
Bonferroni over the cases. Three lossy walks must fail the same gates (the test has power).
And seed by seed: the trees drafted here must be the head's own ranking's
(`ranked_candidates`), the real `Sampler.accept_tree` must commit plain sampling's tokens, and
a chain what `accept` commits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from scipy.special import gammaln

from specpipe.core.coupling import gumbel_noise_bank, sampler_for
from specpipe.core.sampling import SamplingParams, committed_tokens, target_probs
from specpipe.core.tree import MAX_RANK, DraftTree, TreeShape, ancestor_paths
from specpipe.proofs.stats import chi_square_p_value, total_variation

VOCAB = 5
CONFIGS = ((0.7, 0.95, 0), (1.0, 1.0, 0), (1.3, 0.9, 3))  # (temp, top_p, top_k)
# Slot i is row i + 1, under row parents[i], holding the candidate of rank ranks[i] there.
SHAPES = {
    "chain of 3": TreeShape.chain(3),
    "3 children": TreeShape((0, 0, 0), (0, 1, 2)),
    "2 × 2": TreeShape((0, 0, 1, 1, 2, 2), (0, 1, 0, 1, 0, 1)),
    # the root's best two; the best two under the first, the best under the second; and one
    # more under the rank-0 branch, the deepest
    "uneven": TreeShape((0, 0, 1, 1, 2, 3), (0, 1, 0, 1, 0, 0)),
}
LENGTH = 1 + max(max(shape.depths) for shape in SHAPES.values())  # the longest sequence
GATE_TV = 0.02  # how far above its sampling floor a case's TV may lie
Progress = Callable[[int], None]


# ---------------------------------------------------------------------------------------------
# The synthetic target and its exact law


def prefix_codes(prefixes: np.ndarray, vocab: int = VOCAB) -> np.ndarray:
    """Each prefix's row in a table of every prefix, the shorter first: prefixes [N, k] give
    (V^0 + … + V^(k-1)) + Σ_i x_i V^i, int64 [N]."""
    k = prefixes.shape[1]
    shorter = (vocab**k - 1) // (vocab - 1)
    return shorter + prefixes @ (vocab ** np.arange(k, dtype=np.int64))


def prefix_logits(
    seed: int, vocab: int = VOCAB, length: int = LENGTH
) -> tuple[np.ndarray, np.ndarray]:
    """Logits after every prefix of up to `length - 1` tokens, and the drafter's (the target's
    perturbed): float64 [prefixes, V] each, the same for every config."""
    rng = np.random.default_rng([seed, 10])
    prefixes = (vocab**length - 1) // (vocab - 1)
    logits = rng.normal(scale=1.5, size=(prefixes, vocab))
    return logits, logits + rng.normal(scale=0.5, size=logits.shape)


@dataclass(frozen=True)
class PrefixTarget:
    """The target under one config: p after every prefix; and the drafter's q, its own logits
    under the same config (as the head's: a top-k or top-p cut may leave fewer candidates than
    a shape asks for, and the slot is left out)."""

    config: tuple[float, float, int]
    logits: np.ndarray  # [prefixes, V], row `prefix_codes(prefix)`
    draft_logits: np.ndarray  # the drafter's, the same rows
    probs: np.ndarray  # p, the same rows
    drafter: np.ndarray  # q, the same rows

    @classmethod
    def make(cls, config: tuple[float, float, int], logits, draft_logits) -> PrefixTarget:
        probs, drafter = target_probs(logits, *config), target_probs(draft_logits, *config)
        return cls(config, logits, draft_logits, probs, drafter)

    @cached_property
    def log_p(self) -> np.ndarray:
        with np.errstate(divide="ignore"):  # log 0 = -inf: a cut token never wins an argmax
            return np.log(self.probs)

    @cached_property
    def log_q(self) -> np.ndarray:
        with np.errstate(divide="ignore"):
            return np.log(self.drafter)


def sequence_codes(seqs: np.ndarray, vocab: int = VOCAB) -> np.ndarray:
    """Sequences [N, L] as integers Σ_j x_j V^j."""
    return seqs @ (vocab ** np.arange(seqs.shape[1], dtype=np.int64))


def sequence_law(target: PrefixTarget, length: int) -> np.ndarray:
    """The target's law of `length` tokens drawn one after another, p(x1) p(x2|x1) …, over
    every sequence by its `sequence_codes`: float64 [V^length]."""
    vocab = target.probs.shape[1]
    seqs = np.arange(vocab**length)[:, None] // vocab ** np.arange(length) % vocab
    law = np.ones(len(seqs))
    for j in range(length):
        law *= target.probs[prefix_codes(seqs[:, :j], vocab), seqs[:, j]]
    return law


def expected_tv(law: np.ndarray, n: int) -> float:
    """The mean TV between `law` and a histogram of n draws from it: the floor an honest
    sample sits on. Σ_s E|X_s - n p_s| / 2n with X_s ~ Binomial(n, p_s), whose mean absolute
    deviation is 2 (m+1) C(n, m+1) p^(m+1) (1-p)^(n-m), m = floor(n p) (de Moivre)."""
    p = law[(law > 0) & (law < 1)]
    m = np.floor(n * p)
    log_choose = gammaln(n + 1) - gammaln(m + 2) - gammaln(n - m)
    log_mad = np.log(2 * (m + 1)) + log_choose + (m + 1) * np.log(p) + (n - m) * np.log1p(-p)
    return float(np.exp(log_mad).sum() / (2 * n))


def noise_banks(seeds: np.ndarray, starts: np.ndarray, vocab: int = VOCAB) -> np.ndarray:
    """The target's Gumbel noise of each trial (seed, root position) at positions start,
    start + 1, …: float64 [LENGTH, N, V], keyed as `core.coupling` keys it."""
    return np.stack([gumbel_noise_bank(seeds, starts + j, vocab).T for j in range(LENGTH)])


# ---------------------------------------------------------------------------------------------
# Trees drafted under the target's noise


@dataclass(frozen=True)
class DraftedTrees:
    """One shape's tree for every trial: slot i (row i + 1) holds tokens[n, i] in trial n, or
    -1 where the drafter had no candidate of that rank there (nor under a slot left out): a
    token no draw equals, so the walk treats the slot as absent, as the tail does."""

    shape: TreeShape
    tokens: np.ndarray  # int64 [N, slots]

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Each row's child rows."""
        kids: list[list[int]] = [[] for _ in range(len(self.shape) + 1)]
        for i, parent in enumerate(self.shape.parents):
            kids[parent].append(i + 1)
        return tuple(tuple(k) for k in kids)

    def rank(self, row: int) -> int:
        """A draft row's rank among its siblings."""
        return self.shape.ranks[row - 1]

    @property
    def depth(self) -> int:
        return max(self.shape.depths)

    @cached_property
    def rank0_branch(self) -> np.ndarray:
        """The tokens down the rank-0 child of each row from the root: [N, its depth]. Rank 0
        is the drafter's best candidate, which a row it expanded always has."""
        paths = ancestor_paths(self.shape.parents)
        rows = [r for r in range(1, len(paths)) if all(self.rank(a) == 0 for a in paths[r][1:])]
        return self.tokens[:, [r - 1 for r in rows]]

    def child(self, row: np.ndarray, token: np.ndarray) -> np.ndarray:
        """Each trial's child of `row` that holds `token`: its row, or -1 (none, or `row` is
        -1: the walk has stopped)."""
        out = np.full(len(row), -1, dtype=np.int64)
        for parent, kids in enumerate(self.children):
            at = row == parent
            for kid in kids:
                out[at & (self.tokens[:, kid - 1] == token)] = kid
        return out

    def tree(self, n: int) -> DraftTree:
        """Trial n's tree as a tail holds it: the slots it has, in slot order."""
        row_of, tokens, parents = {0: 0}, [], []
        for slot, parent in enumerate(self.shape.parents):
            if self.tokens[n, slot] >= 0:
                row_of[slot + 1] = len(tokens) + 1
                tokens.append(int(self.tokens[n, slot]))
                parents.append(row_of[parent])
        return DraftTree(tuple(tokens), tuple(parents))


def draft_trees(shape: TreeShape, target: PrefixTarget, noise: np.ndarray) -> DraftedTrees:
    """The tree the head drafts in every trial: under a row, the drafter's candidates after the
    row's prefix ranked by log q + g over the tokens q keeps, g the target's noise at the
    position they hold (the row's depth past the root); slot i takes the candidate of rank
    ranks[i], or is left out (-1) when q keeps fewer or its parent is left out."""
    paths = ancestor_paths(shape.parents)
    tokens = np.full((noise.shape[1], len(shape)), -1, dtype=np.int64)
    ranked: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # row → (candidates [N, V], kept [N])
    for slot, (parent, rank) in enumerate(zip(shape.parents, shape.ranks, strict=True)):
        if parent not in ranked:
            prefix = tokens[:, [row - 1 for row in paths[parent][1:]]]
            log_q = target.log_q[prefix_codes(np.maximum(prefix, 0))]  # rows left out: unread
            scores = log_q + noise[shape.depths[parent]]
            ranked[parent] = (np.argsort(-scores, axis=1, kind="stable"), (log_q > -np.inf).sum(1))
        candidates, kept = ranked[parent]
        has = kept > rank
        if parent:
            has &= tokens[:, parent - 1] >= 0
        tokens[has, slot] = candidates[has, rank]
    return DraftedTrees(shape, tokens)


# ---------------------------------------------------------------------------------------------
# The walk, and lossy walks


class TreeWalk:
    """`core.tree.walk` over every trial at once, then plain draws to a fixed length. At step j
    the target's Gumbel draw after the trial's committed prefix, under the noise of position
    start + j; a trial still on its tree moves to the child holding the draw, or stops there.
    Each lossy walk below changes one step."""

    def __init__(self, target: PrefixTarget, trees: DraftedTrees, noise: np.ndarray) -> None:
        self.target, self.trees, self.noise = target, trees, noise

    def run(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Each trial's `length` committed tokens [N, length], and its accepted drafts [N]."""
        n = self.noise.shape[1]
        seqs = np.zeros((n, length), dtype=np.int64)
        row = np.zeros(n, dtype=np.int64)  # where each trial's walk stands; -1 once stopped
        accepted = np.zeros(n, dtype=np.int64)
        for j in range(length):
            codes = self.context_codes(seqs[:, :j], row, accepted)
            seqs[:, j] = self.draw(j, codes, row)
            row = self.trees.child(row, seqs[:, j])
            accepted += row > 0
        return seqs, accepted

    def context_codes(self, prefix: np.ndarray, row: np.ndarray, accepted: np.ndarray):
        """The `prefix_codes` of what each trial's next token is drawn after: its committed
        tokens `prefix` [N, j]."""
        return prefix_codes(prefix)

    def draw(self, j: int, codes: np.ndarray, row: np.ndarray) -> np.ndarray:
        """The target's Gumbel draw after each prefix: argmax of log p + g."""
        return np.argmax(self.target.log_p[codes] + self.noise[j], axis=1)


class SiblingAfterMiss(TreeWalk):
    """Lossy: where the target's draw matches no child, the rank-0 child is accepted anyway
    and the walk goes on under it."""

    def draw(self, j, codes, row):
        x = super().draw(j, codes, row)
        missed = self.trees.child(row, x) < 0
        for parent, kids in enumerate(self.trees.children):
            for kid in kids:
                if self.trees.rank(kid) == 0:
                    miss = missed & (row == parent)
                    x[miss] = self.trees.tokens[miss, kid - 1]
        return x


class RejectedBranchCached(TreeWalk):
    """Lossy: the token after the walk is drawn after the rank-0 branch's drafts, not the
    accepted ones, as from a cache that kept the wrong rows (the walk's own draws are right)."""

    def context_codes(self, prefix, row, accepted):
        j = prefix.shape[1]
        if j < 2:  # no draft accepted yet: nothing to mix up
            return prefix_codes(prefix)
        first_after = (row < 0) & (accepted + 1 == j)
        wrong = prefix.copy()
        kept = min(j - 1, self.trees.rank0_branch.shape[1])
        wrong[first_after, :kept] = self.trees.rank0_branch[first_after, :kept]
        return prefix_codes(wrong)


class NoiseByRank(TreeWalk):
    """Lossy: at a drafted row the target's noise for a child's token is keyed by the child's
    rank (the noise of token id 0, 1, …), not by its token id."""

    def draw(self, j, codes, row):
        g = self.noise[j]
        scores = self.target.log_p[codes] + g
        for parent, kids in enumerate(self.trees.children):
            for kid in kids:
                at = np.flatnonzero((row == parent) & (self.trees.tokens[:, kid - 1] >= 0))
                token = self.trees.tokens[at, kid - 1]
                scores[at, token] += g[at, self.trees.rank(kid)] - g[at, token]
        return np.argmax(scores, axis=1)


MUTANTS: dict[str, type[TreeWalk]] = {
    "sibling_after_miss": SiblingAfterMiss,
    "rejected_branch_cached": RejectedBranchCached,
    "noise_by_rank": NoiseByRank,
}


# ---------------------------------------------------------------------------------------------
# The cases, the gates and the exact check


def trial_keys(seed: int, stream: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n random trials: (seeds uint64 [n], root positions int64 [n])."""
    rng = np.random.default_rng([seed, stream])
    return rng.integers(0, 2**64, size=n, dtype=np.uint64), rng.integers(0, 2**40, size=n)


def run_tree_cases(
    draws: int, seed: int, walks: dict[str, type[TreeWalk]], progress: Progress
) -> dict[str, list[dict]]:
    """Every (config, shape) case under every walk, over the same `draws` trials: one row per
    case for each walk, its sequences' fit to the exact law and its mean accepted drafts."""
    noise = noise_banks(*trial_keys(seed, 11, draws))
    logits, draft_logits = prefix_logits(seed)
    rows: dict[str, list[dict]] = {name: [] for name in walks}
    for config in CONFIGS:
        target = PrefixTarget.make(config, logits, draft_logits)
        for shape_name, shape in SHAPES.items():
            trees = draft_trees(shape, target, noise)
            length = trees.depth + 1
            law = sequence_law(target, length)
            floor = expected_tv(law, draws)
            for name, walk in walks.items():
                seqs, accepted = walk(target, trees, noise).run(length)
                counts = np.bincount(sequence_codes(seqs), minlength=len(law)).astype(float)
                rows[name].append(
                    {
                        "temp": config[0],
                        "top_p": config[1],
                        "top_k": config[2],
                        "shape": shape_name,
                        "length": length,
                        "sequences": int(np.count_nonzero(law)),
                        "tv": total_variation(counts, law),
                        "tv_floor": floor,
                        "p_value": chi_square_p_value(counts, law),
                        "mean_accepted": float(accepted.mean()),
                    }
                )
                progress(1)
    return rows


def judge(rows: list[dict], gate_tv: float, alpha: float) -> list[dict]:
    """Mark each row pass/fail: its TV at most `gate_tv` above the floor of an honest sample of
    its size (over hundreds of sequences that floor is not small: 0.039 for 625 sequences at
    20,000 draws), and its chi-square p-value above alpha."""
    for row in rows:
        row["pass"] = row["tv"] <= row["tv_floor"] + gate_tv and row["p_value"] > alpha
    return rows


def mutant_summary(name: str, rows: list[dict]) -> dict:
    """A lossy walk's verdict: caught when any case fails; the failing cases by name."""
    failed = [
        {"case": case_name(row), "tv": row["tv"], "p_value": row["p_value"]}
        for row in rows
        if not row["pass"]
    ]
    return {
        "name": name,
        "worst_tv": max(row["tv"] for row in rows),
        "cases_failed": len(failed),
        "caught": bool(failed),
        "failed": failed,
    }


def case_name(row: dict) -> str:
    return f"{row['shape']} at {row['temp']:g}/{row['top_p']:g}/{row['top_k']}"


def head_tree(
    shape: TreeShape, target: PrefixTarget, params: SamplingParams, start: int
) -> DraftTree:
    """The tree `DraftHead.draft_tree` assembles for `shape` from the head's own ranking
    (`ranked_candidates`) of the drafter's logits after each row's prefix, the root's children
    holding the tokens at position `start`."""
    from specpipe.drafting.coupled import ranked_candidates

    row_of, tokens, parents = {0: 0}, [], []
    prefixes: dict[int, tuple[int, ...]] = {0: ()}  # tree row → its drafts below the root
    for slot, (parent, rank) in enumerate(zip(shape.parents, shape.ranks, strict=True)):
        if parent not in row_of:
            continue
        at = row_of[parent]
        logits = target.draft_logits[prefix_code(prefixes[at])]
        ranked = ranked_candidates(logits, params, start + shape.depths[parent], None, MAX_RANK)
        if rank < len(ranked):
            row_of[slot + 1] = len(tokens) + 1
            tokens.append(ranked[rank])
            parents.append(at)
            prefixes[len(tokens)] = (*prefixes[at], ranked[rank])
    return DraftTree(tuple(tokens), tuple(parents))


def exact_check(seed: int, trials: int) -> dict:
    """Seed by seed, trial i running case i mod cases: each trial's tree as drafted here must be
    the head's (`head_tree`); the real `Sampler.accept_tree` (sampler gumbel) on it, each row's
    logits the target's after the row's prefix, must commit `Sampler.sample`'s tokens along
    them, position by position; the vectorised walk of the law check must commit the same; and
    a chain must commit what `Sampler.accept` does."""
    seeds, starts = trial_keys(seed, 12, trials)
    noise = noise_banks(seeds, starts)
    logits, draft_logits = prefix_logits(seed)
    cases = [(config, shape) for config in CONFIGS for shape in SHAPES.values()]
    tree_mismatches = plain_mismatches = walk_mismatches = 0
    chain_trials = chain_mismatches = accepted = 0
    for c, (config, shape) in enumerate(cases):
        target = PrefixTarget.make(config, logits, draft_logits)
        trees = draft_trees(shape, target, noise)
        walked, walk_accepted = TreeWalk(target, trees, noise).run(trees.depth + 1)
        for n in range(c, trials, len(cases)):
            tree = trees.tree(n)
            params = SamplingParams(*config, seed=int(seeds[n]), sampler="gumbel")
            sampler, start = sampler_for(params), int(starts[n])
            tree_mismatches += tree != head_tree(shape, target, params, start)
            rows = [prefix_code(path_tokens(tree, r)) for r in range(tree.rows)]
            committed, path = sampler.accept_tree(target.logits[rows], tree, start)
            plain = [
                sampler.sample(target.logits[prefix_code(committed[:j])], start + j)
                for j in range(len(committed))
            ]
            plain_mismatches += committed != plain
            walk_mismatches += (
                committed != walked[n, : len(committed)].tolist()
                or len(path) - 1 != walk_accepted[n]
            )
            accepted += len(path) - 1
            if tree.is_chain:
                result = sampler.accept(target.logits[rows], list(tree.tokens), start)
                chain_mismatches += committed != committed_tokens(tree.tokens, result)
                chain_trials += 1
    return {
        "trials": trials,
        "tree_mismatches": int(tree_mismatches),
        "mismatches": int(plain_mismatches),
        "walk_mismatches": int(walk_mismatches),
        "chain_trials": chain_trials,
        "chain_mismatches": int(chain_mismatches),
        "drafts_accepted": int(accepted),
    }


def prefix_code(tokens: Sequence[int]) -> int:
    """`prefix_codes` of one prefix."""
    return int(prefix_codes(np.array([tokens], dtype=np.int64).reshape(1, -1))[0])


def path_tokens(tree: DraftTree, row: int) -> list[int]:
    """The drafts from the root down to `row`: the prefix its logits are drawn after."""
    return [tree.tokens[r - 1] for r in tree.paths[row][1:]]


def run_tree_proof(
    draws: int,
    seed: int = 0,
    gate_tv: float = GATE_TV,
    alpha: float = 0.001,
    exact_trials: int = 300,
    progress: Progress = lambda _: None,
    walk: type[TreeWalk] = TreeWalk,
) -> dict:
    """The tree cases under `walk` (the real one unless a test swaps it), the lossy walks and
    the exact check: the part of proof 1's document under "trees"."""
    rows = run_tree_cases(draws, seed, {"walk": walk} | MUTANTS, progress)
    per_test = alpha / len(rows["walk"])  # Bonferroni over the cases
    cases = judge(rows.pop("walk"), gate_tv, per_test)
    mutants = [mutant_summary(name, judge(r, gate_tv, per_test)) for name, r in rows.items()]
    exact = exact_check(seed, exact_trials)
    progress(1)
    passed = (
        all(row["pass"] for row in cases)
        and all(m["caught"] for m in mutants)
        and exact["tree_mismatches"] == exact["mismatches"] == 0
        and exact["walk_mismatches"] == exact["chain_mismatches"] == 0
    )
    return {
        "vocab": VOCAB,
        "draws_per_case": draws,
        "gate": gate_tv,
        "alpha_per_test": per_test,
        "worst_tv": max(row["tv"] for row in cases),
        "worst_tv_over_floor": max(row["tv"] - row["tv_floor"] for row in cases),
        "worst_p_value": min(row["p_value"] for row in cases),
        "cases": cases,
        "mutants": mutants,
        "exact": exact,
        "pass": passed,
    }
