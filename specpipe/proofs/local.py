"""Proof 1, the local math: the verify rule commits tokens distributed exactly as the target.

It drives the very functions the tail runs (`target_probs`, `draw`, `verify_coupled`,
`verify_residual`) over a grid of synthetic targets, many draws at a time, and checks:

- per case (temperature × top-p × top-k × draft, for the coupled and the residual form):
  total variation between committed tokens and the target, and a chi-square goodness-of-fit
  p-value, against a TV gate and a Bonferroni-corrected alpha;
- the multi-position law (K drafts over K+1 different targets): exact enumeration of the
  residual rule and Monte-Carlo of both forms against sequential plain sampling;
- three lossy mutants of the rule, which must fail the same gates (the test has power);
- greedy (temp <= 0) bit-identical to argmax, exact ties included;
- exact coupling: the verify path commits what plain sampling draws, trial for trial.

And for the Gumbel-max form (`specpipe.core.coupling`), where a drafter draws from its own q under
the target's noise keyed by (seed, position, token):

- per case (config × drafter q: a perturbed neighbour of p, a hotter q without p's cut, q = p):
  TV and chi-square of the committed tokens against p, and the agreement rate P(draft ==
  commit) between the Gumbel-coupling floor (1-TV)/(1+TV) and the ceiling Σ min(p, q), at
  Gumbel's exact rate, within the Monte-Carlo error;
- the K = 2 joint law of coupled drafts from q against its enumeration, whose marginals are
  sequential plain sampling's;
- four lossy mutants (draft noise keyed one position on, the target's cut ignored, a draft
  accepted whenever p gives it mass, noise keyed by rank), which must fail;
- exact coupling: `GumbelSampler.accept` commits what `GumbelSampler.sample` draws.

And for draft trees verified by walking them (`specpipe.proofs.tree_cases`, the document's "trees"):
the committed law of a tree round against exact enumeration, three lossy walks, and
`Sampler.accept_tree` committing plain sampling's tokens seed by seed.

The result also gives the proof's time against a plain numpy grid of as many cases
(`reference_grid_seconds`), the yardstick for keeping proof 1 fast.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy.special import ndtri

from specpipe.core.coupling import GumbelSampler, gumbel_argmax, gumbel_draw, gumbel_noise_bank
from specpipe.core.sampling import (
    Sampler,
    committed_tokens,
    draw,
    residual_probs,
    target_probs,
    uniforms,
    verify_coupled,
    verify_residual,
)
from specpipe.proofs import tree_cases
from specpipe.proofs.stats import chi_square_p_value, total_variation

Progress = Callable[[int], None]  # called with the number of units of work just finished


@dataclass
class LocalProofConfig:
    """The grid and the gates of proof 1."""

    draws: int = 120_000
    vocab: int = 32
    seed: int = 0
    temps: Sequence[float] = (0.7, 0.8, 1.0, 1.3)
    top_ps: Sequence[float] = (0.8, 0.9, 0.95, 1.0)
    top_ks: Sequence[int] = (0, 10, 20)
    gate_tv: float = 0.02
    alpha: float = 0.001
    greedy_rows: int = 10_000
    coupling_trials: int = 100_000
    sampler_trials: int = 2_000  # of the coupling trials, run through Sampler objects one by one
    drafts: Sequence[str] = field(default=("argmax", "median", "outside"))
    # The Gumbel form's drafters: each config's q (see `drafter_probs`).
    drafters: Sequence[str] = field(default=("neighbour", "uncut", "equal"))
    gumbel_sampler_trials: int = 500  # GumbelSampler.accept against .sample, trial by trial
    tree_draws: int | None = None  # draws per tree case (None: `draws`)
    tree_exact_trials: int = 300  # Sampler.accept_tree against .sample, trial by trial

    @property
    def configs(self) -> list[tuple[float, float, int]]:
        return list(itertools.product(self.temps, self.top_ps, self.top_ks))

    @property
    def n_cases(self) -> int:
        return len(self.configs) * len(self.drafts)

    @property
    def n_gumbel_cases(self) -> int:
        return len(self.configs) * len(self.drafters)

    @property
    def n_tree_draws(self) -> int:
        return self.draws if self.tree_draws is None else self.tree_draws

    def work_units(self) -> int:
        """How many progress units a run reports: one per case and form, plus the checks."""
        gumbel = self.n_gumbel_cases * (1 + len(GUMBEL_MUTANTS))
        tree = len(tree_cases.CONFIGS) * len(tree_cases.SHAPES) * (1 + len(tree_cases.MUTANTS)) + 1
        return self.n_cases * (2 + len(MUTANTS)) + gumbel + tree + 5


# ---------------------------------------------------------------------------------------------
# The single-position cases: what a verify rule commits at the first drafted slot


def choose_draft(probs: np.ndarray, logits: np.ndarray, kind: str) -> int:
    """argmax; the median-probability token of the kept support; or a token outside it (the
    least likely token when nothing is cut)."""
    if kind == "argmax":
        return int(np.argmax(probs))
    if kind == "median":
        support = np.flatnonzero(probs > 0)
        ranked = support[np.argsort(-probs[support], kind="stable")]
        return int(ranked[len(ranked) // 2])
    if kind == "outside":
        return int(np.argmin(logits))
    raise ValueError(f"unknown draft kind {kind!r}")


def first_commit_coupled(probs: np.ndarray, draft: int, rng: np.random.Generator, n: int):
    """The committed first token of n coupled verifies of one draft (the bonus row = target).

    As `Sampler.accept` does, the bonus row is drawn only where the draft was accepted."""
    u = rng.random((n, 2))
    targets = np.stack([draw(probs, u[:, 0]), np.full(n, -1)], axis=1)
    accepted = targets[:, 0] == draft
    targets[accepted, 1] = draw(probs, u[accepted, 1])
    return verify_coupled(targets, np.array([draft]))[:, 0]


def first_commit_residual(probs: np.ndarray, draft: int, rng: np.random.Generator, n: int):
    """The committed first token of n residual-form verifies of one draft."""
    rows = np.stack([probs, probs])
    return verify_residual(rows, np.array([draft]), rng.random((n, 1)), rng.random((n, 2)))[:, 0]


# Lossy mutants of the residual rule: each must be caught.


def mutant_always_accept(probs, draft, rng, n):
    """Commit the draft whatever the target says."""
    return np.full(n, draft, dtype=np.int64)


def mutant_no_removal(probs, draft, rng, n):
    """On rejection, resample from p without removing the draft."""
    accept = rng.random(n) < probs[draft]
    return np.where(accept, draft, draw(probs, rng.random(n)))


def mutant_argmax_only(probs, draft, rng, n):
    """Accept iff the draft is the argmax; otherwise commit from the residual."""
    if draft == int(np.argmax(probs)):
        return np.full(n, draft, dtype=np.int64)
    return draw(residual_probs(probs, np.int64(draft)), rng.random(n))


FORMS = {"coupled": first_commit_coupled, "residual": first_commit_residual}
MUTANTS = {
    "always_accept": mutant_always_accept,
    "resample_without_removing_draft": mutant_no_removal,
    "accept_iff_argmax": mutant_argmax_only,
}


def case_targets(cfg: LocalProofConfig):
    """Each config's ((temp, top_p, top_k), logits [V], target p [V]), the same every run."""
    case_rng = np.random.default_rng([cfg.seed, 1])
    for params in cfg.configs:
        logits = case_rng.normal(scale=2.0, size=cfg.vocab)
        yield params, logits, target_probs(logits, *params)


