"""The bound on open /v1 completions (`app.waits`): per user and per process, a completion
beyond it is a 429 in OpenAI's shape that makes no job, and a place comes back however the
completion ends. Then the real `specpipe web` with more completions open than the old eight
threads: the login page still answers within the target (`specpipe bench web`, bounded)."""

from __future__ import annotations

import threading
import time

import pytest

from models.tokens import create_token
from tests.factories import gen_user
from tests.web.test_openai_api import CHAT, FakeCoordinator, job_count, post

STREAM = {**CHAT, "stream": True}


@pytest.fixture
def tokens(session) -> dict[str, str]:
    made = {}
    for name in ("alice", "bob"):
        made[name] = create_token(session, f"{name}-ci", gen_user(session, name))
    session.commit()
    return made


def refused_as_busy(response) -> str:
    assert response.status_code == 429 and response.headers["Retry-After"] == "5"
    error = response.get_json()["error"]
    assert error["type"] == "requests" and error["code"] == "rate_limit_exceeded"
    return error["message"]


def test_open_completions_are_bounded_per_user_and_per_process(make_app, session, tokens):
    app = make_app(OPEN_COMPLETIONS=3, OPEN_COMPLETIONS_PER_USER=2)
    client = app.test_client()
    bound = app.extensions["specpipe.open_completions"]
    alice = [post(client, "/v1/chat/completions", tokens["alice"], STREAM, buffered=False)]
    alice.append(post(client, "/v1/chat/completions", tokens["alice"], STREAM, buffered=False))
    assert [r.status_code for r in alice] == [200, 200] and bound.held() == 2
    jobs = job_count(session)

    third = post(client, "/v1/chat/completions", tokens["alice"], CHAT)
    assert "at most 2 at once per user" in refused_as_busy(third)
    bad = post(client, "/v1/chat/completions", tokens["alice"], {**CHAT, "n": 9})
    assert bad.status_code == 400  # a bad request is told so, whatever the bound

    bob = post(client, "/v1/chat/completions", tokens["bob"], STREAM, buffered=False)
    assert bob.status_code == 200 and bound.held() == 3
    full = post(client, "/v1/chat/completions", tokens["bob"], STREAM)
    assert "holding its 3 open completions" in refused_as_busy(full)
    assert job_count(session) == jobs + 1  # the refused made no job

    alice.pop().close()  # a client hangs up: its place comes back
    assert bound.held() == 2
    again = post(client, "/v1/chat/completions", tokens["alice"], STREAM, buffered=False)
    assert again.status_code == 200 and bound.held() == 3
    for response in (*alice, bob, again):
        response.close()
    assert bound.held() == 0


def test_a_whole_answer_gives_its_place_back(make_app, db_url, tokens):
    app = make_app(OPEN_COMPLETIONS_PER_USER=1)
    bound = app.extensions["specpipe.open_completions"]
    rounds = [([5, 6], "hi")]
    answers = []
    with FakeCoordinator(db_url, rounds, pause_s=0.3):
        waiting = threading.Thread(
            target=lambda: answers.append(
                post(app.test_client(), "/v1/chat/completions", tokens["alice"], CHAT)
            )
        )
        waiting.start()
        deadline = time.monotonic() + 10
        while bound.held() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        busy = post(app.test_client(), "/v1/chat/completions", tokens["alice"], CHAT)
        assert "at most 1 at once per user" in refused_as_busy(busy)
        waiting.join(timeout=20)
    assert answers[0].status_code == 200 and bound.held() == 0
    again = post(app.test_client(), "/v1/chat/completions", tokens["alice"], STREAM, buffered=False)
    assert again.status_code == 200
    again.close()


SUITE_LOGIN_BOUND_MS = 5000.0


def test_the_login_page_answers_while_completions_hold_the_old_thread_count():
    """12 completions open on the real server, where 8 threads used to hang every page."""
    from specpipe.bench import web_load

    result = web_load.run(streams=8, waits=4, logins=3, users=2, log=lambda _line: None)
    measured = result.to_json()
    assert (result.streams_open, result.waits_open) == (8, 4), measured
    # The benchmark holds the 1 s target on a quiet machine; here, beside the rest of the suite,
    # the bound only has to tell a page that answers from the old server's, which answered none
    # within 10 s.
    assert result.login_failures == 0 and result.login_max_ms < SUITE_LOGIN_BOUND_MS, measured
    assert result.cancelled_after_hangup_s is not None, measured  # hanging up cancelled all
