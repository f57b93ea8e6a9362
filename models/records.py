"""The run record: a run, its proofs and its ring in the record's JSON schema, field for field
(docs/architecture.md, "The store").

The web download, the API and `specpipe runs export` all call `run_record`, so the schema is
written once. Fields a run has not measured are null.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from models.db import iso_utc
from models.runs import Proof, Run

PROOF_1_FIELDS = (
    "draws_per_case",
    "vocab",
    "configs_tested",
    "worst_tv_committed_vs_target",
    "gate",
    "greedy_temp0_bit_identical_to_argmax",
    "verdict",
)
PROOF_2_FIELDS = (
    "temp",
    "top_p",
    "draws_per_mode_per_stop",
    "stops",
    "high_entropy_stops_ge_1bit",
    "max_entropy_bits",
    "mean_tv_spec_vs_plain",
    "mean_tv_noise_floor_plain_vs_plain",
    "verdict",
)
NODE_FIELDS = ("role", "layer_range", "public_ip", "geo", "gpu_uuid", "gpu_name")


def _proof_section(proof: Proof | None, fields: tuple[str, ...]) -> dict | None:
    if proof is None:
        return None
    summary = dict(proof.summary or {})
    summary.setdefault("verdict", proof.verdict)
    if "gate" in fields:
        summary.setdefault("gate", proof.gate)
    if "mean_tv_noise_floor_plain_vs_plain" in fields:
        summary.setdefault("mean_tv_noise_floor_plain_vs_plain", proof.noise_floor)
    return {name: summary.get(name) for name in fields}


def topology_of(run: Run) -> str | None:
    """The run's ring as text, e.g. `WA → MN → NC → NJ → back`; the stored one wins."""
    if run.topology:
        return run.topology
    if not run.node_snapshots:
        return None
    hops = [n.geo or n.host for n in run.node_snapshots]
    return " → ".join([*hops, "back"])


def record_of(run: Run) -> dict:
    """`run` as a run record (layer_range is [start, end) as stored in the inventory)."""
    return {
        "run_id": run.name,
        "utc": iso_utc(run.created_at),
        "shard_commit": run.shard_commit,
        "claim": run.claim,
        "model": run.model,
        "quant": run.quant,
        "method": run.method,
        "proof_1_local_math": _proof_section(run.proof("local_math"), PROOF_1_FIELDS),
        "proof_2_on_swarm": _proof_section(run.proof("on_swarm"), PROOF_2_FIELDS),
        "proof_3_generation": run.generation_summary,
        "nodes": [
            {
                "role": n.role,
                "layer_range": [n.layer_start, n.layer_end],
                "public_ip": n.public_ip,
                "geo": n.geo,
                "gpu_uuid": n.gpu_uuid,
                "gpu_name": n.gpu_name,
            }
            for n in run.node_snapshots
        ],
        "topology": topology_of(run),
    }


def run_record(session: Session, run_id: int) -> dict:
    """The run record of run `run_id`; LookupError when there is no such run."""
    run = session.get(Run, run_id)
    if run is None:
        raise LookupError(f"no run {run_id}")
    return record_of(run)
