"""Several choices (`n`) and `response_format` on the OpenAI-compatible API, with the official
`openai` client against the web app served over HTTP, and the Flask client where the JSON of
each chunk matters.

A request for n choices is n jobs of its user, submitted together or not at all, seeded seed to
seed+n-1 when a seed is given; the answer gives each job's output as the choice of its index,
whole or streamed (the chunks of the choices interleaved as their jobs run), and a client that
leaves cancels them all. `FakeCoordinator` plays the coordinator, here with a worker per job
and a reply told apart by each job's seed. `response_format` asks for text, or is refused.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import openai
import pytest
from sqlalchemy import select
from werkzeug.serving import make_server

from models.db import make_session_factory, utcnow
from models.jobs import Job
from specpipe.core.sampling import MAX_SEED
from tests.factories import gen_job
from tests.web.test_openai_api import (
    MODEL,
    FakeCoordinator,
    assert_openai_error,
    events,
    job_count,
    post,
)

REPLIES = {  # each choice's rounds, by its job's seed
    7: [
        ([1], "Seven"),
        ([1, 2], "Seven is"),
        ([1, 2, 3], "Seven is odd"),
        ([1, 2, 3, 4], "Seven is odd."),
    ],
    8: [([5], "Eight"), ([5, 6], "Eight!")],
    9: [([7], "Nine"), ([7, 8], "Nine is"), ([7, 8, 9], "Nine is 9")],
}
TEXTS = ["Seven is odd.", "Eight!", "Nine is 9"]
# With `max_tokens` 4, the first used its whole budget and the others ended on their own.
FINISHES = ["length", "stop", "stop"]
ASK = [{"role": "user", "content": "Say something about a number."}]
RAW = {"model": MODEL, "prompt": "Count", "max_tokens": 4, "seed": 7, "n": 3}


def replies(job: Job) -> list:
    return REPLIES.get(job.seed, [([1], "x")])


@pytest.fixture
def serve():
    """Serve an app over HTTP; the official client for it, with a given key."""
    servers, clients = [], []

    def start(app, token: str) -> openai.OpenAI:
        httpd = make_server("127.0.0.1", 0, app, threaded=True)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        clients.append(
            openai.OpenAI(
                base_url=f"http://127.0.0.1:{httpd.server_port}/v1",
                api_key=token,
                max_retries=0,
                timeout=60,
            )
        )
        return clients[-1]

    yield start
    for client in clients:
        client.close()
    for httpd in servers:
        httpd.shutdown()


@pytest.fixture
def served(make_app, serve, api_token) -> openai.OpenAI:
    """The test app served over HTTP, for the official client."""
    return serve(make_app(OPENAI_POLL_S=0.02), api_token)


def stored(session, ids: list[int]) -> list[Job]:
    session.expire_all()
    return [session.get(Job, job_id) for job_id in ids]


def wait_for(check, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    return check()


def jobs_of(session, count: int) -> list[Job]:
    session.expire_all()
    jobs = session.scalars(select(Job).order_by(Job.id)).all()
    assert len(jobs) == count
    return jobs


def all_are(session, count: int, status: str) -> bool:
    """Whether the store holds `count` jobs, every one of them `status`."""
    session.expire_all()
    jobs = session.scalars(select(Job)).all()
    return len(jobs) == count and all(job.status == status for job in jobs)


def test_n_choices_come_whole_each_the_output_of_its_job(served, db_url, session):
    with FakeCoordinator(db_url, replies, pause_s=0.02, workers=3):
        raw = served.completions.create(**RAW)
        chat = served.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=4, seed=7, n=3, temperature=0.5
        )
    assert [c.index for c in raw.choices] == [0, 1, 2]
    assert [c.text for c in raw.choices] == TEXTS
    assert [c.finish_reason for c in raw.choices] == FINISHES
    # The prompt once (every choice is fed the same), the completions of all choices together.
    assert (raw.usage.prompt_tokens, raw.usage.completion_tokens) == (3, 4 + 2 + 3)
    assert raw.usage.total_tokens == 12
    extension = raw.model_extra["specpipe"]
    ids = [choice["job_id"] for choice in extension["choices"]]
    jobs = stored(session, ids)
    assert [job.seed for job in jobs] == [7, 8, 9] and not any(j.seed_was_random for j in jobs)
    assert [choice["seed"] for choice in extension["choices"]] == [7, 8, 9]
    assert all(j.prompt == "Count" and j.raw_prompt and j.max_new_tokens == 4 for j in jobs)
    assert raw.id == f"cmpl-{ids[0]}" and extension["job_id"] == ids[0]  # the first's
    assert len(set(ids)) == 3 and all(job.status == "done" for job in jobs)

    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert [c.message.content for c in chat.choices] == TEXTS
    assert [c.finish_reason for c in chat.choices] == FINISHES
    assert chat.usage.completion_tokens == 9
    chat_jobs = stored(session, [c["job_id"] for c in chat.model_extra["specpipe"]["choices"]])
    assert [job.seed for job in chat_jobs] == [7, 8, 9]
    assert all(job.temp == 0.5 and job.prompt == ASK[0]["content"] for job in chat_jobs)


def test_n_choices_stream_interleaved_each_ending_with_its_finish(served, db_url, session):
    with FakeCoordinator(db_url, replies, pause_s=0.1, workers=3):
        chunks = list(
            served.chat.completions.create(
                model=MODEL,
                messages=ASK,
                max_tokens=4,
                seed=7,
                n=3,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    *parts, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 9
    assert last.usage.prompt_tokens == 3
    assert all(len(c.choices) == 1 for c in parts) and len({c.id for c in chunks}) == 1
    for index, (text, finish) in enumerate(zip(TEXTS, FINISHES, strict=True)):
        mine = [c for c in parts if c.choices[0].index == index]
        assert mine[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in mine) == text
        assert [c.choices[0].finish_reason for c in mine] == [None] * (len(mine) - 1) + [finish]
        # Each chunk tells of its own choice's job.
        seeds = {c.model_extra["specpipe"]["seed"] for c in mine}
        assert seeds == {7 + index}
    # The jobs ran side by side, and their chunks came as they came: the second choice's text
    # began before the first choice had finished.
    order = [
        (c.choices[0].index, c.choices[0].delta.content, c.choices[0].finish_reason) for c in parts
    ]
    second_text = next(i for i, (index, text, _) in enumerate(order) if index == 1 and text)
    first_end = next(i for i, (index, _, finish) in enumerate(order) if index == 0 and finish)
    assert second_text < first_end


def test_a_streamed_completion_names_each_chunks_index(app, db_url, api_token):
    client = app.test_client()
    body = {**RAW, "stream": True, "stream_options": {"include_usage": True}}
    with FakeCoordinator(db_url, replies, pause_s=0.05, workers=3):
        chunks = events(post(client, "/v1/completions", api_token, body))
    assert chunks[-1] == "[DONE]" and chunks.count("[DONE]") == 1
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"]["completion_tokens"] == 9
    parts = chunks[:-2]
    assert all(len(c["choices"]) == 1 and c["object"] == "text_completion" for c in parts)
    for index, (text, finish) in enumerate(zip(TEXTS, FINISHES, strict=True)):
        mine = [c["choices"][0] for c in parts if c["choices"][0]["index"] == index]
        assert "".join(choice["text"] for choice in mine) == text
        assert [choice["finish_reason"] for choice in mine][-1] == finish
        assert sum(choice["finish_reason"] is not None for choice in mine) == 1
    # The stream ends once the last choice has: its finish is the last chunk before usage.
    assert parts[-1]["choices"][0]["finish_reason"] is not None


def test_without_a_seed_each_choice_draws_its_own(served, db_url, session):
    with FakeCoordinator(db_url, [([1], "x")], pause_s=0.02, workers=2):
        answer = served.completions.create(model=MODEL, prompt="Count", max_tokens=4, n=3)
    choices = answer.model_extra["specpipe"]["choices"]
    jobs = stored(session, [c["job_id"] for c in choices])
    assert all(job.seed_was_random for job in jobs)
    assert [c["seed"] for c in choices] == [job.seed for job in jobs]
    assert len({job.seed for job in jobs}) == 3  # 64-bit draws: alike only by a miracle


def test_the_seeds_of_the_choices_stay_within_the_largest(served, db_url, session):
    with pytest.raises(openai.BadRequestError) as caught:
        served.completions.create(model=MODEL, prompt="Count", seed=MAX_SEED - 1, n=3)
    error = caught.value.response.json()["error"]
    assert error["param"] == "seed" and "seed+n-1" in error["message"]
    assert job_count(session) == 0
    with FakeCoordinator(db_url, [([1], "x")], pause_s=0.02, workers=2):
        answer = served.completions.create(model=MODEL, prompt="Count", seed=MAX_SEED - 1, n=2)
    seeds = [c["seed"] for c in answer.model_extra["specpipe"]["choices"]]
    assert seeds == [MAX_SEED - 1, MAX_SEED]


@pytest.mark.parametrize("n", [0, -1, 9, 100, "2", 2.0, 2.5, True, [2]])
def test_a_bad_n_is_refused_and_makes_no_job(client, session, queue, api_token, n):
    for path, body in (
        ("/v1/completions", RAW),
        ("/v1/chat/completions", {"model": MODEL, "messages": ASK}),
    ):
        error = assert_openai_error(post(client, path, api_token, {**body, "n": n}), 400, "n")
        assert "n must be" in error["message"]
    assert job_count(session) == 0 and queue.messages() == []


def test_n_is_bounded_by_the_active_jobs_cap_and_refused_whole_over_it(
    make_app, session, queue, api_token, serve
):
    app = make_app(MAX_ACTIVE_JOBS=4, OPENAI_WAIT_S=0.0)
    client = serve(app, api_token)
    with pytest.raises(openai.BadRequestError, match="n must be between 1 and 4"):
        client.completions.create(model=MODEL, prompt="Count", n=5)  # could never be taken
    held = [gen_job(session, status="running").id for _ in range(2)]
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model=MODEL, prompt="Count", n=3)
    # The error a single job over the cap gets: a 429 with Retry-After, and nothing made.
    assert int(caught.value.response.headers["Retry-After"]) >= 1
    error = caught.value.response.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "asked for 3 more" in error["message"]
    assert job_count(session) == 2 and queue.messages() == []
    # Two more fit: taken (nobody runs them here, so the wait ends at once, cancelling both).
    with pytest.raises(openai.InternalServerError):  # the 504 of a wait run out
        client.completions.create(model=MODEL, prompt="Count", n=2)
    assert job_count(session) == 4 and len(queue.job_ids()) == 2
    made = session.scalars(select(Job).where(Job.id.not_in(held))).all()
    assert [job.status for job in made] == ["cancelled", "cancelled"]


def test_n_choices_count_against_the_submission_rate(make_app, session, api_token):
    client = make_app(SUBMIT_RATE="3/minute", OPENAI_WAIT_S=0.0).test_client()
    assert_openai_error(post(client, "/v1/completions", api_token, RAW), 504)  # 3 jobs taken
    assert job_count(session) == 3
    refused = post(client, "/v1/completions", api_token, {**RAW, "n": 1})
    assert_openai_error(refused, 429)
    assert int(refused.headers["Retry-After"]) >= 1 and job_count(session) == 3


def test_a_queue_that_fails_midway_fails_every_choice(app, session, queue, api_token, monkeypatch):
    submitter = app.extensions["specpipe.submitter"]
    publish, sent = submitter.enqueue, []

    def enqueue(job_id: int) -> str:
        if sent:
            raise ConnectionError("the broker went away")
        sent.append(job_id)
        return publish(job_id)

    monkeypatch.setattr(submitter, "enqueue", enqueue)
    error = assert_openai_error(post(app.test_client(), "/v1/completions", api_token, RAW), 503)
    jobs = session.scalars(select(Job).order_by(Job.id)).all()
    assert str(jobs[0].id) in error["message"] and "could not be queued" in error["message"]
    assert [job.status for job in jobs] == ["failed"] * 3
    assert all("could not reach the job queue" in job.error for job in jobs)
    assert queue.job_ids() == sent == [jobs[0].id]  # its message went out: it fails all the same


def test_a_choice_a_coordinator_took_meanwhile_is_cancelled_with_the_rest(
    app, db_url, session, queue, monkeypatch
):
    from workers.submission import QueueUnavailable

    submitter = app.extensions["specpipe.submitter"]
    calls = []

    def enqueue(job_id: int) -> str:
        calls.append(job_id)
        if len(calls) == 1:
            return "task-1"
        with make_session_factory(db_url)() as other:  # a coordinator took the first job
            other.get(Job, calls[0]).status = "running"
            other.commit()
        raise ConnectionError("the broker went away")

    monkeypatch.setattr(submitter, "enqueue", enqueue)
    params = submitter.check({"prompt": "hi"})
    with pytest.raises(QueueUnavailable) as caught:
        submitter.submit_all(session, [params, params, params])
    assert [job.id for job in caught.value.jobs][:2] == calls and len(caught.value.jobs) == 3
    first, *rest = stored(session, [job.id for job in caught.value.jobs])
    assert first.status == "running" and first.cancel_requested  # it stops at its next round
    assert [job.status for job in rest] == ["failed", "failed"]


def test_a_client_that_leaves_a_stream_cancels_every_choice(app, db_url, session, api_token):
    client = app.test_client()
    long = [(list(range(k)), "x" * k) for k in range(1, 40)]
    with FakeCoordinator(db_url, long, pause_s=0.1, workers=3):
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
        extension = json.loads(first[len(b"data: ") :])["specpipe"]
        assert wait_for(lambda: all_are(session, 3, "running"))
        response.close()  # the client hangs up
        assert wait_for(lambda: all_are(session, 3, "cancelled"))
    jobs = jobs_of(session, 3)
    assert extension["job_id"] == jobs[0].id
    assert all(job.cancel_requested and len(job.output_ids or []) < 39 for job in jobs)


def test_a_client_that_hangs_up_on_a_whole_answer_cancels_every_choice(
    app, db_url, session, api_token
):
    """Under waitress, as `specpipe web` serves (it learns that a waiting client has gone)."""
    import waitress

    server = waitress.create_server(
        app, host="127.0.0.1", port=0, threads=2, channel_request_lookahead=1
    )
    threading.Thread(target=server.run, daemon=True).start()
    body = json.dumps({**RAW, "max_tokens": 64, "n": 2}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
        f"Authorization: Bearer {api_token}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    long = [(list(range(k)), "x" * k) for k in range(1, 60)]
    try:
        with FakeCoordinator(db_url, long, pause_s=0.1, workers=2):
            client = socket.create_connection(("127.0.0.1", server.effective_port), timeout=10)
            client.sendall(request)
            assert wait_for(lambda: all_are(session, 2, "running"))
            client.close()  # the client hangs up before its answer
            assert wait_for(lambda: all_are(session, 2, "cancelled"))
        assert all(len(job.output_ids or []) < 59 for job in jobs_of(session, 2))
    finally:
        server.close()


def test_a_choice_that_fails_fails_the_answer_and_cancels_the_rest(app, db_url, session, api_token):
    def fail_the_first() -> None:
        with make_session_factory(db_url)() as other:
            for _ in range(200):
                queued = select(Job).where(Job.status == "queued").order_by(Job.id)
                job = other.scalars(queued).first()
                if job is not None:
                    job.status, job.error = "failed", "no stage serves 2-4"
                    job.finished_at = utcnow()
                    other.commit()
                    return
                other.rollback()
                time.sleep(0.02)

    client = app.test_client()
    for stream in (False, True):
        thread = threading.Thread(target=fail_the_first)
        thread.start()
        response = post(client, "/v1/completions", api_token, {**RAW, "n": 2, "stream": stream})
        thread.join()
        if stream:
            error = events(response)[-1]["error"]
            assert "[DONE]" not in events(response)
        else:
            error = assert_openai_error(response, 500)
        assert "no stage serves 2-4" in error["message"]
        first, second = session.scalars(select(Job).order_by(Job.id.desc()).limit(2)).all()[::-1]
        session.refresh(first)
        session.refresh(second)
        assert (first.status, second.status) == ("failed", "cancelled")


def test_logprobs_come_per_choice(served, app, db_url, api_token):
    with FakeCoordinator(db_url, replies, pause_s=0.02, workers=3):
        raw = served.completions.create(**{**RAW, "logprobs": 1})
        chunks = events(
            post(
                app.test_client(),
                "/v1/chat/completions",
                api_token,
                {
                    "model": MODEL,
                    "messages": ASK,
                    "max_tokens": 4,
                    "seed": 7,
                    "n": 3,
                    "logprobs": True,
                    "top_logprobs": 1,
                    "stream": True,
                },
            )
        )
    tokens = [len(REPLIES[seed][-1][0]) for seed in (7, 8, 9)]
    assert [len(c.logprobs.token_logprobs) for c in raw.choices] == tokens
    assert all(set(c.logprobs.token_logprobs) == {-0.5} for c in raw.choices)
    for index, count in enumerate(tokens):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
        content = [entry for c in mine if c["logprobs"] for entry in c["logprobs"]["content"]]
        assert len(content) == count


@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
def test_json_response_formats_are_refused_as_no_constrained_decoding(served, session, kind):
    response_format = {"type": kind}
    if kind == "json_schema":
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        response_format["json_schema"] = {"name": "answer", "schema": schema}
    with pytest.raises(openai.BadRequestError) as caught:
        served.chat.completions.create(model=MODEL, messages=ASK, response_format=response_format)
    error = caught.value.response.json()["error"]
    assert error["param"] == "response_format" and "constrained decoding" in error["message"]
    with pytest.raises(openai.BadRequestError, match="constrained decoding"):
        served.completions.create(
            model=MODEL, prompt="Count", extra_body={"response_format": response_format}
        )
    assert job_count(session) == 0


def test_a_text_response_format_is_the_default(served, db_url, session):
    with FakeCoordinator(db_url, [([1], "plain")], pause_s=0.02):
        chat = served.chat.completions.create(
            model=MODEL, messages=ASK, response_format={"type": "text"}
        )
        raw = served.completions.create(
            model=MODEL, prompt="Count", extra_body={"response_format": {"type": "text"}}
        )
    assert chat.choices[0].message.content == raw.choices[0].text == "plain"


@pytest.mark.parametrize(
    "response_format",
    ["json", "text", 1, [], ["text"], {}, {"type": "xml"}, {"type": 1}, {"type": "text", "x": 1}],
)
def test_a_malformed_response_format_is_400(client, session, api_token, response_format):
    for path, body in (
        ("/v1/completions", RAW),
        ("/v1/chat/completions", {"model": MODEL, "messages": ASK}),
    ):
        response = post(client, path, api_token, {**body, "response_format": response_format})
        assert_openai_error(response, 400, "response_format")
    assert job_count(session) == 0
