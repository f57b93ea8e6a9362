"""Runs and proofs: one record per generation or proof run, with its proofs and their cases.

A run is what a run record (docs/architecture.md) exports: the commit and model it ran, the
three proofs' summaries, and a snapshot of the ring it ran on. Proof cases keep the numbers
behind the plots: the TV distance per case, and for swarm proofs the spec and plain token
histograms per stop.
"""

from __future__ import annotations

import secrets
from datetime import datetime

from sqlalchemy import (
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
)
from sqlalchemy.orm import Mapped, Session, mapped_column, relationship

from models.db import Base, utcnow

RUN_KINDS = ("generation", "proof", "nightly")
PROOF_KINDS = ("local_math", "on_swarm", "generation")
VERDICTS = ("pass", "fail", "running", "error")


def new_run_name() -> str:
    """A readable unique run id: UTC time plus a random suffix."""
    return f"{utcnow():%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


class Run(Base):
    """One generation or proof run, exportable as a run record."""

    __tablename__ = "runs"
    __table_args__ = (
        CheckConstraint("kind IN ('generation', 'proof', 'nightly')", name="kind"),
        Index("ix_runs_kind_created_at", "kind", "created_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True, default=new_run_name)
    kind: Mapped[str] = mapped_column(String(16), default="generation")
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, index=True
    )
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    shard_commit: Mapped[str | None] = mapped_column(String(64))
    claim: Mapped[str | None] = mapped_column(Text)
    model: Mapped[str | None] = mapped_column(String(200))
    quant: Mapped[str | None] = mapped_column(String(64))
    method: Mapped[str | None] = mapped_column(Text)
    topology: Mapped[str | None] = mapped_column(Text)
    verdict: Mapped[str | None] = mapped_column(String(16))
    # The night a nightly run answers (`night-YYYY-MM-DD`, `manual-…`): its verdict is read
    # from here, so nothing that reaches only the broker can fake or silence it.
    night: Mapped[str | None] = mapped_column(String(64), unique=True)
    # proof_3_generation of the run record: {"greedy_temp0": {...}, "sampled_...": {...}}
    generation_summary: Mapped[dict | None] = mapped_column()

    jobs: Mapped[list[Job]] = relationship(back_populates="run")  # noqa: F821
    proofs: Mapped[list[Proof]] = relationship(
        back_populates="run", cascade="all, delete-orphan", order_by="Proof.id"
    )
    node_snapshots: Mapped[list[RunNode]] = relationship(  # noqa: F821
        back_populates="run", cascade="all, delete-orphan", order_by="RunNode.position"
    )

    def proof(self, kind: str) -> Proof | None:
        """This run's proof of one kind, if it has one."""
        return next((p for p in self.proofs if p.kind == kind), None)


class Proof(Base):
    """One proof inside a run: local sampling math or the on-swarm spec-vs-plain comparison."""

    __tablename__ = "proofs"
    __table_args__ = (
        CheckConstraint("kind IN ('local_math', 'on_swarm', 'generation')", name="kind"),
        CheckConstraint("verdict IN ('pass', 'fail', 'running', 'error')", name="verdict"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    trigger: Mapped[str] = mapped_column(String(16), default="manual")  # manual | nightly
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    verdict: Mapped[str] = mapped_column(String(16), default="running")
    gate: Mapped[float | None] = mapped_column(Float)  # the TV a case must stay under
    noise_floor: Mapped[float | None] = mapped_column(Float)  # mean plain-vs-plain TV
    # The run record's fields for this proof, e.g. draws_per_case, vocab, configs_tested.
    summary: Mapped[dict] = mapped_column(default=dict)

    run: Mapped[Run] = relationship(back_populates="proofs")
    cases: Mapped[list[ProofCase]] = relationship(
        back_populates="proof", cascade="all, delete-orphan", order_by="ProofCase.position"
    )


class ProofCase(Base):
    """One case of a proof: a sampling config (local math) or a stop in a prompt (swarm)."""

    __tablename__ = "proof_cases"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    proof_id: Mapped[int] = mapped_column(ForeignKey("proofs.id", ondelete="CASCADE"), index=True)
    position: Mapped[int] = mapped_column(Integer, default=0)
    label: Mapped[str] = mapped_column(String(200))
    temp: Mapped[float | None] = mapped_column(Float)
    top_p: Mapped[float | None] = mapped_column(Float)
    top_k: Mapped[int | None] = mapped_column(Integer)
    draws: Mapped[int | None] = mapped_column(Integer)
    entropy_bits: Mapped[float | None] = mapped_column(Float)
    tv: Mapped[float] = mapped_column(Float)  # committed vs target, or spec vs plain
    noise_tv: Mapped[float | None] = mapped_column(Float)  # plain vs plain at this stop
    passed: Mapped[bool] = mapped_column(Boolean)
    # token id (as text) -> count; only for swarm stops
    spec_counts: Mapped[dict | None] = mapped_column()
    plain_counts: Mapped[dict | None] = mapped_column()

    proof: Mapped[Proof] = relationship(back_populates="cases")


def start_run(session: Session, kind: str = "generation", snapshot: bool = True, **fields) -> Run:
    """A new run, with a snapshot of the current ring unless `snapshot` is False; the caller
    commits."""
    from models.nodes import snapshot_nodes

    run = Run(kind=kind, **fields)
    session.add(run)
    if snapshot:
        snapshot_nodes(session, run)
    session.flush()
    return run
