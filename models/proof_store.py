"""Saving proof results (the documents `specpipe.proofs` returns) as a run with its proofs.

The run record's sections are kept exactly as the proofs wrote them; the cases behind the
plots are unpacked into rows: one per (config, draft, form) for the local math, one per stop,
with its spec and plain histograms, for the swarm. Verdicts are read through the proofs' typed
views (`specpipe.proofs.report`).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.db import utcnow
from models.runs import Proof, ProofCase, Run, start_run
from specpipe.proofs.report import GenerationProofSummary, LocalProofSummary, SwarmProofSummary

# The bulky per-run token lists stay out of the stored generation summary.
_GENERATION_DETAIL = ("spec", "plain")


def _verdict(passed: bool) -> str:
    return "pass" if passed else "fail"


def run_verdict(proof_verdicts: list[str]) -> str:
    """A run's verdict from its proofs': pass when all pass, fail when one fails, else error."""
    if proof_verdicts and all(v == "pass" for v in proof_verdicts):
        return "pass"
    return "fail" if "fail" in proof_verdicts else "error"


def _local_proof(result: dict, trigger: str) -> Proof:
    head = result["proof_1_local_math"]
    view = LocalProofSummary.from_result(result)
    proof = Proof(
        kind="local_math",
        trigger=trigger,
        verdict=_verdict(view.passed),
        gate=view.gate,
        summary=dict(head),
    )
    for i, row in enumerate(result["cases"]):
        proof.cases.append(
            ProofCase(
                position=i,
                label=(
                    f"{row.get('form', '')} T={row['temp']:g} p={row['top_p']:g} "
                    f"k={row['top_k']} draft={row.get('draft', '')}"
                ).strip(),
                temp=row["temp"],
                top_p=row["top_p"],
                top_k=row["top_k"],
                draws=view.draws_per_case,
                tv=row["tv"],
                passed=bool(row["pass"]),
            )
        )
    return proof


def _swarm_proof(result: dict, trigger: str) -> Proof:
    view = SwarmProofSummary.from_result(result)
    proof = Proof(
        kind="on_swarm",
        trigger=trigger,
        verdict=_verdict(view.passed),
        noise_floor=view.mean_tv_plain_vs_plain,
        summary={
            **result["proof_2_on_swarm"],
            # Why it passed or failed, for the proof's page.
            "reasons": result["reasons"],
            "exact_check": result["exact_check"],
            "mutant_flagged": result["mutant"]["flagged"],
            "sampler": result["sampler"],
            "drafter": result["drafter"],
            "draft_trees": result.get("draft_trees", False),
            **({"head": result["head"]} if "head" in result else {}),
        },
    )
    for stop, row in zip(view.per_stop, result["per_stop"], strict=True):
        proof.cases.append(
            ProofCase(
                position=stop.stop,
                label=f"stop {stop.stop + 1} @ {stop.position}",
                temp=view.temp,
                top_p=view.top_p,
                top_k=view.top_k,
                draws=view.draws_per_mode_per_stop,
                entropy_bits=stop.entropy_bits,
                tv=stop.tv_spec_vs_plain,
                noise_tv=stop.tv_plain_vs_plain,
                passed=stop.passed,
                spec_counts={str(k): v for k, v in row.get("spec_histogram", {}).items()},
                plain_counts={str(k): v for k, v in row.get("plain_histogram", {}).items()},
            )
        )
    return proof


def _generation_summary(result: dict) -> dict:
    return {
        name: (
            {k: v for k, v in mode.items() if k not in _GENERATION_DETAIL}
            if isinstance(mode, dict)
            else mode
        )
        for name, mode in result.items()
    }


def save_proof_run(
    session: Session,
    *,
    nightly: bool = False,
    local: dict | None = None,
    swarm: dict | None = None,
    generation: dict | None = None,
    ring_snapshot: bool = True,
    **run_fields,
) -> Run:
    """Store the given proof results as one run; the caller commits.

    With `ring_snapshot` the run records the stored inventory as the ring it ran on; proofs run
    in one process, on no ring, record none. `run_fields` are Run columns: model, quant,
    shard_commit, claim, method, topology.
    """
    trigger = "nightly" if nightly else "manual"
    kind = "nightly" if nightly else "proof"
    run = start_run(session, kind=kind, snapshot=ring_snapshot, **run_fields)
    if local is not None:
        run.proofs.append(_local_proof(local, trigger))
    if swarm is not None:
        run.proofs.append(_swarm_proof(swarm, trigger))
    if generation is not None:
        summary = _generation_summary(generation)
        run.generation_summary = summary
        run.proofs.append(
            Proof(
                kind="generation",
                trigger=trigger,
                verdict=_verdict(GenerationProofSummary.from_result(generation).passed),
                summary=summary,
            )
        )
    run.verdict = run_verdict([p.verdict for p in run.proofs])
    run.finished_at = utcnow()
    session.flush()
    return run


def night_outcome(session: Session, night: str) -> dict | None:
    """The stored nightly run that answers `night` (key, run_id, name, verdict, and `failed`:
    each proof that did not pass, by kind, with its verdict and the error it stored), None
    while there is none. This, not anything in Redis, is a night's verdict."""
    run = session.scalars(select(Run).where(Run.night == night, Run.kind == "nightly")).first()
    if run is None:
        return None
    failed = {
        p.kind: f"{p.verdict}: {(p.summary or {}).get('error', 'see the run')}"
        for p in run.proofs
        if p.verdict != "pass"
    }
    return {
        "key": night,
        "run_id": run.id,
        "name": run.name,
        "verdict": run.verdict,
        "failed": failed,
    }
