"""Saving proof results (the documents `specpipe.proofs` returns) as a run with its proofs.

The run record's sections are kept exactly as the proofs wrote them; the cases behind the
plots are unpacked into rows: one per (config, draft, form) for the local math, one per stop,
with its spec and plain histograms, for the swarm.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from models.db import utcnow
from models.runs import Proof, ProofCase, Run, start_run

# The bulky per-run token lists stay out of the stored generation summary.
_GENERATION_DETAIL = ("spec", "plain")


def _verdict(text: str | None) -> str:
    return {"pass": "pass", "fail": "fail"}.get((text or "").lower(), "error")


def _local_proof(result: dict, trigger: str) -> Proof:
    head = result["proof_1_local_math"]
    proof = Proof(
        kind="local_math",
        trigger=trigger,
        verdict=_verdict(head.get("verdict")),
        gate=head.get("gate"),
        summary=dict(head),
    )
    for i, row in enumerate(result.get("cases", [])):
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
                draws=head.get("draws_per_case"),
                tv=row["tv"],
                passed=bool(row.get("pass", row["tv"] <= (head.get("gate") or 1.0))),
            )
        )
    return proof


def _swarm_proof(result: dict, trigger: str) -> Proof:
    head = result["proof_2_on_swarm"]
    alpha = result.get("alpha_per_stop")
    proof = Proof(
        kind="on_swarm",
        trigger=trigger,
        verdict=_verdict(head.get("verdict")),
        noise_floor=head.get("mean_tv_noise_floor_plain_vs_plain"),
        summary=dict(head),
    )
    for row in result.get("per_stop", []):
        passed = row["p_value"] > alpha if alpha is not None else True
        proof.cases.append(
            ProofCase(
                position=row["stop"],
                label=f"stop {row['stop'] + 1} @ {row['position']}",
                temp=head.get("temp"),
                top_p=head.get("top_p"),
                top_k=result.get("top_k"),
                draws=head.get("draws_per_mode_per_stop"),
                entropy_bits=row.get("entropy_bits"),
                tv=row["tv_spec_vs_plain"],
                noise_tv=row.get("tv_plain_vs_plain"),
                passed=bool(passed),
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
    **run_fields,
) -> Run:
    """Store the given proof results as one run (with a ring snapshot); the caller commits.

    `run_fields` are Run columns: model, quant, shard_commit, claim, method, topology.
    """
    trigger = "nightly" if nightly else "manual"
    run = start_run(session, kind="nightly" if nightly else "proof", **run_fields)
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
                verdict=_verdict(summary.get("verdict")),
                summary=summary,
            )
        )
    verdicts = [p.verdict for p in run.proofs]
    run.verdict = (
        "pass"
        if verdicts and all(v == "pass" for v in verdicts)
        else ("fail" if "fail" in verdicts else "error")
    )
    run.finished_at = utcnow()
    session.flush()
    return run
