"""The OpenAI-compatible API on the web app alone: requests become the token owner's jobs, bad
requests are refused in OpenAI's error shape without making a job, and answers (whole and
streamed) are built from the job's stored rounds. A thread plays the coordinator, writing
rounds into the store as the real one does; tests/swarm/test_openai_swarm.py runs the real one.
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select, update

from app.openai.requests import CHAT_ROLES
from models.db import make_session_factory, utcnow
from models.jobs import Job
from models.tokens import create_token
from models.users import create_user
from specpipe.settings import JOB_DEFAULTS
from tests.factories import finish_elsewhere, gen_job
from workers.job_run import job_prompt_ids

MODEL = "tiny-test"  # the test app's model (tests/web/conftest.py)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "temperature": 0}
RAW = {"model": MODEL, "prompt": "Once upon a", "max_tokens": 4, "seed": 9}


class FakeCoordinator:
    """Runs every queued job of the store by writing `rounds` (cumulative (ids, text)) into it,
    one every `pause_s`, then marks it done; `rounds` may be a function of the job, giving its
    own. With a `codec` (the model's `Target`), it first feeds each job's prompt through it as
    the coordinator does (`job_prompt_ids`), keeping the text fed in `prompts` by job id and its
    length as the job's prompt tokens. `workers` jobs run at once, each taken by one of them."""

    def __init__(
        self, db_url: str, rounds, pause_s: float = 0.05, codec=None, workers: int = 1
    ) -> None:
        self.factory = make_session_factory(db_url)
        self.rounds, self.pause_s, self.codec = rounds, pause_s, codec
        self.prompts: dict[int, str] = {}
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(workers)]

    def __enter__(self) -> FakeCoordinator:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=10)

    def take(self, session) -> Job | None:
        """The oldest queued job, made running by this worker alone; None when there is none."""
        session.rollback()
        job_id = session.scalar(select(Job.id).where(Job.status == "queued").order_by(Job.id))
        if job_id is None:
            return None
        taken = session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == "queued")
            .values(status="running", started_at=utcnow())
        ).rowcount
        session.commit()
        return session.get(Job, job_id, populate_existing=True) if taken else None

    def run(self) -> None:
        with self.factory() as session:
            while not self.stop.is_set():
                job = self.take(session)
                if job is None:
                    time.sleep(0.02)
                    continue
                job.prompt_tokens = self.prompt_tokens(job)
                session.commit()
                rounds = self.rounds(job) if callable(self.rounds) else self.rounds
                for ids, text in rounds:
                    time.sleep(self.pause_s)
                    session.refresh(job)
                    if job.cancel_requested:
                        job.status = "cancelled"
                        break
                    logprobs = [[-0.5, [[t, -0.5], [0, -2.0]]] for t in ids]
                    job.record_progress(ids, text, [0] * len(ids), 1.0, logprobs)
                    session.commit()
                else:
                    job.status = "done"
                job.finished_at = utcnow()
                session.commit()

    def prompt_tokens(self, job: Job) -> int:
        """The job's prompt as fed to the model: its tokens (3 without a codec)."""
        if self.codec is None:
            return 3
        ids = job_prompt_ids(self.codec, job)
        self.prompts[job.id] = self.codec.decode(ids)
        return len(ids)


def job_count(session) -> int:
    session.expire_all()
    return session.scalar(select(func.count()).select_from(Job))


def post(client, path, token, body, **kw):
    return client.post(path, json=body, headers={"Authorization": f"Bearer {token}"}, **kw)


def events(response) -> list:
    """The data of each Server-Sent Event of a streamed response, comments left out."""
    out = []
    for block in response.get_data(as_text=True).split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_openai_error(response, status: int, param: str | None = None):
    assert response.status_code == status, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": "x"}])
def test_a_missing_or_bad_key_is_401_in_openai_shape(client, session, queue, headers):
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = client.post(path, json=RAW, headers=headers)
        error = assert_openai_error(response, 401)
        assert error["code"] == "invalid_api_key"
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert_openai_error(client.get("/v1/models", headers=headers), 401)
    assert job_count(session) == 0 and queue.messages() == []


