"""The JSON API: bearer tokens, job creation and its bad input, listing, cancel, nodes, runs."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from models.jobs import Job
from models.nodes import Node
from models.tokens import revoke_token
from tests.factories import gen_job, gen_proof_run, gen_ring

GOOD = {
    "prompt": "hello",
    "max_new_tokens": 16,
    "temp": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "seed": 7,
    "draft_k": 3,
}


def job_count(session) -> int:
    session.expire_all()
    return session.scalar(select(func.count()).select_from(Job))


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer sp_nope"},
        {"Authorization": "Basic dXNlcjpwdw=="},
        {"Authorization": "sp_x"},
    ],
)
def test_api_requires_a_valid_token(client, session, queue, headers):
    for method, path in [
        ("get", "/api/v1/jobs"),
        ("post", "/api/v1/jobs"),
        ("get", "/api/v1/jobs/1"),
        ("post", "/api/v1/jobs/1/cancel"),
        ("get", "/api/v1/nodes"),
        ("get", "/api/v1/runs/1"),
    ]:
        response = getattr(client, method)(path, headers=headers, json=GOOD)
        assert response.status_code == 401, path
        assert "API token" in response.get_json()["error"]
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert job_count(session) == 0 and queue.messages() == []


def test_revoked_token_refused(api, session, api_token):
    assert api.get("/jobs").status_code == 200
    from models.tokens import ApiToken

    name = session.scalars(select(ApiToken.name)).one()
    revoke_token(session, name)
    session.commit()
    assert api.get("/jobs").status_code == 401


def test_create_job(api, session, queue):
    response = api.post("/jobs", json=GOOD)
    assert response.status_code == 201
    body = response.get_json()
    assert response.headers["Location"].endswith(f"/api/v1/jobs/{body['id']}")
    assert {k: body[k] for k in GOOD} == GOOD
    assert body["status"] == "queued" and body["seed_was_random"] is False
    assert queue.job_ids() == [body["id"]]


def test_create_job_defaults_and_random_seed(api, session, queue):
    body = api.post("/jobs", json={"prompt": "hi", "seed": None}).get_json()
    assert body["seed_was_random"] is True and 0 <= body["seed"] < 2**64
    assert (body["max_new_tokens"], body["draft_k"]) == (128, 4)
    assert session.get(Job, body["id"]).seed == body["seed"]


@pytest.mark.parametrize(
    ("stop", "stored"),
    [
        (["\n\nUser:", "END", " "], ["\n\nUser:", "END", " "]),
        ("###", ["###"]),
        ([], []),
        (None, []),
    ],
)
def test_create_job_with_stop_strings(api, session, queue, stop, stored):
    response = api.post("/jobs", json={**GOOD, "stop": stop})
    assert response.status_code == 201
    body = response.get_json()
    assert body["stop"] == stored
    assert session.get(Job, body["id"]).stop == stored
    assert api.get(f"/jobs/{body['id']}").get_json()["stop"] == stored


def test_create_job_without_stop_strings_has_none(api, session, queue):
    assert api.post("/jobs", json=GOOD).get_json()["stop"] == []


@pytest.mark.parametrize(
    ("changes", "field", "reason"),
    [
        ({"prompt": ""}, "prompt", "is empty"),
        ({"prompt": "  \n "}, "prompt", "is empty"),
        ({"prompt": "x" * 501}, "prompt", "is longer than 500 characters"),
        ({"prompt": 5}, "prompt", "must be text"),
        ({"prompt": None}, "prompt", "must be text"),
        ({"prompt": "\ud800 lone surrogate"}, "prompt", "is not valid UTF-8"),
        ({"prompt": "nul\u0000"}, "prompt", "must not contain NUL characters"),
        ({"max_new_tokens": -1}, "max_new_tokens", "must be between 1 and 1024"),
        ({"max_new_tokens": 10**30}, "max_new_tokens", "must be between 1 and 1024"),
        ({"max_new_tokens": 3.5}, "max_new_tokens", "must be a whole number"),
        ({"max_new_tokens": "10"}, "max_new_tokens", "must be a whole number"),
        ({"max_new_tokens": True}, "max_new_tokens", "must be a whole number"),
        ({"temp": -0.1}, "temp", "must be between 0 (greedy) and 100"),
        ({"temp": "hot"}, "temp", "must be a number"),
        ({"top_p": 0}, "top_p", "must be above 0 and at most 1"),
        ({"top_p": 1.5}, "top_p", "must be above 0 and at most 1"),
        ({"top_k": -3}, "top_k", "must be 0 (off) or a positive whole number"),
        ({"seed": -1}, "seed", "must be between 0 and 2^64-1"),
        ({"seed": 2**64}, "seed", "must be between 0 and 2^64-1"),
        ({"seed": 1.5}, "seed", "must be a whole number"),
        ({"seed": "12"}, "seed", "must be a whole number"),
        ({"draft_k": -1}, "draft_k", "must be between 0 (no speculation) and 32"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "must be at most 4 strings, not 5"),
        ({"stop": ""}, "stop", "must not contain an empty string"),
        ({"stop": ["ok", ""]}, "stop", "must not contain an empty string"),
        ({"stop": "x" * 65}, "stop", "must each be at most 64 characters"),
        ({"stop": ["x" * 65]}, "stop", "must each be at most 64 characters"),
        ({"stop": 5}, "stop", "must be text or a list of text"),
        ({"stop": [1]}, "stop", "must be text or a list of text"),
        ({"stop": ["a", ["b"]]}, "stop", "must be text or a list of text"),
        ({"stop": {"a": 1}}, "stop", "must be text or a list of text"),
        ({"stop": True}, "stop", "must be text or a list of text"),
        ({"stop": ["nul\u0000"]}, "stop", "must not contain NUL characters"),
        ({"stop": "\ud800"}, "stop", "must be valid UTF-8"),
    ],
)
def test_bad_job_fields(api, session, queue, changes, field, reason):
    response = api.post("/jobs", json={**GOOD, **changes})
    assert response.status_code == 400
    body = response.get_json()
    assert body["error"] == "invalid job" and body["fields"] == {field: reason}
    assert job_count(session) == 0 and queue.messages() == []


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_temperature_literal(api, session, queue, literal):
    body = '{"prompt": "hi", "temp": ' + literal + "}"
    response = api.post("/jobs", data=body, content_type="application/json")
    assert response.status_code == 400
    assert response.get_json()["fields"] == {"temp": "must be a finite number"}
    assert job_count(session) == 0 and queue.messages() == []


@pytest.mark.parametrize(
    ("data", "content_type", "reason"),
    [
        (b'{"prompt": "\xff\xfe"}', "application/json", "JSON object"),
        (b"not json", "application/json", "JSON object"),
        (b"[1, 2]", "application/json", "JSON object"),
        (b'{"prompt": "hi"}', "text/plain", "JSON object"),
        (
            b'{"prompt": "hi", "colour": "red", "n": 1}',
            "application/json",
            "unknown fields: colour, n",
        ),
        (b'{"max_new_tokens": 5}', "application/json", "invalid job"),
    ],
)
def test_bad_bodies(api, session, queue, data, content_type, reason):
    response = api.post("/jobs", data=data, content_type=content_type)
    assert response.status_code == 400
    assert reason in response.get_json()["error"]
    assert job_count(session) == 0 and queue.messages() == []


def test_oversized_body_is_json_413(api, session, queue):
    response = api.post(
        "/jobs", data=b'{"prompt": "' + b"x" * (9 << 20) + b'"}', content_type="application/json"
    )
    assert response.status_code == 413 and "error" in response.get_json()
    assert job_count(session) == 0


def test_unknown_route_and_method_are_json(api):
    assert api.get("/nope").status_code == 404
    assert "error" in api.get("/nope").get_json()
    response = api.get("/jobs/1/cancel")
    assert response.status_code == 405 and "error" in response.get_json()


def test_list_jobs_filters_and_pages(api, session):
    for i in range(30):
        gen_job(session, prompt=f"story {i}", status="done" if i % 3 == 0 else "queued")
    body = api.get("/jobs?per_page=25").get_json()
    assert (body["total"], body["pages"], len(body["jobs"])) == (30, 2, 25)
    assert body["jobs"][0]["prompt"] == "story 29"  # newest first
    assert len(api.get("/jobs?page=2").get_json()["jobs"]) == 5
    done = api.get("/jobs?status=done").get_json()
    assert done["total"] == 10 and {j["status"] for j in done["jobs"]} == {"done"}
    assert api.get("/jobs?q=story 1").get_json()["total"] == 11  # 1, 10 … 19
    for bad in ("status=weird", "sort=random", "page=0", "page=x", "per_page=-1"):
        response = api.get(f"/jobs?{bad}")
        assert response.status_code == 400 and "error" in response.get_json(), bad


def test_get_job_and_404(api, session):
    job = gen_job(session, seed=2**64 - 1)
    body = api.get(f"/jobs/{job.id}").get_json()
    assert body["seed"] == 2**64 - 1 and body["prompt"] == job.prompt
    response = api.get(f"/jobs/{job.id + 99}")
    assert response.status_code == 404 and "no job" in response.get_json()["error"]


def test_cancel(api, session):
    queued = gen_job(session)
    running = gen_job(session, status="running")
    done = gen_job(session, status="done")
    assert api.post(f"/jobs/{queued.id}/cancel").get_json()["status"] == "cancelled"
    body = api.post(f"/jobs/{running.id}/cancel").get_json()
    assert body["status"] == "running" and body["cancel_requested"] is True
    response = api.post(f"/jobs/{done.id}/cancel")
    assert response.status_code == 409 and "already finished" in response.get_json()["error"]
    assert api.post("/jobs/99999/cancel").status_code == 404


@pytest.mark.parametrize("status", ["queued", "running"])
def test_a_cancel_leaves_a_job_that_finished_since_the_read_done(
    api, session, finished_after_load, status
):
    import app.api

    job = gen_job(session, status=status)
    finished_after_load(app.api, "_job_or_404")
    response = api.post(f"/jobs/{job.id}/cancel")
    assert response.status_code == 409 and "already finished (done)" in response.get_json()["error"]
    session.expire_all()
    stored = session.get(Job, job.id)
    assert (stored.status, stored.cancel_requested) == ("done", False)


def test_nodes(api, session):
    gen_ring(session, 3)
    nodes = api.get("/nodes").get_json()["nodes"]
    assert [n["role"] for n in nodes] == ["stage0", "stage1", "tail"]
    assert nodes[0]["status"] == "online" and nodes[0]["last_heartbeat"].endswith("Z")


def test_a_node_has_the_fields_the_document_lists_and_they_are_the_stores_columns(
    api, client, session
):
    gen_ring(session, 1)
    [node] = api.get("/nodes").get_json()["nodes"]
    document = client.get("/api/v1/openapi.json").get_json()
    documented = set(document["components"]["schemas"]["Node"]["properties"])
    assert set(node) == documented
    assert documented - {"status"} == set(Node.__table__.columns.keys()) - {"id"}


def test_runs(api, session):
    gen_ring(session, 2)
    run = gen_proof_run(session)
    body = api.get(f"/runs/{run.id}").get_json()
    assert body["run_id"] == run.name and len(body["nodes"]) == 2
    assert body["proof_1_local_math"]["verdict"] == "pass"
    assert api.get(f"/runs/{run.id + 5}").status_code == 404
