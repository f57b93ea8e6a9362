"""Typed views of the proofs' result documents, and the readable reports made from them.

The runners return plain JSON documents (written by `--json`, stored with the run); each
`*Summary.from_result` reads the part of one document that the report and the verdict need.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

Document = Mapping[str, Any]


def _rows(rows: list[tuple[str, str]]) -> list[str]:
    """Name/value rows, the names left-aligned to the longest."""
    width = max(len(name) for name, _ in rows)
    return [f"  {name:<{width}}  {value}" for name, value in rows]


# ---------------------------------------------------------------------------------------------
# Proof 1: the local math


@dataclass(frozen=True)
class Mutant:
    """One lossy mutant of the verify rule, which the proof must catch."""

    name: str
    worst_tv: float
    caught: bool


@dataclass(frozen=True)
class GumbelSummary:
    """Proof 1's Gumbel-max form: drafts from a drafter's own q under the target's noise."""

    cases: int  # configs × drafters
    drafters: int
    worst_tv: float
    agreement_failed: int  # cases whose P(draft == commit) left [floor, ceiling] or Gumbel's rate
    lowest_agreement: float
    multi_k: int
    multi_tv: float
    multi_p_value: float
    multi_marginal_diff: float  # the enumerated law's marginals against plain sampling
    multi_passed: bool
    coupling_trials: int
    coupling_mismatches: int

    @classmethod
    def from_result(cls, doc: Document) -> GumbelSummary:
        """The view of a `run_local_proof` document's Gumbel parts."""
        gumbel, multi = doc["gumbel"], doc["gumbel"]["multi_position"]
        rows = [case for case in doc["cases"] if case["form"] == "gumbel"]
        return cls(
            cases=gumbel["cases"],
            drafters=len({row["draft"] for row in rows}),
            worst_tv=gumbel["worst_tv"],
            agreement_failed=gumbel["agreement_failed"],
            lowest_agreement=min(row["agreement"] for row in rows),
            multi_k=multi["k"],
            multi_tv=multi["tv"],
            multi_p_value=multi["p_value"],
            multi_marginal_diff=multi["plain_marginal_max_abs_diff"],
            multi_passed=bool(multi["pass"]),
            coupling_trials=gumbel["exact_coupling"]["trials"],
            coupling_mismatches=gumbel["exact_coupling"]["mismatches"],
        )


@dataclass(frozen=True)
class TreeSummary:
    """Proof 1's tree cases: draft trees verified by walking them (`specpipe.proofs.tree_cases`)."""

    cases: int  # configs × tree shapes
    cases_failed: int
    draws_per_case: int
    vocab: int
    worst_tv: float
    worst_tv_over_floor: float  # the gate is on a case's TV above its sampling floor
    gate: float
    worst_p_value: float
    alpha_per_test: float
    accepted_range: tuple[float, float]  # the cases' mean accepted drafts, lowest and highest
    mutants: tuple[Mutant, ...]
    mutant_cases_failed: tuple[int, ...]  # per mutant, the cases it failed
    exact_trials: int
    tree_mismatches: int  # the trees drafted against the head's own ranking, seed by seed
    exact_mismatches: int  # accept_tree against plain sampling, seed by seed
    walk_mismatches: int  # accept_tree against the law check's vectorised walk
    chain_trials: int
    chain_mismatches: int  # a chain's accept_tree against accept
    seconds: float | None

    @classmethod
    def from_result(cls, doc: Document) -> TreeSummary:
        """The view of a `run_local_proof` document's "trees"."""
        trees, exact = doc["trees"], doc["trees"]["exact"]
        accepted = [case["mean_accepted"] for case in trees["cases"]]
        return cls(
            cases=len(trees["cases"]),
            cases_failed=sum(not case["pass"] for case in trees["cases"]),
            draws_per_case=trees["draws_per_case"],
            vocab=trees["vocab"],
            worst_tv=trees["worst_tv"],
            worst_tv_over_floor=trees["worst_tv_over_floor"],
            gate=trees["gate"],
            worst_p_value=trees["worst_p_value"],
            alpha_per_test=trees["alpha_per_test"],
            accepted_range=(min(accepted), max(accepted)),
            mutants=tuple(Mutant(m["name"], m["worst_tv"], m["caught"]) for m in trees["mutants"]),
            mutant_cases_failed=tuple(m["cases_failed"] for m in trees["mutants"]),
            exact_trials=exact["trials"],
            tree_mismatches=exact["tree_mismatches"],
            exact_mismatches=exact["mismatches"],
            walk_mismatches=exact["walk_mismatches"],
            chain_trials=exact["chain_trials"],
            chain_mismatches=exact["chain_mismatches"],
            seconds=doc.get("timing", {}).get("tree_seconds"),
        )