def case_row(
    form: str, config: tuple, draft: str, counts: np.ndarray, probs: np.ndarray, **extra
) -> dict:
    """One case's row: its form, config and drafter, and how its committed tokens' `counts`
    fit the target `probs` (TV and the chi-square p-value)."""
    temp, top_p, top_k = config
    fit = {"tv": total_variation(counts, probs), "p_value": chi_square_p_value(counts, probs)}
    return {
        "form": form,
        "temp": temp,
        "top_p": top_p,
        "top_k": top_k,
        "draft": draft,
        **extra,
        **fit,
    }


def run_cases(cfg: LocalProofConfig, rules: dict, progress: Progress) -> list[dict]:
    """Every (config, draft) case under every rule; one row per case and rule."""
    rows = []
    for (temp, top_p, top_k), logits, probs in case_targets(cfg):
        for kind in cfg.drafts:
            draft = choose_draft(probs, logits, kind)
            for name, rule in rules.items():
                rng = np.random.Generator(np.random.Philox(key=[cfg.seed, len(rows)]))
                committed = rule(probs, draft, rng, cfg.draws)
                counts = np.bincount(committed, minlength=cfg.vocab).astype(np.float64)
                extra = {"draft_id": draft, "p_draft": float(probs[draft])}
                rows.append(case_row(name, (temp, top_p, top_k), kind, counts, probs, **extra))
                progress(1)
    return rows


def judge(rows: list[dict], gate_tv: float, alpha: float) -> float:
    """Mark each row pass/fail against the TV gate and Bonferroni alpha; return the alpha used."""
    corrected = alpha / max(len(rows), 1)
    for row in rows:
        row["pass"] = row["tv"] <= gate_tv and row["p_value"] > corrected
    return corrected


# ---------------------------------------------------------------------------------------------
# Several positions at once


def plain_sequence_law(probs: np.ndarray, drafts: Sequence[int]) -> dict[tuple, float]:
    """Law of plain sequential sampling from probs[0], probs[1], …, cut after the first token
    that differs from the draft (or after the bonus): the product law."""
    law: dict[tuple, float] = {}
    reach = 1.0
    for j, d in enumerate(drafts):
        for token in np.flatnonzero(probs[j] > 0):
            if token != d:
                law[tuple(drafts[:j]) + (int(token),)] = reach * probs[j, token]
        reach *= probs[j, d]
    for token in np.flatnonzero(probs[len(drafts)] > 0):
        law[tuple(drafts) + (int(token),)] = reach * probs[len(drafts), token]
    return law