@pytest.mark.parametrize(
    "change,status,param",
    [
        ({"model": "gpt-4o"}, 404, "model"),
        ({"model": None}, 400, "model"),
        ({"n": 9}, 400, "n"),
        ({"n": "1"}, 400, "n"),
        ({"temperature": "hot"}, 400, "temperature"),
        ({"temperature": -1}, 400, "temperature"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": 2.5}, 400, "max_tokens"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, 400, "max_tokens"),
        ({"max_tokens": [4]}, 400, "max_tokens"),
        ({"max_tokens": None, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
        ({"top_p": 0}, 400, "top_p"),
        ({"top_k": -1}, 400, "top_k"),
        ({"seed": -3}, 400, "seed"),
        ({"stop": 5}, 400, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"stream": "yes"}, 400, "stream"),
        ({"logprobs": 6}, 400, "logprobs"),
        ({"logprobs": True}, 400, "logprobs"),
        ({"echo": True}, 400, "echo"),
        ({"presence_penalty": 0.5}, 400, "presence_penalty"),
        ({"prompt": ["a", "b"]}, 400, "prompt"),
        ({"prompt": 7}, 400, "prompt"),
        ({"prompt": "   "}, 400, "prompt"),
        ({"draft_k": 1000}, 400, "draft_k"),
        ({"sampler": "exact"}, 400, "sampler"),
        ({"sampler": 1}, 400, "sampler"),
    ],
)
def test_bad_completion_fields_are_refused_and_change_nothing(
    client, session, queue, api_token, change, status, param
):
    body = {**RAW, **change}
    assert_openai_error(post(client, "/v1/completions", api_token, body), status, param)
    assert job_count(session) == 0 and queue.messages() == []


@pytest.mark.parametrize(
    "change,param",
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 9}, "top_logprobs"),
        ({"logprobs": 1}, "logprobs"),
    ],
)
def test_bad_chat_fields_are_refused(client, session, api_token, change, param):
    assert_openai_error(
        post(client, "/v1/chat/completions", api_token, {**CHAT, **change}), 400, param
    )
    assert job_count(session) == 0


def test_a_body_that_is_not_an_object_is_400(client, api_token):
    for data in ("[1]", "nope", ""):
        response = client.post(
            "/v1/completions",
            data=data,
            content_type="application/json",
            headers={"Authorization": f"Bearer {api_token}"},
        )
        assert_openai_error(response, 400)


def test_unknown_routes_and_methods_answer_in_openai_shape(client, api_token):
    headers = {"Authorization": f"Bearer {api_token}"}
    assert_openai_error(client.get("/v1/nothing-here", headers=headers), 404)
    response = client.get("/v1/completions", headers=headers)
    assert_openai_error(response, 405)
    assert "POST" in response.headers["Allow"]


def test_models_lists_the_served_model(client, api_token):
    headers = {"Authorization": f"Bearer {api_token}"}
    listed = client.get("/v1/models", headers=headers).get_json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == [MODEL]
    assert client.get(f"/v1/models/{MODEL}", headers=headers).get_json()["id"] == MODEL
    assert_openai_error(client.get("/v1/models/other", headers=headers), 404, "model")