def tree_rows(t: TreeSummary) -> list[tuple[str, str]]:
    """The report's rows on the tree cases."""
    seconds = "" if t.seconds is None else f", {t.seconds:.1f} s"
    low, high = t.accepted_range
    rows = [
        (
            "tree cases",
            f"{t.cases} (config × shape), {t.draws_per_case:,} draws each, vocab {t.vocab}, "
            f"{low:.2f} to {high:.2f} drafts accepted a round{seconds}",
        ),
        (
            "tree worst TV",
            f"{t.worst_tv:.4f}, at most {t.worst_tv_over_floor:+.4f} over its floor "
            f"(gate +{t.gate}); worst p {t.worst_p_value:.3g} (alpha {t.alpha_per_test:.2g})",
        ),
        ("tree cases failing", str(t.cases_failed)),
    ]
    for m, failed in zip(t.mutants, t.mutant_cases_failed, strict=True):
        verdict = f"caught on {failed} of {t.cases} cases" if m.caught else "NOT CAUGHT"
        rows.append((f"tree mutant {m.name}", f"worst TV {m.worst_tv:.3f}, {verdict}"))
    rows.append(
        (
            "tree walk == plain",
            f"{t.exact_trials:,} seeds, {t.exact_mismatches} mismatches (trees vs the head's: "
            f"{t.tree_mismatches}; vs the law check's walk: {t.walk_mismatches}; "
            f"{t.chain_trials} chains vs accept: {t.chain_mismatches})",
        )
    )
    return rows


@dataclass(frozen=True)
class Timing:
    """The proof's time against a plain numpy grid of the same number of cases."""

    seconds: float
    reference_cases: int
    reference_seconds: float
    ratio: float


@dataclass(frozen=True)
class LocalProofSummary:
    """Proof 1 as its report reads it."""

    verdict: str
    configs_tested: int
    draws_per_case: int
    vocab: int
    worst_tv: float
    gate: float
    worst_p_value: float
    alpha_per_test: float
    cases: int  # configs × verify forms
    cases_failed: int
    multi_exact_diff: float
    multi_coupled_tv: float
    multi_residual_tv: float
    multi_passed: bool
    mutants: tuple[Mutant, ...]
    greedy_rows: int
    greedy_mismatches: int
    coupling_trials: int
    coupling_mismatches: int
    gumbel: GumbelSummary | None = None  # None in documents from before the Gumbel form
    timing: Timing | None = None
    trees: TreeSummary | None = None  # None in documents from before the tree cases

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"

    @property
    def forms(self) -> int:
        """The point-mass forms (coupled, residual) each config × draft case runs under."""
        point_cases = self.cases - (self.gumbel.cases if self.gumbel else 0)
        return point_cases // max(self.configs_tested, 1)

    @classmethod
    def from_result(cls, doc: Document) -> LocalProofSummary:
        """The view of a `run_local_proof` document."""
        head, multi = doc["proof_1_local_math"], doc["multi_position"]
        return cls(
            verdict=head["verdict"],
            configs_tested=head["configs_tested"],
            draws_per_case=head["draws_per_case"],
            vocab=head["vocab"],
            worst_tv=head["worst_tv_committed_vs_target"],
            gate=head["gate"],
            worst_p_value=doc["worst_p_value"],
            alpha_per_test=doc["chi_square_alpha_per_test"],
            cases=len(doc["cases"]),
            cases_failed=sum(not case["pass"] for case in doc["cases"]),
            multi_exact_diff=multi["exact_enumeration_max_abs_diff"],
            multi_coupled_tv=multi["coupled"]["tv"],
            multi_residual_tv=multi["residual"]["tv"],
            multi_passed=multi["pass"],
            mutants=tuple(Mutant(m["name"], m["worst_tv"], m["caught"]) for m in doc["mutants"]),
            greedy_rows=doc["greedy"]["rows"],
            greedy_mismatches=doc["greedy"]["mismatches"],
            coupling_trials=doc["exact_coupling"]["trials"],
            coupling_mismatches=doc["exact_coupling"]["mismatches"],
            gumbel=GumbelSummary.from_result(doc) if "gumbel" in doc else None,
            timing=(
                Timing(
                    seconds=doc["timing"]["seconds"],
                    reference_cases=doc["timing"]["reference_grid_cases"],
                    reference_seconds=doc["timing"]["reference_grid_seconds"],
                    ratio=doc["timing"]["ratio"],
                )
                if "timing" in doc
                else None
            ),
            trees=TreeSummary.from_result(doc) if "trees" in doc else None,
        )


