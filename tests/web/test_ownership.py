"""Jobs belong to their submitter: each user sees, cancels and re-runs only their own (another
user's job answers 404, as a missing one does); an admin sees everyone's. The API acts as the
token's owner. Proofs, runs and nodes are for every logged-in user."""

from __future__ import annotations

import re

import pytest

from models.jobs import Job
from models.tokens import create_token
from tests.factories import gen_job, gen_proof_run, gen_user
from tests.web.conftest import Api, as_user, csrf_token, log_in

PASSWORD = "a long enough secret"


@pytest.fixture
def users(session):
    alice = gen_user(session, "alice", PASSWORD)
    bob = gen_user(session, "bob", PASSWORD)
    root = gen_user(session, "root", PASSWORD, is_admin=True)
    return alice, bob, root


@pytest.fixture
def clients(app, users):
    """alice and bob logged in through the form, root (an admin) too."""
    made = []
    for user in users:
        client = app.test_client()
        assert log_in(client, user.name, PASSWORD).status_code == 302
        made.append(client)
    return made


def history_ids(html: str) -> list[int]:
    return [int(i) for i in re.findall(r'<td><a href="/jobs/(\d+)">', html)]


def submit(client, prompt: str) -> int:
    data = {
        "csrf_token": csrf_token(client),
        "prompt": prompt,
        "max_new_tokens": "8",
        "temp": "0",
        "top_p": "1",
        "top_k": "0",
        "seed": "1",
        "draft_k": "2",
        "speculate": "on",
    }
    response = client.post("/", data=data)
    assert response.status_code == 302, response.get_data(as_text=True)
    return int(response.headers["Location"].rsplit("/", 1)[1])


def test_each_user_sees_only_their_own_jobs(clients, session, queue, users):
    alice, bob, root = clients
    a = submit(alice, "alice's secret prompt")
    b = submit(bob, "bob's secret prompt")
    assert session.get(Job, a).owner.name == "alice" and session.get(Job, b).owner.name == "bob"

    assert history_ids(alice.get("/history").get_data(as_text=True)) == [a]
    assert history_ids(bob.get("/history").get_data(as_text=True)) == [b]
    assert "bob's secret" not in alice.get("/history?q=secret").get_data(as_text=True)
    assert history_ids(root.get("/history").get_data(as_text=True)) == [b, a]
    assert '<td class="owner">bob</td>' in root.get("/history").get_data(as_text=True)

    assert alice.get(f"/jobs/{a}").status_code == 200
    mine, theirs, missing = (alice.get(f"/jobs/{i}") for i in (a, b, 999999))
    assert mine.status_code == 200 and "alice&#39;s secret prompt" in mine.get_data(as_text=True)
    assert theirs.status_code == missing.status_code == 404
    # The same answer as for a job that does not exist: nothing says it does.
    assert f"<p>There is no job {b}.</p>" in theirs.get_data(as_text=True)
    assert "<p>There is no job 999999.</p>" in missing.get_data(as_text=True)
    assert alice.get(f"/jobs/{b}/progress").status_code == 404
    admin_view = root.get(f"/jobs/{b}").get_data(as_text=True)
    assert 'id="job-owner">bob' in admin_view


def test_cancel_and_rerun_only_own_jobs(clients, session, queue, users):
    alice, bob, root = clients
    b = gen_job(session, owner=users[1]).id
    token = csrf_token(alice)
    assert alice.post(f"/jobs/{b}/cancel", data={"csrf_token": token}).status_code == 404
    assert alice.post(f"/jobs/{b}/rerun", data={"csrf_token": token}).status_code == 404
    session.expire_all()
    assert session.get(Job, b).status == "queued" and queue.messages() == []

    response = bob.post(f"/jobs/{b}/rerun", data={"csrf_token": csrf_token(bob)})
    assert response.status_code == 302
    rerun = int(response.headers["Location"].rsplit("/", 1)[1])
    assert session.get(Job, rerun).owner.name == "bob" and queue.job_ids() == [rerun]

    response = root.post(f"/jobs/{b}/cancel", data={"csrf_token": csrf_token(root)})
    assert response.status_code == 302
    session.expire_all()
    assert session.get(Job, b).status == "cancelled"


def test_api_acts_as_the_tokens_owner(client, session, queue, users):
    alice, bob, root = users
    apis = {u.name: Api(client, create_token(session, f"{u.name}-ci", u)) for u in users}
    session.commit()
    created = apis["alice"].post("/jobs", json={"prompt": "from alice's script"})
    assert created.status_code == 201 and created.get_json()["owner"] == "alice"
    a = created.get_json()["id"]
    b = gen_job(session, owner=bob).id

    assert [j["id"] for j in apis["alice"].get("/jobs").get_json()["jobs"]] == [a]
    assert apis["alice"].get("/jobs").get_json()["total"] == 1
    assert [j["id"] for j in apis["bob"].get("/jobs").get_json()["jobs"]] == [b]
    assert {j["id"] for j in apis["root"].get("/jobs").get_json()["jobs"]} == {a, b}

    theirs = apis["alice"].get(f"/jobs/{b}")
    assert theirs.status_code == 404 and theirs.get_json() == {"error": f"no job {b}"}
    assert apis["alice"].post(f"/jobs/{b}/cancel").status_code == 404
    session.expire_all()
    assert session.get(Job, b).status == "queued"
    assert apis["bob"].post(f"/jobs/{b}/cancel").status_code == 200
    assert apis["root"].get(f"/jobs/{a}").get_json()["owner"] == "alice"


def test_shared_pages_for_every_user(clients, session):
    alice = clients[0]
    run = gen_proof_run(session)
    for path in ("/proofs/", f"/proofs/{run.id}", "/nodes/", f"/runs/{run.id}/record.json"):
        assert alice.get(path).status_code == 200, path


def test_cli_jobs_and_old_jobs_belong_to_the_admin(app, session, users, queue):
    alice = as_user(app.test_client(), users[0])
    old = gen_job(session).id  # no owner given: the built-in admin
    assert alice.get(f"/jobs/{old}").status_code == 404
    assert session.get(Job, old).owner.name == "admin"
