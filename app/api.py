"""The JSON API under /api/v1: jobs, nodes and run records, behind bearer tokens.

The API acts as the token's owner: jobs are theirs to list, read and cancel (an admin's token:
everyone's); another user's job answers 404. Errors are JSON objects with an `error` reason
(and `fields` for bad job fields); a refused submission is 429 with `Retry-After`.
"""

from __future__ import annotations

from flask import Blueprint, g, jsonify, request, url_for

from app.auth import current_user, user_from_token
from app.db import get_session
from app.errors import json_error
from app.history import job_page
from app.jobs import job_state
from app.openapi import document as api_document
from app.submitting import submitter
from models.db import utcnow
from models.jobs import Job
from models.nodes import ring_nodes
from models.records import run_record
from workers.job_request import FIELDS, JobRequestError
from workers.submission import QueueUnavailable, TooManyActiveJobs

bp = Blueprint("api", __name__, url_prefix="/api/v1")
MAX_PER_PAGE = 100


@bp.before_request
def require_token():
    """Every API call needs `Authorization: Bearer <token>` with an active token; the API's
    own description does not."""
    if request.endpoint == "api.openapi_document":
        return None
    user = user_from_token()
    if user is None:
        response = json_error(401, "a valid API token is required (Authorization: Bearer ...)")
        response.headers["WWW-Authenticate"] = 'Bearer realm="specpipe"'
        return response
    g.user = user
    return None


def _job_or_404(job_id: int):
    job = get_session().get(Job, job_id)
    if job is None or not current_user().can_see(job.user_id):
        return None, json_error(404, f"no job {job_id}")
    return job, None


@bp.post("/jobs")
def create_job():
    """Create and enqueue a job from a JSON object of the job fields."""
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        return json_error(400, "the body must be a JSON object (Content-Type: application/json)")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        return json_error(400, f"unknown fields: {', '.join(unknown)}", allowed=list(FIELDS))
    try:
        params = submitter().check(body)
    except JobRequestError as exc:
        return json_error(400, "invalid job", fields=exc.errors)
    try:
        job = submitter().submit(get_session(), params, current_user())
    except TooManyActiveJobs as exc:
        response = json_error(429, str(exc), retry_after=exc.retry_after_s)
        response.headers["Retry-After"] = str(exc.retry_after_s)
        return response
    except QueueUnavailable as exc:
        return json_error(503, str(exc), job=exc.job.to_dict())
    response = jsonify(job.to_dict())
    response.status_code = 201
    response.headers["Location"] = url_for("api.get_job", job_id=job.id)
    return response


@bp.get("/jobs")
def list_jobs():
    """Jobs newest first; `status`, `q`, `sort`, `page` and `per_page` filter and page."""
    page = request.args.get("page", "1")
    per_page = request.args.get("per_page", "25")
    if not (page.isdigit() and per_page.isdigit()):
        return json_error(400, "page and per_page must be positive whole numbers")
    user = current_user()
    try:
        result = job_page(
            get_session(),
            owner_id=None if user.is_admin else user.id,
            status=request.args.get("status") or None,
            search=request.args.get("q"),
            sort=request.args.get("sort", "newest"),
            page=int(page),
            per_page=min(int(per_page), MAX_PER_PAGE),
        )
    except ValueError as exc:
        return json_error(400, str(exc))
    return jsonify(
        {
            "jobs": [job.to_dict() for job in result.items],
            "page": result.page,
            "per_page": result.per_page,
            "pages": result.pages,
            "total": result.total,
        }
    )


@bp.get("/jobs/<id:job_id>")
def get_job(job_id: int):
    """One job with its progress and output."""
    job, error = _job_or_404(job_id)
    return error or jsonify(job_state(job))


@bp.post("/jobs/<id:job_id>/cancel")
def cancel_job(job_id: int):
    """Request a cooperative cancel; 409 when the job has already finished."""
    job, error = _job_or_404(job_id)
    if error:
        return error
    if not job.request_cancel():
        return json_error(409, f"job {job_id} has already finished ({job.status})")
    get_session().commit()
    return jsonify(job.to_dict())


@bp.get("/nodes")
def list_nodes():
    """The node inventory in ring order, with heartbeat status."""
    now = utcnow()
    return jsonify({"nodes": [n.to_dict(now) for n in ring_nodes(get_session())]})


@bp.get("/openapi.json")
def openapi_document():
    """The OpenAPI document of this API."""
    return jsonify(api_document(submitter().limits))


@bp.get("/runs/<id:run_id>")
def get_run(run_id: int):
    """A run record (docs/architecture.md, "The store")."""
    try:
        return jsonify(run_record(get_session(), run_id))
    except LookupError:
        return json_error(404, f"no run {run_id}")