def residual_rule_law(probs: np.ndarray, drafts: Sequence[int]) -> dict[tuple, float]:
    """Law of the residual rule, enumerated through its steps: accept with p(d), else a token of
    `residual_probs` (the code's own), and the bonus after K acceptances."""
    law: dict[tuple, float] = {}
    reach = 1.0
    for j, d in enumerate(drafts):
        rest = residual_probs(probs[j], np.int64(d))
        for token in np.flatnonzero(rest > 0):
            law[tuple(drafts[:j]) + (int(token),)] = reach * (1 - probs[j, d]) * rest[token]
        reach *= probs[j, d]
    for token in np.flatnonzero(probs[len(drafts)] > 0):
        law[tuple(drafts) + (int(token),)] = reach * probs[len(drafts), token]
    return law


def sequence_histogram(results: np.ndarray) -> dict[tuple, int]:
    """Committed sequences (entries before the -1 padding) and how often each occurred."""
    base = int(results.max()) + 2  # a row's entries + 1 as the digits of one integer
    if base ** results.shape[1] < 2**62:  # unique over integers, not over rows: much faster
        weights = base ** np.arange(results.shape[1])
        codes, counts = np.unique((results + 1) @ weights, return_counts=True)
        seqs = codes[:, None] // weights % base - 1
    else:
        seqs, counts = np.unique(results, axis=0, return_counts=True)
    return {tuple(int(t) for t in s if t >= 0): int(c) for s, c in zip(seqs, counts, strict=True)}


def multi_position_check(cfg: LocalProofConfig, alpha: float) -> dict:
    """K = 3 drafts over three different targets plus a bonus target."""
    rng = np.random.default_rng([cfg.seed, 2])
    probs = target_probs(rng.normal(scale=1.5, size=(4, cfg.vocab)), 0.9, 0.95, 0)
    drafts = [
        int(np.argmax(probs[0])),
        int(np.argmax(probs[1])),
        choose_draft(probs[2], np.log(probs[2] + 1e-300), "median"),
    ]
    law = plain_sequence_law(probs, drafts)
    enumerated = residual_rule_law(probs, drafts)
    exact_gap = max(
        abs(enumerated.get(k, 0.0) - law.get(k, 0.0)) for k in law.keys() | enumerated.keys()
    )
    keys = sorted(law)
    target = np.array([law[k] for k in keys])
    out = {"drafts": drafts, "sequences": len(keys), "exact_enumeration_max_abs_diff": exact_gap}
    n = cfg.draws
    d = np.array(drafts)
    draws = {
        "coupled": verify_coupled(draw(probs, rng.random((n, 4))), d),
        "residual": verify_residual(probs, d, rng.random((n, 3)), rng.random((n, 4))),
    }
    passed = exact_gap < 1e-12
    for name, results in draws.items():
        hist = sequence_histogram(results)
        outside = sum(c for k, c in hist.items() if k not in law)
        counts = np.array([hist.get(k, 0) for k in keys], dtype=np.float64)
        counts_all = np.append(counts, outside)
        probs_all = np.append(target, 0.0)
        tv = total_variation(counts_all, probs_all)
        p_value = chi_square_p_value(counts_all, probs_all)
        # Over ~100 sequences the TV of a sample is mostly noise, so the chi-square test (with
        # impossible sequences at p = 0) is the gate here; the TV is reported.
        ok = p_value > alpha
        out[name] = {"tv": tv, "p_value": p_value, "impossible_sequences": outside, "pass": ok}
        passed = passed and ok
    out["pass"] = passed
    return out


# ---------------------------------------------------------------------------------------------
# Greedy and exact coupling


def greedy_check(cfg: LocalProofConfig) -> dict:
    """temp 0 and temp < 0 against argmax on rows full of exact ties."""
    rng = np.random.default_rng([cfg.seed, 3])
    rows = rng.integers(-3, 4, size=(cfg.greedy_rows, cfg.vocab)).astype(np.float64)
    rows[rng.random(rows.shape) < 0.05] = -np.inf
    rows[:, 0] = np.where(np.isneginf(rows).all(axis=1), 0.0, rows[:, 0])
    expected = np.argmax(rows, axis=1)
    mismatches = 0
    for temp in (0.0, -1.0):
        one_hot = target_probs(rows, temp)
        mismatches += int((np.argmax(one_hot, axis=1) != expected).sum())
        mismatches += int((one_hot.sum(axis=1) != 1).sum())
        sampler = Sampler(seed=cfg.seed, temp=temp)
        for start in range(0, len(rows), 100):  # verify rounds of 99 drafts, all argmax
            block = rows[start : start + 100]
            result = sampler.accept(block, expected[start : start + len(block) - 1], start)
            mismatches += int((np.array(result) != expected[start : start + len(block)]).sum())
        for i in range(0, len(rows), 50):  # plain sampling on a sample of rows
            mismatches += int(sampler.sample(rows[i], i) != expected[i])
    return {"rows": len(rows), "temps": [0.0, -1.0], "mismatches": mismatches}