def test_a_completion_is_a_job_of_the_key_owner(app, db_url, session, api_token):
    alice = create_user(session, "alice", "a-long-password")
    token = create_token(session, "alice-key", user=alice)
    session.commit()
    client = app.test_client()
    body = {**RAW, "seed": None, "unknown_field": {"ignored": True}, "user": "someone"}
    with FakeCoordinator(db_url, [([5, 6], "ab"), ([5, 6, 7, 8], "abcd")]):
        response = post(client, "/v1/completions", token, body)
    assert response.status_code == 200, response.get_json()
    answer = response.get_json()
    job = session.get(Job, answer["specpipe"]["job_id"])
    assert answer["id"] == f"cmpl-{job.id}" and answer["object"] == "text_completion"
    assert job.owner.name == "alice" and job.raw_prompt and job.messages is None
    assert job.prompt == "Once upon a" and job.max_new_tokens == 4
    assert job.seed_was_random and answer["specpipe"]["seed"] == job.seed  # drawn and reported
    # OpenAI's own defaults where its API documents one; the job defaults for the rest.
    assert (job.temp, job.top_p) == (1.0, 1.0)
    assert (job.top_k, job.draft_k, job.sampler) == tuple(
        JOB_DEFAULTS[name] for name in ("top_k", "draft_k", "sampler")
    )
    (choice,) = answer["choices"]
    assert choice["text"] == "abcd" and choice["finish_reason"] == "length"
    assert choice["logprobs"] is None and job.logprobs is None
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert answer["model"] == MODEL and answer["system_fingerprint"].startswith("fp_")
    # Another user's key does not see it in /api/v1; its owner does.
    mine = client.get("/api/v1/jobs", headers={"Authorization": f"Bearer {token}"}).get_json()
    assert [j["id"] for j in mine["jobs"]] == [job.id]


def test_chat_messages_are_kept_and_a_lone_user_message_is_a_plain_job(
    app, db_url, session, api_token
):
    client = app.test_client()
    chat = {
        **CHAT,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        "max_completion_tokens": 8,
        "stop": "\n",
        "top_k": 5,
        "draft_k": 2,
        "sampler": "icdf",
    }
    with FakeCoordinator(db_url, [([1], "x")]):
        answer = post(client, "/v1/chat/completions", api_token, chat).get_json()
        plain = post(client, "/v1/chat/completions", api_token, CHAT).get_json()
    job = session.get(Job, answer["specpipe"]["job_id"])
    assert answer["id"] == f"chatcmpl-{job.id}" and answer["object"] == "chat.completion"
    assert job.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert job.prompt == "system: Be brief.\n\nuser: hi" and not job.raw_prompt
    assert (job.max_new_tokens, job.stop, job.top_k, job.draft_k, job.sampler) == (
        8,
        ["\n"],
        5,
        2,
        "icdf",
    )
    message = answer["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"] == "x"
    assert answer["choices"][0]["finish_reason"] == "stop"  # ended before its budget
    lone = session.get(Job, plain["specpipe"]["job_id"])
    assert lone.prompt == "hello" and lone.messages is None and not lone.raw_prompt
    assert lone.temp == 0.0