def format_local_summary(summary: LocalProofSummary, elapsed: float) -> str:
    """A readable summary of proof 1."""
    s = summary
    rows = [
        (
            "cases",
            f"{s.configs_tested} × {s.forms} forms, {s.draws_per_case:,} draws each, "
            f"vocab {s.vocab}",
        ),
        ("worst TV vs target", f"{s.worst_tv:.4f} (gate {s.gate})"),
        ("worst chi-square p", f"{s.worst_p_value:.3g} (alpha {s.alpha_per_test:.2g} per test)"),
        ("cases failing", str(s.cases_failed)),
        (
            "K=3 joint law",
            f"exact diff {s.multi_exact_diff:.1e}, TV coupled {s.multi_coupled_tv:.4f}, "
            f"residual {s.multi_residual_tv:.4f}, {'ok' if s.multi_passed else 'FAILED'}",
        ),
    ]
    g = s.gumbel
    if g:
        rows += [
            (
                "gumbel form",
                f"{g.cases} cases ({g.drafters} drafters q), worst TV {g.worst_tv:.4f}, "
                f"agreement out of bounds {g.agreement_failed} (lowest {g.lowest_agreement:.3f})",
            ),
            (
                f"gumbel K={g.multi_k} joint law",
                f"p {g.multi_p_value:.3g}, TV {g.multi_tv:.4f}, marginals vs plain "
                f"{g.multi_marginal_diff:.1e}, {'ok' if g.multi_passed else 'FAILED'}",
            ),
        ]
    for m in s.mutants:
        verdict = "caught" if m.caught else "NOT CAUGHT"
        rows.append((f"mutant {m.name}", f"worst TV {m.worst_tv:.3f}, {verdict}"))
    rows.append(("greedy == argmax", f"{s.greedy_rows:,} rows, {s.greedy_mismatches} mismatches"))
    rows.append(
        ("verify == plain", f"{s.coupling_trials:,} trials, {s.coupling_mismatches} mismatches")
    )
    if g:
        rows.append(
            (
                "gumbel verify == plain",
                f"{g.coupling_trials:,} trials, {g.coupling_mismatches} mismatches",
            )
        )
    if s.trees:
        rows += tree_rows(s.trees)
    if s.timing:
        t = s.timing
        rows.append(
            (
                "time",
                f"{t.seconds:.1f} s, {t.ratio:.1f}× a plain numpy grid of {t.reference_cases} "
                f"cases ({t.reference_seconds:.2f} s)",
            )
        )
    lines = ["proof 1: the local math", *_rows(rows)]
    lines.append(f"verdict: {s.verdict} ({elapsed:.1f} s)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Proof 2: speculative against plain on the ring


@dataclass(frozen=True)
class SwarmStop:
    """One stop of proof 2; `passed` when its p-value is above the per-stop alpha."""

    stop: int  # from 0
    position: int
    entropy_bits: float
    tv_spec_vs_plain: float
    tv_plain_vs_plain: float
    p_value: float
    exact_identical: int
    exact_pairs: int
    passed: bool


@dataclass(frozen=True)
class SwarmProofSummary:
    """Proof 2 as its report reads it."""

    verdict: str
    temp: float
    top_p: float
    top_k: int
    draws_per_mode_per_stop: int
    stops: int
    high_entropy_stops: int  # with at least 1 bit
    max_entropy_bits: float
    mean_tv_spec_vs_plain: float
    mean_tv_plain_vs_plain: float  # the noise floor
    min_p_value: float
    alpha_per_stop: float
    mutant_mean_tv: float
    mutant_stops_flagged: int
    exact_identical: int
    exact_pairs: int
    reasons: tuple[str, ...]
    per_stop: tuple[SwarmStop, ...]
    # None in documents from before the draft head, which name neither (icdf and the n-gram).
    sampler: str | None = None
    drafter: str | None = None  # "ngram", or "head": the tail's draft head
    head_rounds: int = 0  # speculative draws the head drafted for
    head_draws: int = 0  # speculative draws in all
    head_acceptance: float = 0.0  # of the head's drafts, the share accepted
    draft_trees: bool = False  # the head's drafts were trees, not chains

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"

    @classmethod
    def from_result(cls, doc: Document) -> SwarmProofSummary:
        """The view of a `run_swarm_proof` document."""
        head, alpha = doc["proof_2_on_swarm"], doc["alpha_per_stop"]
        drafted = doc.get("head", {})
        return cls(
            verdict=head["verdict"],
            temp=head["temp"],
            top_p=head["top_p"],
            top_k=doc["top_k"],
            draws_per_mode_per_stop=head["draws_per_mode_per_stop"],
            stops=head["stops"],
            high_entropy_stops=head["high_entropy_stops_ge_1bit"],
            max_entropy_bits=head["max_entropy_bits"],
            mean_tv_spec_vs_plain=head["mean_tv_spec_vs_plain"],
            mean_tv_plain_vs_plain=head["mean_tv_noise_floor_plain_vs_plain"],
            min_p_value=doc["min_p_value"],
            alpha_per_stop=alpha,
            mutant_mean_tv=doc["mutant"]["mean_tv_vs_plain"],
            mutant_stops_flagged=doc["mutant"]["stops_flagged"],
            exact_identical=doc["exact_check"]["identical"],
            exact_pairs=doc["exact_check"]["pairs"],
            reasons=tuple(doc["reasons"]),
            per_stop=tuple(
                SwarmStop(
                    stop=r["stop"],
                    position=r["position"],
                    entropy_bits=r["entropy_bits"],
                    tv_spec_vs_plain=r["tv_spec_vs_plain"],
                    tv_plain_vs_plain=r["tv_plain_vs_plain"],
                    p_value=r["p_value"],
                    exact_identical=r["exact_identical"],
                    exact_pairs=r["exact_pairs"],
                    passed=r["p_value"] > alpha,
                )
                for r in doc["per_stop"]
            ),
            sampler=doc.get("sampler"),
            drafter=doc.get("drafter"),
            head_rounds=drafted.get("rounds", 0),
            head_draws=drafted.get("draws", 0),
            head_acceptance=drafted.get("acceptance", 0.0),
            draft_trees=doc.get("draft_trees", False),
        )


def format_swarm_summary(summary: SwarmProofSummary, where: str, elapsed: float) -> str:
    """The per-stop table and the summary of proof 2; `where` names the ring."""
    s = summary
    lines = [
        f"proof 2: speculative vs plain on the ring ({where})",
        f"  {'stop':>4}  {'pos':>5}  {'entropy':>8}  {'TV spec/plain':>13}  "
        f"{'TV plain/plain':>14}  {'p-value':>9}  {'same seed':>9}",
    ]
    for r in s.per_stop:
        lines.append(
            f"  {r.stop + 1:>4}  {r.position:>5}  {r.entropy_bits:>6.2f} b  "
            f"{r.tv_spec_vs_plain:>13.4f}  {r.tv_plain_vs_plain:>14.4f}  "
            f"{r.p_value:>9.3g}  {r.exact_identical:>4}/{r.exact_pairs:<4}"
        )
    rows = [("temp / top_p / top_k", f"{s.temp:g} / {s.top_p:g} / {s.top_k}")]
    if s.sampler is not None:
        drafts = "the tail's draft head" if s.drafter == "head" else "the n-gram drafter"
        if s.drafter == "head" and s.draft_trees:
            drafts += " (trees)"
        rows.append(("drawn with", f"sampler {s.sampler}, drafts from {drafts}"))
    rows += [
        ("draws per mode per stop", str(s.draws_per_mode_per_stop)),
        (
            "stops",
            f"{s.stops} ({s.high_entropy_stops} with >= 1 bit, max {s.max_entropy_bits:.2f} bits)",
        ),
        ("mean TV spec vs plain", f"{s.mean_tv_spec_vs_plain:.4f}"),
        ("mean TV plain vs plain", f"{s.mean_tv_plain_vs_plain:.4f} (noise floor)"),
        ("min p-value", f"{s.min_p_value:.3g} (alpha {s.alpha_per_stop:.2g} per stop)"),
        (
            "lossy mutant",
            f"TV {s.mutant_mean_tv:.4f}, flagged at {s.mutant_stops_flagged} stops",
        ),
        ("same-seed draws", f"{s.exact_identical}/{s.exact_pairs} identical"),
    ]
    if s.drafter == "head":
        rows.append(
            (
                "head drafted",
                f"{s.head_rounds}/{s.head_draws} draws, {s.head_acceptance:.1%} of its drafts "
                "accepted"
                if s.head_rounds
                else f"0/{s.head_draws} draws: the tail sent no head drafts, the n-gram's stood in",
            )
        )
    lines += _rows(rows)
    lines += [f"  reason: {reason}" for reason in s.reasons]
    lines.append(f"verdict: {s.verdict} ({elapsed:.1f} s)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Proof 3: generations side by side


@dataclass(frozen=True)
class GenerationMode:
    """One mode of proof 3 (greedy, or sampled with one seed): speculative against plain."""

    name: str
    text: str
    plain_text: str
    tok_s: float
    plain_tok_s: float
    speedup: float | None  # None when the plain run took no measurable time
    identical: bool


@dataclass(frozen=True)
class GenerationProofSummary:
    """Proof 3 as its report reads it."""

    verdict: str
    modes: tuple[GenerationMode, ...]

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"

    @classmethod
    def from_result(cls, doc: Document) -> GenerationProofSummary:
        """The view of a `run_generation_proof` document: one entry per mode, and the verdict."""
        modes = tuple(
            GenerationMode(
                name=name,
                text=mode["text"],
                plain_text=mode["plain"]["text"],
                tok_s=mode["tok_s"],
                plain_tok_s=mode["plain_tok_s"],
                speedup=mode["speedup"],
                identical=mode["identical"],
            )
            for name, mode in doc.items()
            if isinstance(mode, Mapping)
        )
        return cls(verdict=doc["verdict"], modes=modes)


def format_generation(summary: GenerationProofSummary, where: str) -> str:
    """Each mode's speculative text with both tok/s, and the plain text when it differs."""
    lines = [f"proof 3: generation, speculative vs plain ({where})"]
    for m in summary.modes:
        speedup = f"{m.speedup:.2f}×" if m.speedup else "—"
        same = "identical" if m.identical else "DIFFERENT"
        lines.append(
            f"\n[{m.name}] speculative {m.tok_s:.1f} tok/s, plain {m.plain_tok_s:.1f} "
            f"tok/s ({speedup}), texts {same}"
        )
        lines.append(f"  speculative: {m.text!r}")
        if not m.identical:
            lines.append(f"  plain:       {m.plain_text!r}")
    lines.append(f"\nverdict: {summary.verdict}")
    return "\n".join(lines)
