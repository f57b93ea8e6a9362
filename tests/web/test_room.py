"""A job waiting for KV-cache room: the job page and the job's JSON say which stage is full, from
the waiting record the coordinator writes in the swarm's Redis, and stop saying it once the job
waits no more (its record cleared, or its holder gone). A Redis that does not answer leaves the
reason out, never the page."""

from __future__ import annotations

import re
import socket
import threading
from types import SimpleNamespace

import pytest

from models.db import make_session_factory
from models.jobs import Job
from models.tokens import create_token
from specpipe.ops.redis_server import free_port
from specpipe.swarm.inventory import NodeInfo
from specpipe.swarm.kvbudget import Full, room_name, waiting_key
from tests.factories import gen_job, gen_user
from tests.waiting import wait_until
from tests.web.conftest import Api, as_user
from workers.room import room_keeper

FULL = Full("stage-b.example", 900, 1000)
NEED = 160
SHOWN = {"host": "stage-b.example", "used": 900, "budget": 1000, "need": NEED}
SENTENCE = (
    "Waiting for room: stage stage-b.example holds 900 of 1000 tokens of KV cache; "
    "this job needs 160."
)


def room_paragraph(html: str) -> tuple[bool, str]:
    """Whether the page's `#job-room` is hidden, and its text without tags."""
    match = re.search(r'<p class="muted" id="job-room"([^>]*)>(.*?)</p>', html, re.S)
    assert match, "the job page has no #job-room"
    return "hidden" in match.group(1), re.sub(r"<[^>]+>", "", match.group(2))


def stage(host: str) -> NodeInfo:
    """A stage of a route with a budget of 1000 tokens."""
    return NodeInfo(
        host=host, layer_start=0, layer_end=1, redis_url="redis://x", kv_budget_tokens=1000
    )


def shown_wait(client, job_id: int) -> dict | None:
    """The job's `waiting_for_room` in the JSON its page polls."""
    return client.get(f"/jobs/{job_id}/progress").get_json()["waiting_for_room"]


def test_a_queued_job_waiting_for_room_says_which_stage_is_full(app, session, rooms, holders):
    alice = gen_user(session, "alice", "a long enough secret")
    job, other = gen_job(session, owner=alice), gen_job(session, owner=alice)
    page = as_user(app.test_client(), alice)
    api = Api(app.test_client(), create_token(session, "alice-room", alice))
    session.commit()
    assert api.get(f"/jobs/{job.id}").get_json()["waiting_for_room"] is None
    assert room_paragraph(page.get(f"/jobs/{job.id}").get_data(as_text=True))[0] is True

    rooms.mark_waiting(room_name(job.id), holders("lock"), FULL, NEED)
    assert api.get(f"/jobs/{job.id}").get_json()["waiting_for_room"] == SHOWN
    assert shown_wait(page, job.id) == SHOWN
    assert room_paragraph(page.get(f"/jobs/{job.id}").get_data(as_text=True)) == (False, SENTENCE)
    assert api.get(f"/jobs/{other.id}").get_json()["waiting_for_room"] is None

    rooms.clear_waiting(room_name(job.id))
    assert api.get(f"/jobs/{job.id}").get_json()["waiting_for_room"] is None
    assert shown_wait(page, job.id) is None
    assert room_paragraph(page.get(f"/jobs/{job.id}").get_data(as_text=True))[0] is True


def test_the_wait_is_not_shown_once_its_holder_is_gone(client, session, rooms, holders):
    job = gen_job(session)
    lock = holders("lock")
    rooms.mark_waiting(room_name(job.id), lock, FULL, NEED)
    assert shown_wait(client, job.id) == SHOWN
    rooms.client.delete(lock)  # its coordinator died: the lock lapsed
    assert shown_wait(client, job.id) is None
    assert room_paragraph(client.get(f"/jobs/{job.id}").get_data(as_text=True))[0] is True


def test_a_resumed_job_waits_running_and_a_finished_one_never_waits(
    client, session, rooms, holders
):
    job = gen_job(session, status="running")
    rooms.mark_waiting(room_name(job.id), holders("lock"), FULL, NEED)
    assert shown_wait(client, job.id) == SHOWN
    job.status = "cancelled"
    session.commit()
    assert shown_wait(client, job.id) is None


@pytest.mark.parametrize(
    "record",
    [b"not json", b"[1, 2]", b"7", b'{"host": "a", "used": 1, "budget": 2, "need": 3}'],
)
def test_an_unreadable_waiting_record_is_no_wait(client, session, rooms, record):
    job = gen_job(session)
    rooms.client.hset(waiting_key(rooms.swarm), room_name(job.id), record)
    response = client.get(f"/jobs/{job.id}/progress")
    assert response.status_code == 200 and response.get_json()["waiting_for_room"] is None


def test_the_coordinators_own_wait_shows_until_its_room_is_free(
    client, session, db_url, rooms, holders
):
    """The coordinator's room keeper, waiting for a job's room, is what the page shows."""
    hops = [stage("stage-a.example"), stage("stage-b.example")]
    assert rooms.reserve(hops, "job-before", 900, holders("before"), "1") is None
    job = gen_job(session)
    session.commit()
    stop, out = threading.Event(), {}

    def wait_for_room() -> None:
        with make_session_factory(db_url)() as own:
            admit = room_keeper(own, rooms, holders("lock"), lambda: not stop.is_set(), poll_s=0.05)
            out["release"] = admit(
                own.get(Job, job.id), SimpleNamespace(route=hops, on_reroute=None), NEED
            )

    thread = threading.Thread(target=wait_for_room)
    thread.start()
    try:
        wait = wait_until(lambda: shown_wait(client, job.id), 10, "the job's wait on the page")
        assert wait == {"host": "stage-a.example", "used": 900, "budget": 1000, "need": NEED}
        rooms.release(hops, "job-before", "1")
        thread.join(10)
        assert not thread.is_alive() and out["release"] is not None
        assert shown_wait(client, job.id) is None
        assert rooms.used("stage-a.example") == NEED
    finally:
        stop.set()
        thread.join(10)
    out["release"]()


@pytest.fixture(params=["refused", "silent"])
def dead_redis_url(request):
    """The URL of a Redis that refuses connections, or of one that accepts and never answers."""
    if request.param == "refused":
        yield f"redis://127.0.0.1:{free_port()}/0"
        return
    with socket.create_server(("127.0.0.1", 0)) as silent:
        yield f"redis://127.0.0.1:{silent.getsockname()[1]}/0"


def test_a_redis_that_does_not_answer_is_no_wait_not_an_error(
    make_app, admin, session, dead_redis_url
):
    app = make_app(REDIS_URL=dead_redis_url)
    client = as_user(app.test_client(), admin)
    job = gen_job(session)
    api = Api(client, create_token(session, "admin-room", admin))
    session.commit()
    progress = client.get(f"/jobs/{job.id}/progress")
    assert progress.status_code == 200 and progress.get_json()["waiting_for_room"] is None
    assert progress.get_json()["queue"] == {"position": 1, "queued": 1}
    response = api.get(f"/jobs/{job.id}")
    assert response.status_code == 200 and response.get_json()["waiting_for_room"] is None
    page = client.get(f"/jobs/{job.id}")
    assert page.status_code == 200
    assert room_paragraph(page.get_data(as_text=True))[0] is True
