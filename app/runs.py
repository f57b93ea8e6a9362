"""Run record download, in the run record's JSON schema (docs/architecture.md)."""

from __future__ import annotations

import json

from flask import Blueprint, Response, abort

from app.db import get_session
from models.records import run_record

bp = Blueprint("runs", __name__, url_prefix="/runs")


@bp.get("/<id:run_id>/record.json")
def record(run_id: int):
    """The run record as a JSON file download."""
    try:
        data = run_record(get_session(), run_id)
    except LookupError:
        abort(404, f"There is no run {run_id}.")
    return Response(
        json.dumps(data, indent=2, ensure_ascii=False) + "\n",
        mimetype="application/json",
        headers={"Content-Disposition": f'attachment; filename="run-{run_id}.json"'},
    )