def _target_draws(logits: np.ndarray, probs, seeds: np.ndarray, positions: np.ndarray):
    """The target's own draw for each row of logits `[..., V]` at its (seed, position), from
    its distribution `probs` (the same shape; None when greedy)."""
    if probs is None:
        return np.argmax(logits, axis=-1)
    return draw(probs, uniforms(seeds, positions))


COUPLING_PARAMS = list(itertools.product((0.0, 0.7, 1.0, 1.3), (1.0, 0.9), (0, 10)))


def coupling_check(cfg: LocalProofConfig) -> dict:
    """Verify vs plain on random (logits, seed, position) trials: the committed tokens must be
    the plain draws at those positions, every time."""
    rng = np.random.default_rng([cfg.seed, 4])
    per_group = math.ceil(cfg.coupling_trials / len(COUPLING_PARAMS))
    trials = mismatches = 0
    for group, (temp, top_p, top_k) in enumerate(COUPLING_PARAMS):
        n, k, vocab = per_group, group % 5, cfg.vocab
        logits = np.round(rng.normal(scale=2.0, size=(n, k + 1, vocab)), 1)  # rounding makes ties
        seeds = rng.integers(0, 2**64, size=n, dtype=np.uint64)
        starts = rng.integers(0, 2**40, size=n)

        probs = None  # one target distribution per row, shared by the plain and verify paths
        if temp > 0:
            flat = target_probs(logits.reshape(-1, vocab), temp, top_p, top_k)
            probs = flat.reshape(logits.shape)
        at = [None if probs is None else probs[:, j] for j in range(k + 1)]
        plain = np.stack(
            [_target_draws(logits[:, j], at[j], seeds, starts + j) for j in range(k + 1)], axis=1
        )
        right = rng.integers(0, k + 1, size=n)  # leading drafts that match the plain draw
        slots = np.arange(k)
        drafts = np.where(slots < right[:, None], plain[:, :k], (plain[:, :k] + 1) % vocab)
        positions = starts[:, None] + np.arange(k + 1)
        result = verify_coupled(_target_draws(logits, probs, seeds[:, None], positions), drafts)
        expected = np.where(np.arange(k + 1) <= right[:, None], plain, -1)
        mismatches += int((result != expected).any(axis=1).sum())
        trials += n
    # And a share of the trials through the Sampler objects a tail holds, one call at a time.
    sampler_mismatches = 0
    for i in range(cfg.sampler_trials):
        temp, top_p, top_k = COUPLING_PARAMS[i % len(COUPLING_PARAMS)]
        k = i % 5
        logits = rng.normal(scale=2.0, size=(k + 1, cfg.vocab))
        sampler = Sampler(temp=temp, top_p=top_p, top_k=top_k, seed=int(rng.integers(0, 2**63)))
        start = int(rng.integers(0, 2**40))
        plain = [sampler.sample(logits[j], start + j) for j in range(k + 1)]
        right = int(rng.integers(0, k + 1))
        drafts = plain[:right] + [(t + 1) % cfg.vocab for t in plain[right:k]]
        if committed_tokens(drafts, sampler.accept(logits, drafts, start)) != plain[: right + 1]:
            sampler_mismatches += 1
    return {
        "trials": trials + cfg.sampler_trials,
        "mismatches": mismatches + sampler_mismatches,
        "vectorised_trials": trials,
        "sampler_object_trials": cfg.sampler_trials,
    }


# ---------------------------------------------------------------------------------------------
# The Gumbel-max form: drafts drawn from a drafter's own q under the target's noise
#
# Every trial is a (seed, position) key; its noise for every token comes from one batched
# Philox pass (`gumbel_noise_bank`) and is shared by all configs, so a config costs a few
# argmaxes. Shared noise makes the cases dependent, which Bonferroni does not mind.

GUMBEL_K = 2  # drafts per trial in the multi-position check; the bank holds GUMBEL_K + 1 slots
BANK_BYTES = 256 * 2**20  # the noise of one chunk of trials: bounds memory for a large vocab


def drafter_probs(logits: np.ndarray, params: tuple, kind: str, rng: np.random.Generator):
    """A drafter's q for a target at `params`, a point mass only when it equals such a p: a
    neighbour (the target's logits perturbed, at its temperature and top-k); a hotter q without
    the top-p / top-k cut, with mass on the tokens p's cut removes; or q equal to p."""
    temp, top_p, top_k = params
    if kind == "neighbour":  # its own top-p would often leave a point mass: top-k only
        return target_probs(logits + rng.normal(scale=0.5, size=len(logits)), temp, 1.0, top_k)
    if kind == "uncut":
        return target_probs(logits, temp * 1.25)
    if kind == "equal":
        return target_probs(logits, *params)
    raise ValueError(f"unknown drafter kind {kind!r}")


