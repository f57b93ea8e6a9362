"""Pages for jobs: the submit form, the history, and one job's live page.

A user sees, cancels and re-runs only their own jobs (an admin: everyone's); someone else's job
answers 404, like one that does not exist, so ids say nothing about other users.
"""

from __future__ import annotations

from dataclasses import asdict

import redis
from flask import (
    Blueprint,
    abort,
    current_app,
    flash,
    jsonify,
    redirect,
    render_template,
    request,
    url_for,
)

from app.auth import current_user
from app.db import get_session
from app.forms import bad_utf8_fields
from app.history import MAX_PAGE, SORTS, job_page
from app.nodes import quick_redis
from app.replies import job_reply
from app.submitting import submitter
from models.jobs import JOB_STATUSES, Job
from specpipe.core.sampling import MAX_SEED_TEXT, SAMPLERS
from specpipe.settings import JOB_DEFAULTS
from specpipe.swarm.kvbudget import waiting_for_room
from workers.job_request import FIELDS, JobRequestError, number_bounds
from workers.submission import QueueUnavailable, TooManyActiveJobs, rerun_params
from workers.turns import queue_place

bp = Blueprint("jobs", __name__)

# The form shows the submission defaults as text; a blank seed is drawn at random.
FORM_DEFAULTS = {
    "prompt": "",
    **{name: "" if value is None else str(value) for name, value in JOB_DEFAULTS.items()},
    "stop": "",
    "speculate": "on",
}


def _get_job(job_id: int) -> Job:
    job = get_session().get(Job, job_id)
    if job is None or not current_user().can_see(job.user_id):
        abort(404, f"There is no job {job_id}.")
    return job


def posted_values() -> dict[str, str]:
    """The job form's fields as they were sent."""
    values = {name: request.form.get(name, "") for name in FIELDS}
    values["speculate"] = "on" if request.form.get("speculate") else ""
    return values


def render_form(
    values: dict, errors: dict, status: int, refusal: str | None = None
) -> tuple[str, int]:
    """The job form with `values` typed in, `errors` by field and a `refusal` above it."""
    return render_template(
        "jobs/submit.html",
        values=values,
        errors=errors,
        refusal=refusal,
        limits=submitter().limits,
        bounds=number_bounds(submitter().limits),
        samplers=SAMPLERS,
        max_seed=MAX_SEED_TEXT,
    ), status


@bp.route("/", methods=("GET", "POST"))
def submit():
    """The job form: check every field, store and enqueue, then go to the job's page."""
    values = dict(FORM_DEFAULTS)
    errors: dict[str, str] = {}
    if request.method == "POST":
        values = posted_values()
        raw = {name: values[name] for name in FIELDS}
        if not values["speculate"]:
            raw["draft_k"] = "0"
        try:
            params = submitter().check(raw, from_text=True)
        except JobRequestError as exc:
            errors = dict(exc.errors)
        for name in bad_utf8_fields() & set(FIELDS):
            errors[name] = "is not valid UTF-8"
        if values["speculate"] and not errors and params["draft_k"] == 0:
            errors["draft_k"] = "must be at least 1 when speculation is on"
        if not errors:
            try:
                job = submitter().submit(get_session(), params, current_user())
            except TooManyActiveJobs as exc:
                page, status = render_form(values, {}, 429, str(exc))
                return page, status, {"Retry-After": str(exc.retry_after_s)}
            except QueueUnavailable as exc:
                flash(f"Job {exc.job.id} was saved but not queued: {exc}", "error")
                return redirect(url_for("jobs.detail", job_id=exc.job.id))
            return redirect(url_for("jobs.detail", job_id=job.id))
    return render_form(values, errors, 400 if errors else 200)


@bp.get("/history")
def history():
    """All jobs, newest first, 25 a page, with status filter, prompt search and sort."""
    status = request.args.get("status", "")
    search = request.args.get("q", "")
    sort = request.args.get("sort", "newest")
    page = request.args.get("page", 1, type=int) or 1
    if status not in JOB_STATUSES:
        status = ""
    if sort not in SORTS:
        sort = "newest"
    user = current_user()
    result = job_page(
        get_session(),
        owner_id=None if user.is_admin else user.id,
        status=status or None,
        search=search,
        sort=sort,
        page=min(max(page, 1), MAX_PAGE),
        per_page=current_app.config["HISTORY_PAGE_SIZE"],
    )
    return render_template(
        "jobs/history.html",
        result=result,
        status=status,
        search=search,
        sort=sort,
        statuses=JOB_STATUSES,
        sorts=list(SORTS),
    )