def test_logprobs_come_from_the_stored_rounds(app, db_url, session, api_token):
    client = app.test_client()
    with FakeCoordinator(db_url, [([5, 6], "ab")]):
        raw = post(client, "/v1/completions", api_token, {**RAW, "logprobs": 2}).get_json()
        chat = post(
            client, "/v1/chat/completions", api_token, {**CHAT, "logprobs": True, "top_logprobs": 1}
        ).get_json()
    assert session.get(Job, raw["specpipe"]["job_id"]).logprobs == 2
    assert session.get(Job, chat["specpipe"]["job_id"]).logprobs == 1
    lp = raw["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-0.5, -0.5] and len(lp["top_logprobs"]) == 2
    assert lp["text_offset"][0] == 0
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [-0.5, -0.5]
    assert [len(c["top_logprobs"]) for c in content] == [2, 2]  # as the tail sent them


def test_a_streamed_answer_is_the_whole_text_in_stable_pieces(app, db_url, session, api_token):
    client = app.test_client()
    # A stop-string start ("E" of "END") and a half UTF-8 character wait for the next round.
    rounds = [
        ([1], "Hi"),
        ([1, 2], "Hi E"),
        ([1, 2, 3], "Hi Eve \ufffd"),
        ([1, 2, 3, 4], "Hi Eve é"),
    ]
    with FakeCoordinator(db_url, rounds):
        stream = post(
            client,
            "/v1/completions",
            api_token,
            {**RAW, "stream": True, "stop": ["END"], "stream_options": {"include_usage": True}},
        )
        chunks = events(stream)
        whole = post(client, "/v1/completions", api_token, {**RAW, "stop": ["END"]}).get_json()
    assert stream.status_code == 200 and stream.mimetype == "text/event-stream"
    assert chunks[-1] == "[DONE]"
    pieces = [c["choices"][0]["text"] for c in chunks[:-1] if c["choices"]]
    assert "".join(pieces) == whole["choices"][0]["text"] == "Hi Eve é"
    assert not any(p.endswith(("E", "\ufffd")) for p in pieces)  # nothing shown that may change
    assert chunks[-3]["choices"][0]["finish_reason"] == "length"
    assert chunks[-2]["usage"]["completion_tokens"] == 4 and chunks[-2]["choices"] == []
    assert len({c["id"] for c in chunks[:-1]}) == 1


def test_a_streamed_chat_starts_with_the_role(app, db_url, api_token):
    client = app.test_client()
    with FakeCoordinator(db_url, [([1], "a"), ([1, 2], "ab")]):
        chunks = events(post(client, "/v1/chat/completions", api_token, {**CHAT, "stream": True}))
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content", "") for d in deltas) == "ab"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-1] == "[DONE]"


def test_a_client_that_leaves_a_stream_cancels_its_job(app, db_url, session, api_token):
    client = app.test_client()
    rounds = [([i for i in range(n)], "x" * n) for n in range(1, 40)]
    with FakeCoordinator(db_url, rounds, pause_s=0.1):
        response = post(
            client,
            "/v1/completions",
            api_token,
            {**RAW, "max_tokens": 64, "stream": True},
            buffered=False,
        )
        stream = iter(response.response)
        first = next(stream)
        assert first.startswith(b"data: ")
        response.close()  # the client hangs up
        job_id = json.loads(first[len(b"data: ") :])["specpipe"]["job_id"]

        def cancelled() -> bool:
            session.expire_all()
            return session.get(Job, job_id).status == "cancelled"

        deadline = time.monotonic() + 10
        while not cancelled() and time.monotonic() < deadline:
            time.sleep(0.05)
    job = session.get(Job, job_id)
    assert job.status == "cancelled" and job.cancel_requested
    assert len(job.output_ids) < 39


def test_a_failed_job_is_an_error(app, db_url, session, api_token):
    client = app.test_client()

    def fail() -> None:
        with make_session_factory(db_url)() as s:
            for _ in range(200):
                job = s.scalars(select(Job).where(Job.status == "queued")).first()
                if job is not None:
                    job.status, job.error = "failed", "no stage serves 2-4"
                    job.finished_at = utcnow()
                    s.commit()
                    return
                s.rollback()
                time.sleep(0.02)

    thread = threading.Thread(target=fail)
    thread.start()
    error = assert_openai_error(post(client, "/v1/completions", api_token, RAW), 500)
    thread.join()
    assert "no stage serves 2-4" in error["message"] and error["type"] == "server_error"


@pytest.mark.parametrize("status", ["queued", "running"])
def test_leaving_never_cancels_a_job_that_finished_since_the_read(
    db_url, session, monkeypatch, status
):
    from app.openai.waiting import cancel_job

    job_id = gen_job(session, status=status).id
    with make_session_factory(db_url)() as reader:
        original = reader.get

        def get_then_finish(*args, **kwargs):
            loaded = original(*args, **kwargs)
            finish_elsewhere(db_url, job_id)
            return loaded

        monkeypatch.setattr(reader, "get", get_then_finish)
        cancel_job(reader, job_id)
    session.expire_all()
    stored = session.get(Job, job_id)
    assert (stored.status, stored.cancel_requested) == ("done", False)


def test_limits_answer_429_with_retry_after(make_app, session, api_token, queue):
    app = make_app(MAX_ACTIVE_JOBS=1, OPENAI_WAIT_S=0.3)
    client = app.test_client()
    first = post(client, "/v1/completions", api_token, RAW)  # waits, then gives up (no coordinator)
    assert_openai_error(first, 504)
    assert job_count(session) == 1 and session.scalars(select(Job)).one().cancel_requested
    app = make_app(MAX_ACTIVE_JOBS=1, OPENAI_WAIT_S=0.3)
    session.execute(Job.__table__.update().values(status="running"))
    session.commit()
    busy = post(app.test_client(), "/v1/completions", api_token, RAW)
    error = assert_openai_error(busy, 429)
    assert int(busy.headers["Retry-After"]) >= 1 and error["code"] == "rate_limit_exceeded"
    rated = make_app(SUBMIT_RATE="1/minute", OPENAI_WAIT_S=0.2).test_client()
    post(rated, "/v1/completions", api_token, RAW)
    limited = post(rated, "/v1/chat/completions", api_token, CHAT)
    assert_openai_error(limited, 429)
    assert int(limited.headers["Retry-After"]) >= 1


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
WORDS = st.text(alphabet="abc xyz\u00e9\n", min_size=1, max_size=12).filter(str.strip)
VALID = {
    "model": st.just(MODEL),
    "prompt": WORDS,
    "messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(CHAT_ROLES), "content": WORDS}),
        min_size=1,
        max_size=3,
    ),
    "max_tokens": st.integers(1, 50),
    "max_completion_tokens": st.integers(1, 50),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 50),
    "seed": st.none() | st.integers(0, 2**64 - 1),
    "stop": st.none() | WORDS | st.lists(WORDS, max_size=4),
    "n": st.integers(1, 3),
    "response_format": st.just({"type": "text"}),
    "stream": st.booleans(),
    "draft_k": st.integers(0, 8),
    "user": WORDS,
}


