"""The official `openai` client against a real swarm: two `specpipe worker stage` processes
serving a tiny checkpoint, a real Celery coordinator process, a private Redis, and the web app
served over HTTP.

Greedy chat and raw completions give what `specpipe generate --local` gives; a streamed answer
is the whole answer in pieces; a seeded sample repeats exactly; log-probabilities are the
target distribution at each position, computed here again from the model's own logits, and the
same with drafts as without; n choices with a seed are the single requests of seed, seed+1, ...,
whole and streamed; errors arrive as the client's typed exceptions; a client that leaves a
stream cancels its job.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import urllib.request
import uuid

import numpy as np
import openai
import pytest
import torch
from click.testing import CliRunner
from sqlalchemy import select
from werkzeug.serving import make_server

from app import create_app
from models.db import make_session_factory
from models.jobs import Job
from models.tokens import create_token
from models.users import create_user
from specpipe.cli import cli
from specpipe.core.sampling import target_probs
from specpipe.decoding.target import open_target
from specpipe.ops.redis_server import RedisServer
from tests.factories import gen_job
from tests.swarmprocs import Swarm, write_tiny_model

PROMPT = "hello world"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture(scope="module")
def stack(tiny, database_url, tmp_path_factory):
    """The swarm, the web app on a free port, and an API token of a user of its store."""
    with RedisServer(password=secrets.token_hex(16)) as server:
        swarm = Swarm(
            server.url,
            f"oa{uuid.uuid4().hex[:8]}",
            secrets.token_hex(16),
            tiny,
            DATABASE_URL=database_url,
        )
        httpd = None
        try:
            swarm.start_stage("s0", "0:2")
            swarm.start_stage("s1", "2:4")
            swarm.start_coordinator(log=tmp_path_factory.mktemp("logs") / "coordinator.log")
            app = create_app(
                {
                    "TESTING": True,
                    "DATABASE_URL": database_url,
                    "REDIS_URL": server.url,
                    "MODEL": str(tiny),
                    "OPENAI_POLL_S": 0.02,
                    "OPENAI_WAIT_S": 120.0,
                    "RATELIMIT_KEY_PREFIX": f"oa-{uuid.uuid4().hex[:8]}",
                }
            )
            with make_session_factory(database_url)() as session:
                user = create_user(session, f"oa-{uuid.uuid4().hex[:6]}", None)
                token = create_token(session, f"oa-{uuid.uuid4().hex[:6]}", user=user)
                session.commit()
                user_id = user.id
            httpd = make_server("127.0.0.1", 0, app, threaded=True)
            threading.Thread(target=httpd.serve_forever, daemon=True).start()
            swarm.wait_stages(["s0", "s1"])
            yield {
                "url": f"http://127.0.0.1:{httpd.server_port}",
                "token": token,
                "user_id": user_id,
                "db": database_url,
                "env": {  # what `specpipe generate` needs to submit to this swarm
                    **{k: v for k, v in swarm.env.items() if k.startswith(("SPECPIPE_", "REDIS_"))},
                    "DATABASE_URL": database_url,
                },
            }
        finally:
            if httpd is not None:
                httpd.shutdown()
            swarm.stop()


@pytest.fixture
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=stack["url"] + "/v1", api_key=stack["token"], max_retries=0, timeout=120
    )


def local(tiny, *extra: str, max_new_tokens: int = 30) -> dict:
    """`specpipe generate --local` over two stages in this process, greedy."""
    return generate(tiny, "--local", "--stages", "2", *extra, max_new_tokens=max_new_tokens)


def generate(tiny, *extra: str, max_new_tokens: int = 30, env: dict | None = None) -> dict:
    """`specpipe generate`, greedy, as JSON: on the swarm `env` names, unless `--local`."""
    args = [
        "generate",
        PROMPT,
        "--model",
        str(tiny),
        "--json",
        "--temp",
        "0",
        "--seed",
        "0",
        "--max-new-tokens",
        str(max_new_tokens),
        *extra,
    ]
    result = CliRunner().invoke(cli, args, env=env)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def stored(stack, job_id: int) -> Job:
    with make_session_factory(stack["db"])() as session:
        job = session.get(Job, job_id)
        session.expunge(job)
        return job


def test_greedy_chat_and_raw_completions_equal_specpipe_generate(tiny, stack, client):
    chat = client.chat.completions.create(
        model=str(tiny),
        messages=[{"role": "user", "content": PROMPT}],
        temperature=0,
        max_tokens=30,
    )
    want = local(tiny)
    assert chat.choices[0].message.content == want["text"] and want["tokens"]
    job = stored(stack, chat.model_extra["specpipe"]["job_id"])
    assert job.output_ids == want["tokens"] and job.user_id == stack["user_id"]
    assert chat.id == f"chatcmpl-{job.id}" and chat.system_fingerprint.startswith("fp_")
    assert chat.usage.completion_tokens == len(want["tokens"])
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    length = len(want["tokens"]) == 30
    assert chat.choices[0].finish_reason == ("length" if length else "stop")

    raw = client.completions.create(model=str(tiny), prompt=PROMPT, temperature=0, max_tokens=30)
    want_raw = local(tiny, "--raw")
    assert raw.choices[0].text == want_raw["text"]
    assert stored(stack, raw.model_extra["specpipe"]["job_id"]).output_ids == want_raw["tokens"]
    assert raw.usage.prompt_tokens < chat.usage.prompt_tokens  # no chat template around it
    # `specpipe generate --raw` runs on the swarm as /v1/completions does: the same job.
    on_swarm = generate(tiny, "--raw", env=stack["env"])
    assert (on_swarm["text"], on_swarm["tokens"]) == (want_raw["text"], want_raw["tokens"])
    with make_session_factory(stack["db"])() as session:
        newest = session.scalars(select(Job).order_by(Job.id.desc())).first()
        assert newest.raw_prompt and newest.output_ids == want_raw["tokens"]
    # Both are jobs of the key's owner, in their history.
    ask = urllib.request.Request(
        stack["url"] + "/api/v1/jobs", headers={"Authorization": f"Bearer {stack['token']}"}
    )
    with urllib.request.urlopen(ask) as response:
        history = json.load(response)
    assert {j["id"] for j in history["jobs"]} >= {job.id, raw.model_extra["specpipe"]["job_id"]}


def test_streamed_equals_whole_and_a_seeded_sample_repeats(tiny, stack, client):
    request = dict(
        model=str(tiny),
        messages=[{"role": "system", "content": "be kind"}, {"role": "user", "content": PROMPT}],
        temperature=0.9,
        top_p=0.95,
        seed=5,
        max_tokens=40,
    )
    whole = client.chat.completions.create(**request)
    again = client.chat.completions.create(**request)
    stream = client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == again.choices[0].message.content == text != ""
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and set(finishes[:-1]) == {None}
    job = stored(stack, whole.model_extra["specpipe"]["job_id"])
    assert job.messages == request["messages"] and job.seed == 5
    # A seedless request reports its drawn seed, which replays it exactly.
    del request["seed"]
    drawn = client.completions.create(
        model=str(tiny), prompt=PROMPT, temperature=1.0, max_tokens=20
    )
    seed = drawn.model_extra["specpipe"]["seed"]
    assert drawn.model_extra["specpipe"]["seed_was_random"]
    replay = client.completions.create(
        model=str(tiny), prompt=PROMPT, temperature=1.0, max_tokens=20, seed=seed
    )
    assert replay.choices[0].text == drawn.choices[0].text


def test_logprobs_are_the_target_distribution_with_drafts_or_without(tiny, stack, client):
    temp, top_p, top_k = 0.8, 0.9, 20
    answers = [
        client.completions.create(
            model=str(tiny),
            prompt=PROMPT,
            temperature=temp,
            top_p=top_p,
            max_tokens=40,
            seed=3,
            logprobs=3,
            extra_body={"top_k": top_k, "draft_k": k},
        )
        for k in (0, 4)
    ]
    plain, spec = (stored(stack, a.model_extra["specpipe"]["job_id"]) for a in answers)
    assert plain.output_ids == spec.output_ids and len(plain.output_ids) >= 10
    assert plain.output_logprobs == spec.output_logprobs  # the same numbers, bit for bit
    # The model's logits at every position, computed here from the checkpoint.
    target = open_target(str(tiny))
    ids = target.prompt_ids(PROMPT, raw=True)
    hidden = torch.tensor(ids + plain.output_ids, dtype=torch.long)
    for stage in target.load_stages(2):
        hidden = stage.forward("check", hidden, 0)
    logits = hidden.double().numpy()
    for j, (token, (logprob, top)) in enumerate(
        zip(plain.output_ids, plain.output_logprobs, strict=True)
    ):
        with np.errstate(divide="ignore"):
            want = np.log(target_probs(logits[len(ids) - 1 + j], temp, top_p, top_k))
        assert logprob == pytest.approx(want[token], abs=1e-4)
        finite = np.flatnonzero(np.isfinite(want))  # the cut tokens are no alternatives
        best = finite[np.argsort(-want[finite], kind="stable")][:3]
        assert [i for i, _ in top] == best.tolist()
    lp = answers[0].choices[0].logprobs
    assert lp.token_logprobs == [entry[0] for entry in plain.output_logprobs]
    assert [len(alternatives) for alternatives in lp.top_logprobs] == [
        len(top) for _, top in plain.output_logprobs
    ]
    chat = client.chat.completions.create(
        model=str(tiny),
        temperature=0,
        max_tokens=5,
        messages=[{"role": "user", "content": PROMPT}],
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(c.logprob <= 0 for c in content)
    # Greedy: the token committed is the most likely one.
    assert all(c.top_logprobs[0].logprob == c.logprob for c in content)


def test_n_choices_are_the_single_requests_of_their_seeds(tiny, stack, client):
    request = dict(model=str(tiny), prompt=PROMPT, temperature=1.0, max_tokens=20)
    both = client.completions.create(**request, seed=11, n=2)
    singles = [client.completions.create(**request, seed=seed) for seed in (11, 12)]
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [s.choices[0].text for s in singles]
    assert singles[0].choices[0].text != singles[1].choices[0].text  # two seeds, two samples
    assert [c.finish_reason for c in both.choices] == [s.choices[0].finish_reason for s in singles]
    assert both.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert both.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    choices = both.model_extra["specpipe"]["choices"]
    jobs = [stored(stack, choice["job_id"]) for choice in choices]
    alone = [stored(stack, s.model_extra["specpipe"]["job_id"]) for s in singles]
    assert [j.seed for j in jobs] == [11, 12] and all(j.status == "done" for j in jobs)
    assert [j.output_ids for j in jobs] == [j.output_ids for j in alone]
    # Streamed, the chunks of both choices put together by index are the same texts.
    chunks = list(client.completions.create(**request, seed=11, n=2, stream=True))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in (0, 1)]
    assert texts == [s.choices[0].text for s in singles]
    finishes = [
        [c.choices[0].finish_reason for c in chunks if c.choices[0].index == i] for i in (0, 1)
    ]
    assert [f[-1] for f in finishes] == [c.finish_reason for c in both.choices]


def test_errors_arrive_as_typed_exceptions(tiny, stack, client):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack["url"] + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError, match="n must be between 1 and 8"):
        client.completions.create(model=str(tiny), prompt=PROMPT, n=9)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=str(tiny), messages=[], max_tokens=3)
    models = client.models.list()
    assert [m.id for m in models.data] == [str(tiny)]
    # The store's nodes, which other tests' swarms may have added to: this swarm's among them.
    assert {n["host"] for n in models.data[0].model_extra["ring"]} >= {"s0", "s1"}
    # A user at the active-jobs cap gets 429 with Retry-After: the client's RateLimitError.
    with make_session_factory(stack["db"])() as session:
        busy = create_user(session, f"busy-{uuid.uuid4().hex[:6]}", None)
        token = create_token(session, f"busy-{uuid.uuid4().hex[:6]}", user=busy)
        session.commit()
        held = [
            gen_job(session, owner=busy, status="running", model=str(tiny)).id for _ in range(50)
        ]  # the default cap
    limited = openai.OpenAI(base_url=stack["url"] + "/v1", api_key=token, max_retries=0)
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            limited.completions.create(model=str(tiny), prompt=PROMPT, max_tokens=3)
        assert int(caught.value.response.headers["Retry-After"]) >= 1
    finally:
        with make_session_factory(stack["db"])() as session:
            for job_id in held:
                session.get(Job, job_id).status = "cancelled"
            session.commit()


def test_a_client_that_leaves_a_stream_cancels_its_job(tiny, stack, client):
    # Greedy on this checkpoint repeats itself without an end: it would run to the budget (as
    # much as the checkpoint's context of 256 positions leaves).
    stream = client.completions.create(
        model=str(tiny),
        prompt=PROMPT,
        temperature=0,
        max_tokens=240,
        stream=True,
        extra_body={"draft_k": 0},
    )
    first = next(iter(stream))
    job_id = first.model_extra["specpipe"]["job_id"]
    stream.close()
    deadline = time.monotonic() + 30
    while stored(stack, job_id).status != "cancelled" and time.monotonic() < deadline:
        time.sleep(0.2)
    job = stored(stack, job_id)
    assert job.status == "cancelled" and len(job.output_ids) < 240