def gumbel_agreement(p: np.ndarray, q: np.ndarray) -> float:
    """P(x = y) for x, y Gumbel-max draws of p and q under the same noise: Σ_i P(x = y = i)
    with P(x = y = i) = 1 / Σ_j max(p_j / p_i, q_j / q_i) (an exponential race)."""
    return float(joint_agreement(p, q).sum())


def joint_agreement(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """P(x = y = i) for each token i: float64 [V] (see `gumbel_agreement`)."""
    both = np.flatnonzero((p > 0) & (q > 0))
    out = np.zeros(len(p))
    ratios = np.maximum(p[None, :] / p[both, None], q[None, :] / q[both, None])
    out[both] = 1.0 / ratios.sum(axis=1)
    return out


class GumbelTrials:
    """One config's target p under the noise of every trial at positions t, t+1, …; the draws
    of each distribution at each position are taken once (`draws`) and shared by the rules."""

    def __init__(self, probs: np.ndarray, uncut: np.ndarray, noise: np.ndarray) -> None:
        self.probs = probs  # p [V]
        self.uncut = uncut  # p before its top-k and top-p cut
        self.noise = noise  # [positions, V, N]
        self._draws: dict[tuple, np.ndarray] = {}

    def draws(self, probs: np.ndarray, position: int = 0) -> np.ndarray:
        """argmax(log probs + g) of every trial at position t + `position`: int64 [N]."""
        key = (position, probs.tobytes())
        if key not in self._draws:
            self._draws[key] = gumbel_argmax(probs, self.noise[position])
        return self._draws[key]

    @functools.cached_property
    def targets(self) -> np.ndarray:
        """The target's own draws at t and at t + 1 (a bonus row with the same p): [N, 2]."""
        return np.stack([self.draws(self.probs), self.draws(self.probs, 1)], axis=1)


def gumbel_first_commit(trials: GumbelTrials, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The committed first token of each trial's coupled verify of one draft drawn from q with
    the target's noise; and the drafts."""
    drafts = trials.draws(q)
    return verify_coupled(trials.targets, drafts[:, None])[:, 0], drafts


# Lossy mutants of the Gumbel form: each must be caught. The verify rule commits the target's
# draw at the first slot, so a mutant that only changes that draw commits it directly.


def mutant_draft_noise_next_position(trials: GumbelTrials, q: np.ndarray):
    """The draft drawn with the noise keyed one position on, and accepted when it is the
    target's argmax under that same noise (else the target's own draw is committed)."""
    drafts = trials.draws(q, 1)
    under_draft_noise = trials.draws(trials.probs, 1)
    return np.where(drafts == under_draft_noise, drafts, trials.draws(trials.probs)), drafts


def mutant_cut_ignored(trials: GumbelTrials, q: np.ndarray):
    """The target's draw takes the argmax over p before its top-k / top-p cut."""
    return trials.draws(trials.uncut), trials.draws(q)


def mutant_accept_in_support(trials: GumbelTrials, q: np.ndarray):
    """Accept the draft whenever the target gives it mass."""
    drafts = trials.draws(q)
    return np.where(trials.probs[drafts] > 0, drafts, trials.draws(trials.probs)), drafts


def mutant_noise_by_rank(trials: GumbelTrials, q: np.ndarray):
    """The drafter keys its noise by the rank of a token in its own support, not by its id:
    commits stay exact, but the draft no longer shares the target's noise (agreement drops)."""
    support = np.flatnonzero(q > 0)
    if np.array_equal(support, np.arange(len(support))):  # ranks are ids: the real draws
        drafts = trials.draws(q)
    else:
        drafts = support[gumbel_argmax(q[support], trials.noise[0, : len(support)])]
    return trials.draws(trials.probs), drafts


GUMBEL_FORMS = {"gumbel": gumbel_first_commit}
GUMBEL_MUTANTS = {
    "gumbel_draft_noise_at_next_position": mutant_draft_noise_next_position,
    "gumbel_cut_ignored": mutant_cut_ignored,
    "gumbel_accept_draft_in_support": mutant_accept_in_support,
    "gumbel_noise_keyed_by_rank": mutant_noise_by_rank,
}


def gumbel_banks(cfg: LocalProofConfig) -> Iterator[np.ndarray]:
    """The noise of cfg.draws random (seed, position) trials at positions t … t+GUMBEL_K, in
    chunks of trials that fit BANK_BYTES: float64 [GUMBEL_K + 1, V, n] each."""
    rng = np.random.default_rng([cfg.seed, 5])
    seeds = rng.integers(0, 2**64, size=cfg.draws, dtype=np.uint64)
    starts = rng.integers(0, 2**40, size=cfg.draws)
    chunk = max(1, BANK_BYTES // ((GUMBEL_K + 1) * cfg.vocab * 8))
    for lo in range(0, cfg.draws, chunk):
        keys = seeds[lo : lo + chunk], starts[lo : lo + chunk]
        yield np.stack(
            [gumbel_noise_bank(keys[0], keys[1] + j, cfg.vocab) for j in range(GUMBEL_K + 1)]
        )


def run_gumbel(cfg: LocalProofConfig, rules: dict, progress: Progress):
    """Every (config, drafter) case under every Gumbel rule, each config's target the
    point-mass cases' own at the bank's first position: one row per case and rule; and the
    multi-position check's verify results (`gumbel_multi_results`) under the same noise."""
    targets = list(case_targets(cfg))
    drafters = []  # each config's drafters' q, in cfg.drafters order
    for index, (params, logits, _probs) in enumerate(targets):
        key = [cfg.seed, 6, index]
        drafters.append(
            [
                drafter_probs(logits, params, kind, np.random.default_rng(key))
                for kind in cfg.drafters
            ]
        )
    counts = np.zeros((len(targets), len(cfg.drafters), len(rules), cfg.vocab))
    agreed = np.zeros(counts.shape[:3])
    multi_targets = gumbel_multi_targets(cfg)
    multi_results = []
    for bank in gumbel_banks(cfg):
        multi_results.append(gumbel_multi_results(*multi_targets, bank))
        for c, (params, logits, probs) in enumerate(targets):
            trials = GumbelTrials(probs, target_probs(logits, params[0]), bank)
            for d, q in enumerate(drafters[c]):
                for r, rule in enumerate(rules.values()):
                    committed, drafts = rule(trials, q)
                    counts[c, d, r] += np.bincount(committed, minlength=cfg.vocab)
                    agreed[c, d, r] += np.count_nonzero(committed == drafts)
    rows = []
    for c, ((temp, top_p, top_k), _logits, probs) in enumerate(targets):
        for d, kind in enumerate(cfg.drafters):
            q = drafters[c][d]
            tv_q = total_variation(q, probs)
            exact = gumbel_agreement(probs, q)
            for r, name in enumerate(rules):
                rows.append(
                    case_row(
                        name,
                        (temp, top_p, top_k),
                        kind,
                        counts[c, d, r],
                        probs,
                        tv_drafter_vs_target=tv_q,
                        trials=cfg.draws,
                        agreement=float(agreed[c, d, r] / cfg.draws),
                        agreement_exact=exact,
                        agreement_floor=(1 - tv_q) / (1 + tv_q),
                        agreement_ceiling=1 - tv_q,
                    )
                )
                progress(1)
    return rows, np.concatenate(multi_results)


def judge_agreement(rows: list[dict], alpha: float) -> None:
    """Mark each Gumbel row's agreement: between the Gumbel-coupling floor (1-TV)/(1+TV) and
    the ceiling Σ min(p, q) = 1-TV, and at Gumbel's exact rate, within the Monte-Carlo error a
    two-sided test at `alpha` allows; a row passes only with its agreement."""
    z = float(ndtri(1 - alpha / 2))
    for row in rows:
        rate, exact, n = row["agreement"], row["agreement_exact"], row["trials"]
        slack = z * math.sqrt(max(exact * (1 - exact), 1 / n) / n)
        row["agreement_ok"] = (
            row["agreement_floor"] - slack <= rate <= row["agreement_ceiling"] + slack
            and abs(rate - exact) <= slack
        )
        row["pass"] = row["pass"] and row["agreement_ok"]


def coupled_prefix_law(probs: np.ndarray, drafter: np.ndarray) -> dict[tuple, float]:
    """Law of the committed tokens of one coupled verify round whose K drafts are Gumbel draws
    of drafter[j] under the target's noise at each position: stop at the first j where the
    target's draw x_j differs from y_j (P(x_j = i, y_j != i) = p_j(i) - P(x_j = y_j = i)), or
    commit the bonus after K agreements. Positions' noise is independent."""
    k = len(drafter)
    both = [joint_agreement(probs[j], drafter[j]) for j in range(k)]
    law: dict[tuple, float] = {}
    stack: list[tuple[tuple, float]] = [((), 1.0)]
    while stack:
        prefix, reach = stack.pop()
        j = len(prefix)
        if j == k:
            for token in np.flatnonzero(probs[k] > 0):
                law[prefix + (int(token),)] = reach * probs[k, token]
            continue
        for token in np.flatnonzero(probs[j] > 0):
            stop = probs[j, token] - both[j][token]
            if stop > 0:
                law[prefix + (int(token),)] = reach * stop
            if both[j][token] > 0:
                stack.append((prefix + (int(token),), reach * both[j][token]))
    return law


def plain_marginal_gap(law: dict[tuple, float], probs: np.ndarray) -> float:
    """Largest gap between the law's j-th committed token, given a round reaches slot j, and
    plain sampling's p_j: zero when the round commits what sequential sampling draws."""
    gap = 0.0
    for j in range(len(probs)):
        marginal = np.zeros(probs.shape[1])
        for seq, mass in law.items():
            if len(seq) > j:
                marginal[seq[j]] += mass
        gap = max(gap, float(np.abs(marginal / marginal.sum() - probs[j]).max()))
    return gap


def gumbel_multi_targets(cfg: LocalProofConfig) -> tuple[np.ndarray, np.ndarray]:
    """The multi-position check's K+1 targets [K+1, V] and K drafters' q [K, V]."""
    rng = np.random.default_rng([cfg.seed, 7])
    logits = rng.normal(scale=1.5, size=(GUMBEL_K + 1, cfg.vocab))
    noisy = logits[:GUMBEL_K] + rng.normal(scale=0.5, size=(GUMBEL_K, cfg.vocab))
    return target_probs(logits, 0.9, 0.95, 0), target_probs(noisy, 0.9, 0.95, 0)


def gumbel_multi_results(probs: np.ndarray, drafter: np.ndarray, bank: np.ndarray):
    """The doctored result vectors [n, K+1] of the trials in `bank`: each drafts y_j from
    drafter[j] and the target draws x_j from probs[j], under the noise of position t + j."""
    k = len(drafter)
    draws = np.stack([gumbel_argmax(probs[j], bank[j]) for j in range(k + 1)], axis=1)
    drafts = np.stack([gumbel_argmax(drafter[j], bank[j]) for j in range(k)], axis=1)
    return verify_coupled(draws, drafts)


def gumbel_multi_position_check(cfg: LocalProofConfig, results: np.ndarray, alpha: float):
    """K = GUMBEL_K coupled drafts from non-point-mass drafters over K+1 different targets:
    the committed sequences of `results` against the enumerated law."""
    probs, drafter = gumbel_multi_targets(cfg)
    law = coupled_prefix_law(probs, drafter)
    keys = sorted(law)
    hist = sequence_histogram(results)
    outside = sum(c for key, c in hist.items() if key not in law)
    counts = np.append([hist.get(key, 0) for key in keys], outside).astype(np.float64)
    target = np.append([law[key] for key in keys], 0.0)
    p_value = chi_square_p_value(counts, target)
    gap = plain_marginal_gap(law, probs)
    return {
        "k": GUMBEL_K,
        "sequences": len(keys),
        "law_mass": float(target.sum()),
        "plain_marginal_max_abs_diff": gap,
        "mean_committed": float((results >= 0).sum(axis=1).mean()),
        "tv": total_variation(counts, target),
        "p_value": p_value,
        "impossible_sequences": outside,
        "pass": bool(p_value > alpha and gap < 1e-12 and abs(target.sum() - 1) < 1e-12),
    }


def gumbel_coupling_check(cfg: LocalProofConfig) -> dict:
    """GumbelSampler.accept against GumbelSampler.sample on random trials whose drafts are
    Gumbel draws of a neighbouring q under the same noise: the committed tokens must be the
    plain draws, as many as the drafts that equal them plus one, every time."""
    rng = np.random.default_rng([cfg.seed, 8])
    mismatches = accepted = 0
    for i in range(cfg.gumbel_sampler_trials):
        temp, top_p, top_k = COUPLING_PARAMS[i % len(COUPLING_PARAMS)]
        k = 1 + i % 4
        logits = rng.normal(scale=2.0, size=(k + 1, cfg.vocab))
        seed = int(rng.integers(0, 2**63))
        sampler = GumbelSampler(temp=temp, top_p=top_p, top_k=top_k, seed=seed)
        start = int(rng.integers(0, 2**40))
        plain = [sampler.sample(logits[j], start + j) for j in range(k + 1)]
        draft_logits = logits[:k] + rng.normal(scale=0.7, size=(k, cfg.vocab))
        if temp <= 0:
            drafts = [int(np.argmax(row)) for row in draft_logits]
        else:
            q = target_probs(draft_logits, temp, top_p, top_k)  # as `coupled_draft` drafts
            drafts = [gumbel_draw(q[j], seed, start + j) for j in range(k)]
        agreeing = next((j for j in range(k) if drafts[j] != plain[j]), k)
        committed = committed_tokens(drafts, sampler.accept(logits, drafts, start))
        mismatches += committed != plain[: agreeing + 1]
        accepted += agreeing
    return {
        "trials": cfg.gumbel_sampler_trials,
        "mismatches": int(mismatches),
        "drafts_accepted": int(accepted),
    }


# ---------------------------------------------------------------------------------------------


def reference_grid_seconds(cfg: LocalProofConfig, cases_per_config: int, repeats: int = 2):
    """The yardstick of the proof's time: a plain numpy grid of the same size in one form. For
    each config, `cases_per_config` cases of cfg.draws tokens drawn from the target by numpy's
    own `Generator.choice`, their histogram, TV and chi-square; the best of `repeats` runs."""
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        rng = np.random.default_rng([cfg.seed, 9])
        for _params, _logits, probs in case_targets(cfg):
            for _case in range(cases_per_config):
                tokens = rng.choice(cfg.vocab, size=cfg.draws, p=probs)
                counts = np.bincount(tokens, minlength=cfg.vocab).astype(np.float64)
                total_variation(counts, probs)
                chi_square_p_value(counts, probs)
        best = min(best, time.perf_counter() - started)
    return best


def mutant_summary(name: str, rows: list[dict]) -> dict:
    """What a mutant's rows say: its worst TV, how many cases failed, whether it was caught."""
    return {
        "name": name,
        "worst_tv": max(r["tv"] for r in rows),
        "cases_failed": sum(not r["pass"] for r in rows),
        "caught": any(not r["pass"] for r in rows),
    }


def run_local_proof(cfg: LocalProofConfig, progress: Progress = lambda _: None) -> dict:
    """Run proof 1; return the result document (`proof_1_local_math` and the details)."""
    started = time.perf_counter()
    point_cases = run_cases(cfg, FORMS, progress)
    gumbel_rows, gumbel_multi_results = run_gumbel(cfg, GUMBEL_FORMS | GUMBEL_MUTANTS, progress)
    gumbel_cases = [row for row in gumbel_rows if row["form"] in GUMBEL_FORMS]
    cases = point_cases + gumbel_cases
    corrected = judge(cases, cfg.gate_tv, cfg.alpha)
    judge_agreement(gumbel_cases, corrected)
    mutants = []
    for name, rule in MUTANTS.items():
        rows = run_cases(cfg, {name: rule}, progress)
        judge(rows, cfg.gate_tv, corrected * len(rows))  # the same per-test alpha
        mutants.append(mutant_summary(name, rows))
    for name in GUMBEL_MUTANTS:
        rows = [row for row in gumbel_rows if row["form"] == name]
        judge(rows, cfg.gate_tv, corrected * len(rows))
        judge_agreement(rows, corrected)
        mutants.append(mutant_summary(name, rows))
    multi = multi_position_check(cfg, corrected)
    progress(1)
    gumbel_multi = gumbel_multi_position_check(cfg, gumbel_multi_results, corrected)
    progress(1)
    greedy = greedy_check(cfg)
    progress(1)
    coupling = coupling_check(cfg)
    progress(1)
    gumbel_coupling = gumbel_coupling_check(cfg)
    progress(1)
    seconds = time.perf_counter() - started
    reference = reference_grid_seconds(cfg, len(cases) // len(cfg.configs))
    progress(1)
    tree_started = time.perf_counter()
    tree_part = tree_cases.run_tree_proof(
        cfg.n_tree_draws, cfg.seed, cfg.gate_tv, cfg.alpha, cfg.tree_exact_trials, progress
    )
    tree_seconds = time.perf_counter() - tree_started
    worst_tv = max(row["tv"] for row in cases)
    passed = (
        all(row["pass"] for row in cases)
        and all(m["caught"] for m in mutants)
        and multi["pass"]
        and gumbel_multi["pass"]
        and greedy["mismatches"] == 0
        and coupling["mismatches"] == 0
        and gumbel_coupling["mismatches"] == 0
        and tree_part["pass"]
    )
    return {
        "proof_1_local_math": {
            "draws_per_case": cfg.draws,
            "vocab": cfg.vocab,
            "configs_tested": cfg.n_cases,
            "worst_tv_committed_vs_target": worst_tv,
            "gate": cfg.gate_tv,
            "greedy_temp0_bit_identical_to_argmax": greedy["mismatches"] == 0,
            "verdict": "PASS" if passed else "FAIL",
        },
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
        "chi_square_alpha_per_test": corrected,
        "worst_p_value": min(row["p_value"] for row in cases),
        "cases": cases,
        "mutants": mutants,
        "multi_position": multi,
        "greedy": greedy,
        "exact_coupling": {"trials": coupling["trials"], "mismatches": coupling["mismatches"]},
        "exact_coupling_detail": coupling,
        "gumbel": {
            "cases": len(gumbel_cases),
            "worst_tv": max(row["tv"] for row in gumbel_cases),
            "agreement_failed": sum(not row["agreement_ok"] for row in gumbel_cases),
            "multi_position": gumbel_multi,
            "exact_coupling": gumbel_coupling,
        },
        "trees": tree_part,
        "timing": {
            "seconds": seconds,
            "reference_grid_cases": len(cases),
            "reference_grid_seconds": reference,
            "ratio": seconds / reference,
            "tree_seconds": tree_seconds,  # apart from `seconds`, which the ratio is of
        },
    }
