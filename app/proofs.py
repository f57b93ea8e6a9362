"""Proof pages: proof runs with verdicts, one run's cases, and their plots."""

from __future__ import annotations

from flask import Blueprint, Response, abort, render_template
from sqlalchemy import select

from app.db import get_session
from app.plots import histogram_plot, plot_cache, tv_plot
from models.runs import Proof, ProofCase, Run

bp = Blueprint("proofs", __name__, url_prefix="/proofs")


def _png(data: bytes) -> Response:
    # Behind a login: browsers may keep it, shared caches may not.
    return Response(data, mimetype="image/png", headers={"Cache-Control": "private, max-age=300"})


@bp.get("/")
def index():
    """Every proof run, manual and nightly, newest first."""
    runs = (
        get_session()
        .scalars(
            select(Run).where(Run.kind.in_(("proof", "nightly"))).order_by(Run.created_at.desc())
        )
        .all()
    )
    return render_template("proofs/index.html", runs=runs)


@bp.get("/<id:run_id>")
def detail(run_id: int):
    """One proof run: each proof's verdict, case table and plots."""
    run = get_session().get(Run, run_id)
    if run is None or run.kind not in ("proof", "nightly"):
        abort(404, f"There is no proof run {run_id}.")
    return render_template("proofs/detail.html", run=run)


@bp.get("/plots/<id:proof_id>/tv.png")
def tv_png(proof_id: int):
    """TV per case against the gate."""
    key = ("tv", proof_id)
    cached = plot_cache().peek(key)
    if cached is not None:
        return _png(cached)
    proof = get_session().get(Proof, proof_id)
    if proof is None:
        abort(404, f"There is no proof {proof_id}.")
    return _png(plot_cache().get(key, lambda: tv_plot(proof)))


@bp.get("/plots/cases/<id:case_id>.png")
def case_png(case_id: int):
    """Spec vs plain histograms for one stop, with the noise floor."""
    key = ("case", case_id)
    cached = plot_cache().peek(key)
    if cached is not None:
        return _png(cached)
    case = get_session().get(ProofCase, case_id)
    if case is None or not (case.spec_counts or case.plain_counts):
        abort(404, f"There is no histogram for case {case_id}.")
    return _png(plot_cache().get(key, lambda: histogram_plot(case)))
