"""Whole jobs on a real swarm: `specpipe worker stage` processes serving a tiny checkpoint, a
real Celery coordinator process, a private Redis, and `specpipe generate` submitting the job.

Every output is compared with `specpipe generate --local` on the same checkpoint: a job's
tokens depend only on (model, prompt, parameters, seed), whatever is killed on the way.
"""

from __future__ import annotations

import json
import secrets
import shutil
import threading
import uuid

import pytest
import redis
from click.testing import CliRunner

from models import Job
from models.db import make_session_factory
from models.runs import Run
from specpipe.cli import cli
from specpipe.ops.redis_server import RedisServer, free_port
from specpipe.settings import job_limits
from specpipe.swarm import inventory
from tests.swarmprocs import Swarm, write_tiny_model
from tests.waiting import wait_until
from workers.job_lock import lock_key
from workers.names import COORDINATOR_QUEUE, GENERATE_TASK, RESUME_STALLED_TASK
from workers.submission import Submitter, make_client

PROMPT = "hello world"
LONG = dict(temp=0.8, seed=1, max_new_tokens=150)  # runs to the budget: no EOS on the way


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture(scope="module")
def private_redis():
    # Locked down as `specpipe up` runs it: a password and only the commands the swarm uses.
    with RedisServer(password=secrets.token_hex(16)) as server:
        yield server.url


@pytest.fixture(scope="module")
def swarm(tiny, private_redis, database_url, tmp_path_factory):
    """Two stages (layers 0:2, 2:4) and a coordinator that counts a job stalled after 2 s."""
    group = Swarm(
        private_redis,
        f"t{uuid.uuid4().hex[:8]}",
        secrets.token_hex(16),
        tiny,
        DATABASE_URL=database_url,
        SPECPIPE_STALLED_S="2",
    )
    try:
        group.start_stage("s0", "0:2")
        group.start_stage("s1", "2:4")
        group.start_coordinator(log=tmp_path_factory.mktemp("logs") / "coordinator.log")
        group.wait_stages(["s0", "s1"])
        yield group
    finally:
        group.stop()


@pytest.fixture(autouse=True)
def no_earlier_locks(request):
    """Every test's store starts empty, so its jobs take the ids an earlier test's jobs had; the
    module's coordinator may still hold one of those jobs' locks for a moment after that test
    has its answer. A lock left so would keep the new job of that id waiting for a delivery that
    no beat sends here: each test starts with none."""
    if "swarm" not in request.fixturenames:
        yield
        return
    group = request.getfixturevalue("swarm")
    client = redis.Redis.from_url(group.redis_url)
    client.delete(*(lock_key(group.swarm, job_id) for job_id in range(1, 101)))
    client.close()
    yield


@pytest.fixture
def env(monkeypatch, swarm, db_url):
    """This process talks to the test swarm and its store, as a user's shell would."""
    monkeypatch.setenv("REDIS_URL", swarm.redis_url)
    monkeypatch.setenv("SPECPIPE_SWARM", swarm.swarm)
    monkeypatch.setenv("SPECPIPE_SWARM_KEY", swarm.key)
    # No coordinator key pinned: the shared-key mode, opted into out loud.
    monkeypatch.setenv("SPECPIPE_INSECURE_SHARED_KEY", "1")
    monkeypatch.setenv("DATABASE_URL", db_url)
    return db_url


def options(tiny, temp=0.0, seed=0, max_new_tokens=40, draft_k=None, top_p=1.0) -> list[str]:
    spec = ["--no-spec"] if draft_k == 0 else ["--draft-k", str(draft_k or 4)]
    return [
        "--model",
        str(tiny),
        "--json",
        "--temp",
        str(temp),
        "--top-p",
        str(top_p),
        "--seed",
        str(seed),
        "--max-new-tokens",
        str(max_new_tokens),
        *spec,
    ]


