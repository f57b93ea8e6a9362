"""The job form: every field checked, CSRF enforced, jobs stored and really enqueued."""

from __future__ import annotations

import re
import threading

import pytest
import redis
from sqlalchemy import func, select

from models.jobs import Job
from specpipe.ops.redis_server import RedisServer, free_port
from tests.web.conftest import csrf_token

GOOD = {
    "prompt": "Once upon a time",
    "max_new_tokens": "64",
    "temp": "0.7",
    "top_p": "0.9",
    "top_k": "40",
    "seed": "42",
    "speculate": "on",
    "draft_k": "4",
}


def post_form(client, **changes):
    data = {**GOOD, "csrf_token": csrf_token(client), **changes}
    data = {k: v for k, v in data.items() if v is not None}
    return client.post("/", data=data)


def job_count(session) -> int:
    session.expire_all()
    return session.scalar(select(func.count()).select_from(Job))


def test_form_page_renders_fields(client):
    html = client.get("/").get_data(as_text=True)
    for name in (
        "prompt",
        "max_new_tokens",
        "temp",
        "top_p",
        "top_k",
        "seed",
        "draft_k",
        "speculate",
        "stop",
        "sampler",
        "csrf_token",
    ):
        assert f'name="{name}"' in html
    assert re.search(r'<option value="gumbel"\s*selected>', html)  # the default
    assert re.search(r'<option value="icdf"\s*>', html)
    assert "blank = random; 0 – 2^64-1" in html  # the seeds the sampler takes


def test_submit_creates_enqueues_redirects(client, session, queue):
    response = post_form(client)
    assert response.status_code == 302
    job = session.scalars(select(Job)).one()
    assert response.headers["Location"].endswith(f"/jobs/{job.id}")
    assert (
        job.prompt,
        job.max_new_tokens,
        job.temp,
        job.top_p,
        job.top_k,
        job.seed,
        job.draft_k,
        job.status,
    ) == ("Once upon a time", 64, 0.7, 0.9, 40, 42, 4, "queued")
    assert job.stop == []  # the field was left blank
    assert job.seed_was_random is False and job.model == "tiny-test"
    assert queue.job_ids() == [job.id]
    assert job.task_id == queue.messages()[0]["headers"]["id"]


def test_blank_seed_is_random_and_recorded(client, session, queue):
    post_form(client, seed="   ")
    post_form(client, seed="")
    jobs = session.scalars(select(Job).order_by(Job.id)).all()
    assert all(j.seed_was_random for j in jobs)
    assert all(0 <= j.seed < 2**64 for j in jobs)
    assert jobs[0].seed != jobs[1].seed  # 64 random bits: equal only by a 2^-64 fluke


def test_stop_strings_one_per_line_blank_lines_skipped(client, session, queue):
    response = post_form(client, stop="User:\r\n\r\n   \r\n  END  \n###")
    assert response.status_code == 302
    assert session.scalars(select(Job)).one().stop == ["User:", "  END  ", "###"]
    assert len(queue.job_ids()) == 1


def test_speculation_off_stores_draft_k_zero(client, session, queue):
    post_form(client, speculate=None, draft_k="7")
    assert session.scalars(select(Job)).one().draft_k == 0


def test_the_chosen_sampler_is_the_jobs(client, session, queue):
    post_form(client, sampler="icdf")
    post_form(client)  # a form without the field: the default
    jobs = session.scalars(select(Job).order_by(Job.id)).all()
    assert [j.sampler for j in jobs] == ["icdf", "gumbel"]
    assert queue.job_ids() == [j.id for j in jobs]


def test_largest_seed_accepted(client, session, queue):
    post_form(client, seed=str(2**64 - 1))
    assert session.scalars(select(Job)).one().seed == 2**64 - 1


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"prompt": ""}, "Prompt is empty"),
        ({"prompt": "   \n\t "}, "Prompt is empty"),
        ({"prompt": "x" * 501}, "Prompt is longer than 500 characters"),
        ({"prompt": "a\x00b"}, "Prompt must not contain NUL characters"),
        ({"max_new_tokens": ""}, "Max new tokens is required"),
        ({"max_new_tokens": "-5"}, "Max new tokens must be between 1 and 1024"),
        ({"max_new_tokens": "0"}, "Max new tokens must be between 1 and 1024"),
        ({"max_new_tokens": "99999999999999999999"}, "Max new tokens must be between 1 and 1024"),
        ({"max_new_tokens": "1.5"}, "Max new tokens must be a whole number"),
        ({"temp": "nan"}, "Temperature must be a finite number"),
        ({"temp": "inf"}, "Temperature must be a finite number"),
        ({"temp": "-0.5"}, "Temperature must be between 0 (greedy) and 100"),
        ({"temp": "warm"}, "Temperature must be a number"),
        ({"top_p": "0"}, "Top-p must be above 0 and at most 1"),
        ({"top_p": "1.01"}, "Top-p must be above 0 and at most 1"),
        ({"top_p": "-1"}, "Top-p must be above 0 and at most 1"),
        ({"top_k": "-1"}, "Top-k must be 0 (off) or a positive whole number"),
        ({"seed": "-1"}, "Seed must be between 0 and 2^64-1"),
        ({"seed": str(2**64)}, "Seed must be between 0 and 2^64-1"),
        ({"seed": "12abc"}, "Seed must be a whole number"),
        ({"seed": "4.2"}, "Seed must be a whole number"),
        ({"draft_k": "0"}, "Draft K must be at least 1 when speculation is on"),
        ({"draft_k": "999"}, "Draft K must be between 0 (no speculation) and 32"),
        ({"stop": "a\nb\nc\nd\ne"}, "Stop strings must be at most 4 strings, not 5"),
        ({"stop": "ok\n" + "x" * 65}, "Stop strings must each be at most 64 characters"),
        ({"stop": "a\x00b"}, "Stop strings must not contain NUL characters"),
        ({"sampler": "exact"}, "Sampler must be one of icdf, gumbel"),
        ({"sampler": " gumbel"}, "Sampler must be one of icdf, gumbel"),
    ],
)
def test_bad_field_rerenders_with_error_and_stores_nothing(
    client, session, queue, changes, message
):
    response = post_form(client, **changes)
    assert response.status_code == 400
    html = response.get_data(as_text=True)
    assert message.replace("&", "&amp;") in html.replace("&#39;", "'")
    assert 'aria-invalid="true"' in html
    assert job_count(session) == 0
    assert queue.messages() == []


