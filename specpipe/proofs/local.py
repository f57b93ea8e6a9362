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
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from specpipe.proofs.stats import chi_square_p_value, total_variation
from specpipe.sampling import (
    Sampler,
    committed_tokens,
    draw,
    residual_probs,
    target_probs,
    uniforms,
    verify_coupled,
    verify_residual,
)

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

    @property
    def configs(self) -> list[tuple[float, float, int]]:
        return list(itertools.product(self.temps, self.top_ps, self.top_ks))

    @property
    def n_cases(self) -> int:
        return len(self.configs) * len(self.drafts)

    def work_units(self) -> int:
        """How many progress units a run reports: one per case and form, plus the checks."""
        return self.n_cases * (2 + len(MUTANTS)) + 3


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
    """The committed first token of n coupled verifies of one draft (the bonus row = target)."""
    rows = np.stack([probs, probs])
    return verify_coupled(draw(rows, rng.random((n, 2))), np.array([draft]))[:, 0]


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


def run_cases(cfg: LocalProofConfig, rules: dict, progress: Progress) -> list[dict]:
    """Every (config, draft) case under every rule; one row per case and rule."""
    rows = []
    case_rng = np.random.default_rng([cfg.seed, 1])
    for temp, top_p, top_k in cfg.configs:
        logits = case_rng.normal(scale=2.0, size=cfg.vocab)
        probs = target_probs(logits, temp, top_p, top_k)
        for kind in cfg.drafts:
            draft = choose_draft(probs, logits, kind)
            for name, rule in rules.items():
                rng = np.random.Generator(np.random.Philox(key=[cfg.seed, len(rows)]))
                committed = rule(probs, draft, rng, cfg.draws)
                counts = np.bincount(committed, minlength=cfg.vocab).astype(np.float64)
                rows.append(
                    {
                        "form": name,
                        "temp": temp,
                        "top_p": top_p,
                        "top_k": top_k,
                        "draft": kind,
                        "draft_id": draft,
                        "p_draft": float(probs[draft]),
                        "tv": total_variation(counts, probs),
                        "p_value": chi_square_p_value(counts, probs),
                    }
                )
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


def _target_draws(logits: np.ndarray, params: tuple, seeds: np.ndarray, positions: np.ndarray):
    """The target's own draw for each row of logits `[..., V]` at its (seed, position)."""
    temp, top_p, top_k = params
    if temp <= 0:
        return np.argmax(logits, axis=-1)
    flat = logits.reshape(-1, logits.shape[-1])
    probs = target_probs(flat, temp, top_p, top_k).reshape(logits.shape)
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

        params = (temp, top_p, top_k)
        plain = np.stack(
            [_target_draws(logits[:, j], params, seeds, starts + j) for j in range(k + 1)], axis=1
        )
        right = rng.integers(0, k + 1, size=n)  # leading drafts that match the plain draw
        slots = np.arange(k)
        drafts = np.where(slots < right[:, None], plain[:, :k], (plain[:, :k] + 1) % vocab)
        positions = starts[:, None] + np.arange(k + 1)
        result = verify_coupled(_target_draws(logits, params, seeds[:, None], positions), drafts)
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


def run_local_proof(cfg: LocalProofConfig, progress: Progress = lambda _: None) -> dict:
    """Run proof 1; return the result document (`proof_1_local_math` and the details)."""
    cases = run_cases(cfg, FORMS, progress)
    corrected = judge(cases, cfg.gate_tv, cfg.alpha)
    mutants = []
    for name, rule in MUTANTS.items():
        rows = run_cases(cfg, {name: rule}, progress)
        judge(rows, cfg.gate_tv, cfg.alpha / (len(cases) / len(rows)))  # same per-test alpha
        mutants.append(
            {
                "name": name,
                "worst_tv": max(r["tv"] for r in rows),
                "cases_failed": sum(not r["pass"] for r in rows),
                "caught": any(not r["pass"] for r in rows),
            }
        )
    multi = multi_position_check(cfg, corrected)
    progress(1)
    greedy = greedy_check(cfg)
    progress(1)
    coupling = coupling_check(cfg)
    progress(1)
    worst_tv = max(row["tv"] for row in cases)
    passed = (
        all(row["pass"] for row in cases)
        and all(m["caught"] for m in mutants)
        and multi["pass"]
        and greedy["mismatches"] == 0
        and coupling["mismatches"] == 0
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
    }