def generate(*args: str) -> dict:
    result = CliRunner().invoke(cli, ["generate", PROMPT, *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)  # stderr may say the job waited for a coordinator


def local(tiny, **kw) -> dict:
    return generate("--local", "--stages", "2", *options(tiny, **kw))


def latest_job(db_url) -> Job | None:
    with make_session_factory(db_url)() as session:
        return session.query(Job).order_by(Job.id.desc()).first()


@pytest.mark.parametrize(
    "kw",
    [
        dict(temp=0.0, max_new_tokens=60),
        dict(temp=0.9, seed=3),
        dict(temp=0.7, seed=5, top=1),
        dict(temp=0.9, seed=3, icdf=1),
    ],
    ids=["greedy", "sampled", "sampled-top-k", "sampled-icdf"],
)
def test_a_swarm_job_equals_the_local_run_spec_and_plain(tiny, env, kw):
    extra = ["--top-k", "20", "--top-p", "0.9"] if kw.pop("top", None) else []
    if kw.pop("icdf", None):
        extra = ["--sampler", "icdf"]
    want = local(tiny, **kw, draft_k=0)
    spec = generate(*options(tiny, **kw, draft_k=4), *extra)
    plain = generate(*options(tiny, **kw, draft_k=0), *extra)
    if extra:
        want = generate("--local", "--stages", "2", *options(tiny, **kw, draft_k=0), *extra)
    assert spec["tokens"] == plain["tokens"] == want["tokens"] and want["tokens"]
    assert spec["text"] == plain["text"] == want["text"]
    fields = {"tokens", "text", "tok_s", "rounds", "tokens_per_round", "seed", "reasoning"}
    assert set(spec) == set(want) == fields
    assert plain["rounds"] == len(plain["tokens"]) and plain["tokens_per_round"] == 1.0
    assert spec["tokens_per_round"] == pytest.approx(len(spec["tokens"]) / spec["rounds"], 1e-2)
    if kw["temp"] == 0:  # greedy on this checkpoint repeats itself: some drafts get accepted
        assert spec["rounds"] < len(spec["tokens"])
    job = latest_job(env)
    assert job.sampler == ("icdf" if extra == ["--sampler", "icdf"] else "gumbel")
    if job.sampler == "icdf":  # another draw of the same law: not the Gumbel sampler's tokens
        gumbel = generate("--local", "--stages", "2", *options(tiny, **kw, draft_k=0))
        assert gumbel["tokens"] != want["tokens"]
    # Each job is a generation run with the ring it ran on.
    with make_session_factory(env)() as session:
        run = session.get(Run, job.run_id)
        assert run.kind == "generation" and run.finished_at and run.topology == "s0 -> s1"
        assert f"{job.sampler} sampler" in run.method
        assert [(n.host, n.layer_start, n.layer_end) for n in run.node_snapshots] == [
            ("s0", 0, 2),
            ("s1", 2, 4),
        ]


def test_a_swarm_job_with_a_stop_string_equals_the_local_run(tiny, env):
    kw = dict(temp=0.9, seed=3, max_new_tokens=40, draft_k=0)
    text = local(tiny, **kw)["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 6]  # spans a word boundary: several tokens
    want = text[: text.index(stop)]
    here = generate("--local", "--stages", "2", *options(tiny, **kw), "--stop", stop)
    there = generate(*options(tiny, **kw), "--stop", stop)
    assert there["tokens"] == here["tokens"] and there["text"] == here["text"] == want
    job = latest_job(env)
    assert job.stop == [stop] and job.output_text == want and job.status == "done"
    # Streamed, the text never shows the start of the stop string it later cuts away.
    args = [a for a in options(tiny, **kw) if a != "--json"]
    streamed = CliRunner().invoke(cli, ["generate", PROMPT, *args, "--stop", stop])
    assert streamed.exit_code == 0 and streamed.stdout == want + "\n"


def test_a_job_is_submitted_over_a_registry_a_host_retyped(tiny, env, swarm):
    """On main `specpipe generate` answered "no swarm running" (WRONGTYPE) while a host had
    turned the inventory into a stream, until beat mended it. No host's registry user can write
    a record but its own (a string) now; a record key of another type, whoever put it there, is
    read past (MGET), not a WRONGTYPE."""
    kw = dict(temp=0.0, max_new_tokens=12)
    want = generate("--local", "--stages", "2", *options(tiny, **kw))
    client = redis.Redis.from_url(swarm.redis_url)
    stray = inventory.node_key(swarm.swarm, "intruder")
    client.xadd(stray, {"by": "a hostile host"})
    try:
        assert generate(*options(tiny, **kw))["tokens"] == want["tokens"]
        assert client.type(stray) == b"stream"  # there all along: the job ran beside it
    finally:
        client.delete(stray)
        client.close()


def watch(db_url, until, what: str, timeout_s: float = 60.0) -> Job:
    """Poll the newest job until `until(job)`; return it."""

    def there() -> Job | None:
        job = latest_job(db_url)
        return job if job is not None and until(job) else None

    return wait_until(there, timeout_s, what, interval_s=0.01)


def in_background(*args: str) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def target():
        out["result"] = CliRunner().invoke(cli, ["generate", PROMPT, *args])

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def test_jobs_submitted_together_run_at_once_each_as_it_would_alone(tiny, env, swarm):
    """The coordinator runs several sessions through the ring at once; a job's tokens are the
    ones it gets alone, whatever runs beside it."""
    # Long enough that a busy machine cannot finish one before the coordinator starts the last:
    # seeds whose jobs run to their budget (seed 20's met its EOS after 23 tokens, and on a
    # loaded machine ended before the fourth job started).
    requests = [dict(temp=0.8, seed=seed, max_new_tokens=200) for seed in (24, 25, 26, 28)]
    alone = [local(tiny, **kw, draft_k=0)["tokens"] for kw in requests]
    assert [len(tokens) for tokens in alone] == [200] * 4
    submitter = Submitter.connect(swarm.redis_url, str(tiny), job_limits())
    with make_session_factory(env)() as session:
        ids = [
            submitter.submit(session, submitter.check({"prompt": PROMPT, "top_p": 1.0, **kw})).id
            for kw in requests
        ]

    def finished() -> list[Job] | None:
        with make_session_factory(env)() as session:
            jobs = [session.get(Job, job_id) for job_id in ids]
        return jobs if all(job.finished for job in jobs) else None

    jobs = wait_until(finished, 120, "the four jobs to finish")
    assert [job.status for job in jobs] == ["done"] * 4, [job.error for job in jobs]
    assert [job.output_ids for job in jobs] == alone
    # They ran at the same time: each had started before any had finished.
    times = {
        job.id: (f"{job.started_at:%H:%M:%S.%f}", f"{job.finished_at:%H:%M:%S.%f}") for job in jobs
    }
    log = swarm.logs["coordinator"].read_text()[-3000:]
    assert max(job.started_at for job in jobs) < min(job.finished_at for job in jobs), (times, log)


def test_a_stage_killed_mid_job_is_restarted_and_the_output_is_unchanged(tiny, env, swarm):
    want = local(tiny, **LONG, draft_k=0)
    thread, out = in_background(*options(tiny, **LONG, draft_k=0))
    job = watch(env, lambda j: j.generated_tokens >= 10, "10 tokens of the job")
    swarm.kill9("s1")  # the tail: its caches and the session's sampling parameters are gone
    assert latest_job(env).status == "running"
    swarm.restart("s1")
    thread.join(120)
    result = out["result"]
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens"] == want["tokens"]
    assert latest_job(env).id == job.id


def test_a_coordinator_killed_mid_job_is_resumed_with_the_same_output(tiny, env, swarm):
    want = local(tiny, **LONG, draft_k=0)
    thread, out = in_background(*options(tiny, **LONG, draft_k=0))
    watch(env, lambda j: j.generated_tokens >= 10, "10 tokens of the job")
    swarm.kill9("coordinator")
    partial = latest_job(env)
    assert partial.status == "running" and partial.generated_tokens < 150
    swarm.restart("coordinator")
    client = make_client(swarm.redis_url)

    def resumed() -> bool:
        job = latest_job(env)
        if job.status == "running" and job.generated_tokens == partial.generated_tokens:
            # What beat does every 15 s: find running jobs without progress whose lock expired.
            client.send_task(RESUME_STALLED_TASK, queue=COORDINATOR_QUEUE)
            return False
        return True

    wait_until(resumed, 60, "the stalled job to go on", interval_s=1.0)  # not beat's 15 s
    thread.join(120)
    result = out["result"]
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens"] == want["tokens"]
    job = latest_job(env)
    assert job.output_ids[: partial.generated_tokens] == partial.output_ids
    assert job.rounds == len(job.accepted_drafts) == 150  # plain: one round per token


def test_a_model_nobody_serves_fails_with_the_missing_layers(tiny, env, tmp_path):
    other = shutil.copytree(tiny, tmp_path / "other")
    result = CliRunner().invoke(cli, ["generate", PROMPT, *options(other)])
    assert result.exit_code == 1
    assert "failed: RouteError: no online stage serves layers 0:4" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_a_duplicate_delivery_never_runs_a_job_twice_at_once(tiny, env, swarm, tmp_path):
    log = tmp_path / "second.log"
    swarm.start_coordinator(name="second", log=log)  # idle while the first runs the job
    try:
        client = make_client(swarm.redis_url)
        # A worker answers a ping once it consumes its queues: then the second one is there to
        # take the duplicate while the first runs the job.
        wait_until(
            lambda: len(client.control.ping(timeout=0.5)) >= 2,
            60,
            "both coordinators to answer a ping",
        )
        want = local(tiny, **LONG, draft_k=0)
        thread, out = in_background(*options(tiny, **LONG, draft_k=0))
        job = watch(
            env, lambda j: j.status == "running" and j.generated_tokens > 0, "the job to run"
        )
        client.send_task(GENERATE_TASK, args=[job.id], queue=COORDINATOR_QUEUE)
        thread.join(120)
        assert out["result"].exit_code == 0, out["result"].output
        assert json.loads(out["result"].output)["tokens"] == want["tokens"]
        # Whichever coordinator took the job, the other one turned the duplicate away.
        dropped = f"delivery of job {job.id}: every job it could run is taken; it is done"
        logs = [log, swarm.logs["coordinator"]]
        wait_until(
            lambda: any(dropped in path.read_text() for path in logs),
            20,
            "a coordinator to drop the duplicate",
            interval_s=0.2,
            detail=lambda: [path.read_text()[-2000:] for path in logs],
        )
        assert not any("Traceback" in path.read_text() for path in logs)
    finally:
        proc = swarm.procs.pop("second")
        proc.terminate()
        proc.wait(20)


def test_no_swarm_running_is_one_line(monkeypatch, db_url, private_redis):
    monkeypatch.setenv("DATABASE_URL", db_url)
    monkeypatch.setenv("REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    result = CliRunner().invoke(cli, ["generate", "hi"])
    assert result.exit_code == 1 and "no swarm running: cannot reach Redis" in result.output
    assert len(result.output.strip().splitlines()) == 1
    monkeypatch.setenv("REDIS_URL", private_redis)
    monkeypatch.setenv("SPECPIPE_SWARM", "nobody-here")
    monkeypatch.setenv("SPECPIPE_SWARM_KEY", "a key that verifies nothing here")
    # No coordinator key pinned: the shared-key mode, opted into out loud.
    monkeypatch.setenv("SPECPIPE_INSECURE_SHARED_KEY", "1")
    result = CliRunner().invoke(cli, ["generate", "hi"])
    assert result.exit_code == 1
    assert "no swarm running: no stage is online in swarm 'nobody-here'" in result.output
    with make_session_factory(db_url)() as session:
        assert session.query(Job).count() == 0  # nothing was stored
    client = redis.Redis.from_url(private_redis)
    assert client.llen(COORDINATOR_QUEUE) == 0
    client.close()


def prefix_hits(swarm) -> dict[str, int]:
    """Each stage's count of sessions started from a prefix it kept."""
    from specpipe.swarm import streams

    client = redis.Redis.from_url(swarm.redis_url)
    try:
        return {
            host: int(client.hget(streams.stats_key(swarm.swarm, host), "prefix_hits") or 0)
            for host in ("s0", "s1")
        }
    finally:
        client.close()


def ask(prompt: str, *args: str) -> dict:
    result = CliRunner().invoke(cli, ["generate", prompt, "--raw", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_a_next_turn_starts_from_the_cache_its_last_turn_kept(tiny, env, swarm):
    """The stages keep a job's cache; the same user's next job, whose prompt starts with that
    job's prompt and output, starts from it with the same tokens as a cold run. Another user's
    job with the same prompt does not (prefixes are per user unless shared)."""
    words = " ".join(f"w{10 + i % 70}" for i in range(60))  # three blocks and more
    first = ask(words, *options(tiny, temp=0.9, seed=4, max_new_tokens=20))
    next_turn = f"{words} {first['text']} w20 w21 w22"
    before = prefix_hits(swarm)
    second = ask(next_turn, *options(tiny, temp=0.9, seed=5, max_new_tokens=20))
    assert prefix_hits(swarm) == {h: n + 1 for h, n in before.items()}
    cold = ask(
        next_turn, "--local", "--stages", "2", *options(tiny, temp=0.9, seed=5, max_new_tokens=20)
    )
    assert second["tokens"] == cold["tokens"] and cold["tokens"]

    # Another user sends the same next turn: no kept prefix of theirs, so a full prefill.
    from tests.factories import gen_user

    before = prefix_hits(swarm)
    sessions = make_session_factory(env)
    with sessions() as session:
        other = gen_user(session, f"other-{uuid.uuid4().hex[:6]}")
        submitter = Submitter.connect(swarm.redis_url, str(tiny), job_limits())
        params = dict(prompt=next_turn, raw_prompt=True, temp=0.9, seed=5, max_new_tokens=20)
        params.update(top_p=1.0, top_k=0, draft_k=4, stop=[], sampler="gumbel")
        job_id = submitter.submit(session, params, owner=other).id
    job = watch(env, lambda j: j.id == job_id and j.status == "done", "the other user's job")
    assert job.output_ids == cold["tokens"]
    assert prefix_hits(swarm) == before


def latest_topology(db_url) -> str:
    """The route the latest job ran on, as its run records it."""
    with make_session_factory(db_url)() as session:
        job = session.query(Job).order_by(Job.id.desc()).first()
        return session.get(Run, job.run_id).topology


def test_a_next_turn_is_routed_to_the_stages_keeping_its_prefix(tiny, env, swarm):
    """A replica of s1's layers whose name comes first joins after a first turn: by name it
    would take every later job's rounds, but the next turn goes through s1, which keeps the
    first turn's cache, and starts from it."""
    words = " ".join(f"w{(7 * i + 3) % 80}" for i in range(60))  # the tokenizer's words
    first = ask(words, *options(tiny, temp=0.7, seed=8, max_new_tokens=12))
    assert latest_topology(env) == "s0 -> s1"
    swarm.start_stage("r1", "2:4")
    try:
        swarm.wait_stages(["r1"])
        before = prefix_hits(swarm)
        ask(f"{words} {first['text']} w30", *options(tiny, temp=0.7, seed=9, max_new_tokens=12))
        assert latest_topology(env) == "s0 -> s1"
        assert prefix_hits(swarm) == {h: n + 1 for h, n in before.items()}
        # A job with nothing kept is routed by name: through the replica.
        ask("w1 w2 w3 w4", *options(tiny, temp=0.7, seed=9, max_new_tokens=4))
        assert latest_topology(env) == "s0 -> r1"
    finally:
        proc = swarm.procs.pop("r1")
        proc.terminate()
        proc.wait(20)


def test_the_choices_of_a_request_prefill_their_prompt_once(tiny, env, swarm):
    """A request's choices are jobs of one prompt submitted together: one prefills it, the
    others wait for that and start from the copy its stages keep, each with its own seed's
    tokens as it would get them alone."""
    words = " ".join(f"w{(11 * i + 5) % 80}" for i in range(70))  # no other test's first block
    seeds = (31, 32, 33)
    alone = [
        ask(words, "--local", "--stages", "2", *options(tiny, temp=0.9, seed=s, max_new_tokens=60))
        for s in seeds
    ]
    before = prefix_hits(swarm)
    submitter = Submitter.connect(swarm.redis_url, str(tiny), job_limits())
    with make_session_factory(env)() as session:
        params = dict(prompt=words, raw_prompt=True, temp=0.9, max_new_tokens=60)
        params.update(top_p=1.0, top_k=0, draft_k=4, stop=[], sampler="gumbel")
        jobs = submitter.submit_all(session, [dict(params, seed=s) for s in seeds])
        ids = [job.id for job in jobs]

    def finished() -> list[Job] | None:
        with make_session_factory(env)() as session:
            found = [session.get(Job, job_id) for job_id in ids]
        return found if all(job.finished for job in found) else None

    done = wait_until(finished, 120, "the three choices to finish")
    assert [job.output_ids for job in done] == [run["tokens"] for run in alone]
    # Two of the three started from the first one's prefill, on every stage.
    assert prefix_hits(swarm) == {h: n + 2 for h, n in before.items()}