@st.composite
def bodies(draw):
    """A valid body, then perhaps one or two of its fields spoilt, and unknown fields added."""
    names = draw(st.sets(st.sampled_from(sorted(VALID)))) | {"model", "prompt", "messages"}
    body = {name: draw(VALID[name]) for name in names}
    if "max_tokens" in body and "max_completion_tokens" in body:
        body["max_completion_tokens"] = body["max_tokens"]
    for name in draw(st.lists(st.sampled_from(sorted(VALID)), max_size=2)):
        body[name] = draw(JSON_VALUES)
    body.update(draw(st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=2)))
    return body


def test_any_body_is_answered_in_openai_shape_and_refusals_change_nothing(
    make_app, session, api_token
):
    """Generated bodies, valid and not: a refusal is a 400 or 404 in OpenAI's shape that makes
    no job; an accepted request is a job per choice (here never run, so the wait ends at once:
    504, and the jobs are cancelled). Nothing answers 500."""
    client = make_app(OPENAI_WAIT_S=0.0, SUBMIT_RATE="100000/minute").test_client()

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=bodies())
    def answers(path, body):
        before = job_count(session)
        response = post(client, path, api_token, body)
        event(f"answered {response.status_code}")
        taken = response.status_code in (200, 504)
        made = (body.get("n") or 1) if taken else 0  # a job per choice of a request taken
        if response.status_code == 200:  # a stream: its wait ends in an error event
            assert response.mimetype == "text/event-stream" and body.get("stream") is True
            assert "error" in events(response)[-1] and job_count(session) == before + made
            return
        error = assert_openai_error(response, response.status_code)
        assert response.status_code in (400, 404, 504), error
        assert job_count(session) == before + made

    answers()
    assert not session.scalars(select(Job).where(Job.status.in_(("queued", "running")))).all()


