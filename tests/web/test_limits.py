"""Limits on submissions: a per-user rate shared by the form, re-runs and the API, counted in
the real Redis, and a cap on a user's queued and running jobs checked in the submission path.
Both answer 429 with Retry-After; the form re-renders with the reason. Also: proof plots are
drawn once and then served from the cache."""

from __future__ import annotations

import pytest
import redis
from sqlalchemy import func, select

from models.jobs import Job
from models.tokens import create_token
from models.users import builtin_admin
from specpipe.settings import JobLimits, redis_url
from tests.factories import gen_job, gen_proof_run, gen_user
from tests.web.conftest import Api, as_user, csrf_token
from workers.submission import Submitter, TooManyActiveJobs

FORM = {
    "prompt": "hello",
    "max_new_tokens": "8",
    "temp": "0",
    "top_p": "1",
    "top_k": "0",
    "seed": "",
    "draft_k": "2",
    "speculate": "on",
}


def jobs_stored(session) -> int:
    session.expire_all()
    return session.scalar(select(func.count()).select_from(Job))


@pytest.fixture
def alice(session):
    return gen_user(session, "alice")


def test_submission_rate_shared_by_form_and_api_in_redis(make_app, session, queue, alice):
    app = make_app(SUBMIT_RATE="3/minute")
    page = as_user(app.test_client(), alice)
    api = Api(app.test_client(), create_token(session, "alice-ci", alice))
    session.commit()
    assert api.post("/jobs", json={"prompt": "one"}).status_code == 201
    assert page.post("/", data={**FORM, "csrf_token": csrf_token(page)}).status_code == 302
    assert api.post("/jobs", json={"prompt": "three"}).status_code == 201

    refused = api.post("/jobs", json={"prompt": "four"})
    assert refused.status_code == 429
    body = refused.get_json()
    assert "too many requests" in body["error"] and 1 <= body["retry_after"] <= 60
    assert refused.headers["Retry-After"] == str(body["retry_after"])

    form = page.post("/", data={**FORM, "prompt": "typed by hand", "csrf_token": csrf_token(page)})
    assert form.status_code == 429 and 1 <= int(form.headers["Retry-After"]) <= 60
    html = form.get_data(as_text=True)
    assert 'id="refusal"' in html and "too many requests" in html
    assert "typed by hand" in html  # what was typed is kept

    rerun = page.post("/jobs/1/rerun", data={"csrf_token": csrf_token(page)})
    assert rerun.status_code == 429 and "Retry-After" in rerun.headers
    assert jobs_stored(session) == 3 and len(queue.job_ids()) == 3

    # Counted in the swarm's Redis, under the app's prefix.
    client = redis.Redis.from_url(redis_url())
    assert client.keys("*" + app.config["RATELIMIT_KEY_PREFIX"] + "/user-*")
    client.close()

    # Another user has an allowance of their own.
    bob = gen_user(session, "bob")
    other = as_user(app.test_client(), bob)
    assert other.post("/", data={**FORM, "csrf_token": csrf_token(other)}).status_code == 302


def test_a_limit_store_that_fails_as_another_request_gave_up_on_it_answers_no_500(
    make_app, session, queue, alice
):
    # Two requests at once while the Redis stalls: the first to fail switches the limits to
    # memory; the other's count, under way in Redis, fails after that.
    app = make_app(SUBMIT_RATE="30/minute")
    limiter = app.extensions["specpipe.limiter"]
    api = Api(app.test_client(), create_token(session, "alice-ci", alice))
    session.commit()

    def stalled(*args, **kwargs):
        limiter._storage_dead = True  # the other request's failure, just before this one's
        raise redis.exceptions.TimeoutError("Timeout reading from socket")

    limiter._limiter.hit = stalled
    assert api.post("/jobs", json={"prompt": "during the stall"}).status_code == 201
    assert jobs_stored(session) == 1


def test_active_jobs_cap_on_the_api(make_app, session, queue, alice):
    app = make_app(MAX_ACTIVE_JOBS=2)
    api = Api(app.test_client(), create_token(session, "alice-ci", alice))
    session.commit()
    first = api.post("/jobs", json={"prompt": "a"}).get_json()["id"]
    assert api.post("/jobs", json={"prompt": "b"}).status_code == 201
    refused = api.post("/jobs", json={"prompt": "c"})
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "10"
    assert "2 jobs queued or running" in refused.get_json()["error"]
    assert jobs_stored(session) == 2

    gen_job(session, owner=alice, status="done")  # finished jobs do not count
    assert api.post(f"/jobs/{first}/cancel").status_code == 200  # and a cancel makes room
    assert api.post("/jobs", json={"prompt": "c"}).status_code == 201
    # Nor do her jobs count against another user.
    admin_api = Api(app.test_client(), create_token(session, "admin-ci", builtin_admin(session)))
    session.commit()
    assert admin_api.post("/jobs", json={"prompt": "d"}).status_code == 201


def test_active_jobs_cap_on_the_form(make_app, session, queue, alice):
    app = make_app(MAX_ACTIVE_JOBS=1)
    page = as_user(app.test_client(), alice)
    gen_job(session, owner=alice, status="running")
    response = page.post("/", data={**FORM, "csrf_token": csrf_token(page)})
    assert response.status_code == 429 and response.headers["Retry-After"] == "10"
    html = response.get_data(as_text=True)
    assert "1 jobs queued or running" in html and 'id="refusal"' in html
    assert jobs_stored(session) == 1 and queue.messages() == []


def test_cap_in_the_submission_path_itself(session, queue, alice):
    limits = JobLimits(max_active_jobs=1)
    submitter = Submitter.connect(redis_url(), "tiny-test", limits, queue.name)
    params = submitter.check({"prompt": "hi"})
    submitter.submit(session, params, alice)
    with pytest.raises(TooManyActiveJobs):
        submitter.submit(session, params, alice)
    assert submitter.submit(session, params).owner.name == "admin"  # no owner: the admin
    assert len(queue.job_ids()) == 2


def test_limit_settings(monkeypatch):
    from specpipe import settings

    assert settings.submit_rate() == "30/minute" and settings.login_rate() == "10/minute"
    assert settings.job_limits().max_active_jobs == 50
    monkeypatch.setenv("SPECPIPE_SUBMIT_RATE", "5/second")
    monkeypatch.setenv("SPECPIPE_MAX_ACTIVE_JOBS", "7")
    assert settings.submit_rate() == "5/second" and settings.job_limits().max_active_jobs == 7
    for bad in ("lots", "0/minute", "5/fortnight", "-1/day"):
        monkeypatch.setenv("SPECPIPE_SUBMIT_RATE", bad)
        with pytest.raises(ValueError, match="SPECPIPE_SUBMIT_RATE must be"):
            settings.submit_rate()


def test_plots_drawn_once(app, client, session):
    run = gen_proof_run(session)
    local = next(p for p in run.proofs if p.kind == "local_math")
    cache = app.extensions["specpipe.plots"]
    first = client.get(f"/proofs/plots/{local.id}/tv.png")
    assert first.status_code == 200 and first.data.startswith(b"\x89PNG")
    assert cache.renders == 1
    again = client.get(f"/proofs/plots/{local.id}/tv.png")
    assert again.data == first.data and cache.renders == 1
    assert "private" in again.headers["Cache-Control"]
