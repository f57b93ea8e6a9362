"""A job whose prompt and max_new_tokens pass the model's context is refused at submission,
from the form, the API and the CLI alike, and nothing is stored or queued."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from sqlalchemy import func, select

from models.jobs import Job
from specpipe.cli import cli
from specpipe.decoding.target import open_target
from tests.swarmprocs import write_tiny_model
from tests.web.conftest import Api, as_user, csrf_token

PROMPT = "hello world"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A checkpoint with a context of 256 tokens."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture
def fits(tiny) -> int:
    """The largest max_new_tokens that PROMPT leaves room for."""
    target = open_target(str(tiny))
    return target.context_length - len(target.prompt_ids(PROMPT))


@pytest.fixture
def tiny_app(make_app, tiny):
    return make_app(MODEL=str(tiny))


def count_jobs(session) -> int:
    session.expire_all()
    return session.scalar(select(func.count()).select_from(Job))


def test_the_form_refuses_a_job_beyond_the_context_and_keeps_what_was_typed(
    tiny_app, admin, session, queue, fits
):
    client = as_user(tiny_app.test_client(), admin)
    form = {
        "prompt": PROMPT,
        "max_new_tokens": str(fits + 1),
        "temp": "0.7",
        "top_p": "0.9",
        "top_k": "0",
        "seed": "1",
        "speculate": "on",
        "draft_k": "4",
    }
    response = client.post("/", data={**form, "csrf_token": csrf_token(client)})
    assert response.status_code == 400
    html = response.get_data(as_text=True)
    assert "beyond the model&#39;s context of 256 tokens" in html
    assert f'value="{fits + 1}"' in html
    assert count_jobs(session) == 0 and queue.job_ids() == []
    form["max_new_tokens"] = str(fits)
    assert client.post("/", data={**form, "csrf_token": csrf_token(client)}).status_code == 302
    assert count_jobs(session) == 1


def test_the_api_answers_400_naming_the_field(tiny_app, admin, api_token, session, queue, fits):
    api = Api(as_user(tiny_app.test_client(), admin), api_token)
    response = api.post("/jobs", json={"prompt": PROMPT, "max_new_tokens": fits + 1})
    assert response.status_code == 400
    reason = response.get_json()["fields"]["max_new_tokens"]
    assert reason == (
        f"the prompt is {256 - fits} tokens, and with max_new_tokens {fits + 1} the job needs "
        "257 positions, beyond the model's context of 256 tokens"
    )
    assert count_jobs(session) == 0 and queue.job_ids() == []
    assert api.post("/jobs", json={"prompt": PROMPT, "max_new_tokens": fits}).status_code == 201


def test_the_cli_refuses_it_in_one_line(tiny, fits, monkeypatch, db_url):
    monkeypatch.setenv("DATABASE_URL", db_url)
    monkeypatch.setenv("SPECPIPE_SWARM_KEY", "k" * 32)
    # No coordinator key pinned: the shared-key mode, opted into out loud.
    monkeypatch.setenv("SPECPIPE_INSECURE_SHARED_KEY", "1")
    monkeypatch.setenv("SPECPIPE_SWARM", "context-check-nobody")
    args = ["generate", PROMPT, "--model", str(tiny), "--max-new-tokens", str(fits + 1)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "--max-new-tokens the prompt is" in lines[0]
    assert "beyond the model's context of 256 tokens" in lines[0]


def test_a_chat_is_counted_as_its_messages_through_the_template(make_app, tiny, api_token, session):
    """Several messages are fed through the chat template, not as the readable transcript the
    job keeps as its prompt: that is what must fit."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": PROMPT},
    ]
    target = open_target(str(tiny))
    room = target.context_length - len(target.chat_ids(messages))
    client = make_app(MODEL=str(tiny), OPENAI_WAIT_S=0.0).test_client()
    headers = {"Authorization": f"Bearer {api_token}"}
    body = {"model": str(tiny), "messages": messages, "max_tokens": room + 1}
    refused = client.post("/v1/chat/completions", json=body, headers=headers)
    assert refused.status_code == 400 and refused.get_json()["error"]["param"] == "max_tokens"
    assert (
        f"the job needs {target.context_length + 1} positions"
        in refused.get_json()["error"]["message"]
    )
    assert count_jobs(session) == 0
    taken = client.post("/v1/chat/completions", json={**body, "max_tokens": room}, headers=headers)
    assert taken.status_code == 504 and count_jobs(session) == 1  # stored; nobody runs it here