def test_a_rerun_feeds_the_prompt_the_same_way(app, db_url, session, api_token):
    from app.submitting import submitter
    from workers.submission import rerun_params

    client = app.test_client()
    chat = {
        **CHAT,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "logprobs": True,
    }
    with FakeCoordinator(db_url, [([1], "x")]):
        answer = post(client, "/v1/chat/completions", api_token, chat).get_json()
        raw = post(client, "/v1/completions", api_token, RAW).get_json()
    for done in (answer, raw):
        job = session.get(Job, done["specpipe"]["job_id"])
        with app.app_context():
            again = submitter().submit(session, rerun_params(job), job.owner)
        assert again.prompt_form() == job.prompt_form() and again.seed == job.seed
        assert again.prompt == job.prompt


def test_under_waitress_chunks_arrive_as_rounds_are_stored_and_leaving_cancels(
    app, db_url, session, api_token
):
    """`specpipe web` serves with waitress: the stream is not held back until the end, and a
    client that closes its connection cancels the job there too."""
    import socket

    import waitress

    server = waitress.create_server(app, host="127.0.0.1", port=0, threads=2)
    threading.Thread(target=server.run, daemon=True).start()
    rounds = [(list(range(n)), "x" * n) for n in range(1, 60)]
    body = json.dumps({**RAW, "max_tokens": 64, "stream": True}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
        f"Authorization: Bearer {api_token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    try:
        with FakeCoordinator(db_url, rounds, pause_s=0.1):
            client = socket.create_connection(("127.0.0.1", server.effective_port), timeout=10)
            started = time.monotonic()
            client.sendall(request)
            received = b""
            while not re.search(rb"data: \{.*\n\n", received):
                more = client.recv(65536)
                assert more, received  # the server ended without a chunk
                received += more
            assert time.monotonic() - started < 3  # the first round, not the whole job
            client.close()  # the client hangs up
            first = received[received.index(b"data: {") + len(b"data: ") :].split(b"\n")[0]
            job_id = json.loads(first)["specpipe"]["job_id"]
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                session.expire_all()
                if session.get(Job, job_id).status == "cancelled":
                    break
                time.sleep(0.05)
        job = session.get(Job, job_id)
        assert job.status == "cancelled" and len(job.output_ids) < 59
    finally:
        server.close()


HARMONY = [  # a gpt-oss reply as rounds write it: reasoning first, then the answer
    ([1, 2], "<|channel|>analysis<|message|>User says hi"),
    ([1, 2, 3], "<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant"),
    (
        [1, 2, 3, 4],
        "<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant"
        "<|channel|>final<|message|>Hello",
    ),
    (
        [1, 2, 3, 4, 5],
        "<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant"
        "<|channel|>final<|message|>Hello there.<|return|>",
    ),
]


def test_a_gpt_oss_chat_answer_gives_its_reasoning_apart_whole_and_streamed(
    make_app, db_url, api_token, tmp_path, monkeypatch
):
    from tests.harmony_checkpoint import write_checkpoint

    model = str(write_checkpoint(tmp_path / "oss", monkeypatch))
    client = make_app(MODEL=model).test_client()
    chat = {**CHAT, "model": model}
    with FakeCoordinator(db_url, HARMONY, pause_s=0.02):
        whole = post(client, "/v1/chat/completions", api_token, chat).get_json()
        chunks = events(post(client, "/v1/chat/completions", api_token, {**chat, "stream": True}))
        raw = post(client, "/v1/completions", api_token, {**RAW, "model": model}).get_json()
    message = whole["choices"][0]["message"]
    assert message["content"] == "Hello there."
    assert message["reasoning_content"] == "User says hi."
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1] if c["choices"]]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "User says hi."
    assert "".join(d.get("content", "") for d in deltas) == "Hello there."
    # The reasoning comes first, and no chunk shows a marker.
    firsts = [i for i, d in enumerate(deltas) if d.get("content")]
    assert max(i for i, d in enumerate(deltas) if d.get("reasoning_content")) <= min(firsts)
    assert not any("<|" in d.get("content", "") + d.get("reasoning_content", "") for d in deltas)
    # A raw completion is the text as generated, markers and all.
    assert raw["choices"][0]["text"] == HARMONY[-1][1]