@bp.get("/jobs/<id:job_id>")
def detail(job_id: int):
    """One job: live progress, text, parameters, seed, ring, and actions."""
    job = _get_job(job_id)
    return render_template(
        "jobs/detail.html",
        job=job,
        reply=job_reply(job),
        queue=queue_place(get_session(), job),
        room=room_wait(job),
        ring=ring_panel(job),
    )


@bp.get("/jobs/<id:job_id>/progress")
def progress(job_id: int):
    """The job's state as JSON, polled by the job page, with its Ring panel (`ring`)."""
    job = _get_job(job_id)
    return jsonify({**job_state(job), "ring": ring_panel(job)})


def ring_panel(job: Job) -> dict:
    """What the job page's Ring panel shows, rendered by the page and by its polling alike:
    the stages of the ring the job's run ran on, in ring order (`stages`), where to download
    the run's record (`record_url`), and the line shown instead while there are none
    (`empty`)."""
    run = job.run
    snapshots = run.node_snapshots if run is not None else []
    if not snapshots:
        empty = "Did not run on a ring." if job.finished else "Not assigned to a ring yet."
        return {"stages": [], "record_url": None, "empty": empty}
    stages = [
        {"role": n.role or "?", "host": n.host, "layers": _layer_span(n), "geo": n.geo}
        for n in snapshots
    ]
    return {
        "stages": stages,
        "record_url": url_for("runs.record", run_id=run.id),
        "empty": None,
    }


def _layer_span(node) -> str:
    """A stage's layers as a closed range, first–last ('?' where unknown)."""
    first = "?" if node.layer_start is None else node.layer_start
    last = "?" if node.layer_end is None else node.layer_end - 1
    return f"{first}–{last}"


def job_state(job: Job) -> dict:
    """The job as the API returns it, with a chat on gpt-oss's reasoning and answer apart
    (`reply`), a queued job's place in line (`queue`) and why it waits for its stages' room
    (`waiting_for_room`)."""
    reply = job_reply(job)
    return {
        **job.to_dict(),
        "reply": None if reply is None else asdict(reply),
        "queue": queue_place(get_session(), job),
        "waiting_for_room": room_wait(job),
    }


def room_wait(job: Job) -> dict | None:
    """Why `job` waits for its stages' room, from the swarm's Redis (`waiting_for_room`);
    None when it does not wait, or when Redis does not answer."""
    try:
        client = quick_redis(current_app.config["REDIS_URL"])
    except ValueError:  # an unusable REDIS_URL: the app runs on, without the reason
        return None
    try:
        return waiting_for_room(client, current_app.config["SWARM"], job)
    except redis.RedisError:
        return None
    finally:
        client.close()


@bp.post("/jobs/<id:job_id>/cancel")
def cancel(job_id: int):
    """Ask the coordinator to stop the job at its next round."""
    job = _get_job(job_id)
    if job.request_cancel():
        get_session().commit()
        flash(f"Cancel requested for job {job.id}.", "info")
    else:
        flash(f"Job {job.id} has already finished ({job.status}).", "info")
    return redirect(url_for("jobs.detail", job_id=job.id))


@bp.post("/jobs/<id:job_id>/rerun")
def rerun(job_id: int):
    """A new job with the same prompt, parameters and seed: it reproduces the text."""
    job = _get_job(job_id)
    try:
        new = submitter().submit(get_session(), rerun_params(job), current_user())
    except TooManyActiveJobs as exc:
        page = render_template("error.html", code=429, message=str(exc))
        return page, 429, {"Retry-After": str(exc.retry_after_s)}
    except QueueUnavailable as exc:
        flash(f"Job {exc.job.id} was saved but not queued: {exc}", "error")
        return redirect(url_for("jobs.detail", job_id=exc.job.id))
    flash(f"Running job {job.id} again with seed {job.seed}.", "info")
    return redirect(url_for("jobs.detail", job_id=new.id))