def test_several_bad_fields_reported_together(client, session, queue):
    html = post_form(client, prompt="", temp="nan", top_p="2").get_data(as_text=True)
    assert "Prompt is empty" in html and "Temperature must be a finite" in html
    assert "Top-p must be above 0" in html and "fix the 3 fields" in html


def test_rerender_keeps_what_was_typed(client, queue):
    html = post_form(
        client, prompt="keep <me>", temp="nan", stop="<end>\nEND", sampler="icdf"
    ).get_data(as_text=True)
    assert "keep &lt;me&gt;</textarea>" in html
    assert re.search(r'<option value="icdf"\s*selected>', html)
    assert "&lt;end&gt;\nEND</textarea>" in html


def test_invalid_utf8_prompt_rejected(client, session, queue):
    body = (
        "csrf_token=" + csrf_token(client) + "&prompt=%FF%FEhi&max_new_tokens=5&temp=1"
        "&top_p=1&top_k=0&seed=&speculate=on&draft_k=4"
    )
    response = client.post("/", data=body, content_type="application/x-www-form-urlencoded")
    assert response.status_code == 400
    assert "Prompt is not valid UTF-8" in response.get_data(as_text=True)
    assert job_count(session) == 0 and queue.messages() == []


def test_csrf_enforced(client, session, queue):
    data = dict(GOOD)
    response = client.post("/", data=data)
    assert response.status_code == 400
    assert "CSRF" in response.get_data(as_text=True)
    response = client.post("/", data={**data, "csrf_token": "forged"})
    assert response.status_code == 400
    assert job_count(session) == 0 and queue.messages() == []


def test_csrf_enforced_on_cancel_and_rerun(client, session, queue):
    post_form(client)
    job = session.scalars(select(Job)).one()
    assert client.post(f"/jobs/{job.id}/cancel").status_code == 400
    assert client.post(f"/jobs/{job.id}/rerun").status_code == 400
    session.expire_all()
    assert session.get(Job, job.id).status == "queued" and job_count(session) == 1


def test_prompt_html_is_escaped_everywhere(client, session, queue):
    nasty = '<script>alert("x")</script><img src=x onerror=alert(1)>'
    post_form(client, prompt=nasty)
    job = session.scalars(select(Job)).one()
    for path in (f"/jobs/{job.id}", "/history"):
        html = client.get(path).get_data(as_text=True)
        assert "<script>alert" not in html and "<img src=x" not in html
        assert "&lt;script&gt;alert(" in html


def test_queue_down_marks_job_failed_no_500(app, client, session):
    submitter = app.extensions["specpipe.submitter"]
    submitter.queue = "unused"
    submitter.client.conf.broker_url = "redis://127.0.0.1:1/0"
    response = post_form(client)
    assert response.status_code == 302
    job = session.scalars(select(Job)).one()
    assert job.status == "failed" and "could not reach the job queue" in job.error
    assert "was saved but not queued" in client.get(response.headers["Location"]).get_data(
        as_text=True
    )


def test_a_broker_that_is_restarting_is_waited_out(app, client, session):
    submitter = app.extensions["specpipe.submitter"]
    port = free_port()
    submitter.client.conf.broker_url = f"redis://127.0.0.1:{port}/0"
    broker = RedisServer(port=port)
    late = threading.Timer(1.0, broker.start)  # up a second after the submission began
    late.start()
    try:
        response = post_form(client)
        late.join()
        assert response.status_code == 302
        job = session.scalars(select(Job)).one()
        assert job.status == "queued" and job.error is None
        queued = redis.Redis.from_url(broker.url)
        assert queued.llen(submitter.queue) == 1
        queued.close()
    finally:
        late.cancel()
        broker.stop()
