"""The coordinator's job loop on a real store, over in-process and real swarm rings."""

from __future__ import annotations

import string
from datetime import timedelta

import pytest

from models import Job
from models.db import make_session_factory
from models.users import builtin_admin
from specpipe.core.sampling import SamplingParams
from specpipe.decoding.generation import Generation
from specpipe.decoding.local_ring import LocalRing
from specpipe.swarm import failover
from specpipe.swarm.failover import CheckedRing
from specpipe.swarm.inventory import NodeInfo
from specpipe.swarm.redis_ring import RedisRing
from tests.swarm.toy_stage import ToyConfig, ToyStage
from workers import coordinator, job_lock, job_run, turns
from workers.broker import stranded_jobs

BOUNDS = [(0, 2), (2, 4)]
ALPHABET = string.ascii_letters + string.digits + " ."  # one character per toy token id
EOS = 63  # "."


class ToyCodec:
    """Text to toy token ids and back, one character per id."""

    chat_ids = None  # no chat template

    def prompt_ids(self, prompt: str) -> list[int]:
        return [ALPHABET.index(c) for c in prompt if c in ALPHABET]

    def decode(self, ids: list[int]) -> str:
        return "".join(ALPHABET[i] for i in ids)


def local_ring(_job=None) -> LocalRing:
    return LocalRing([ToyStage(ToyConfig(), a, b) for a, b in BOUNDS])


def add_job(db_url, **fields) -> int:
    values = dict(
        prompt="the cat sat on the mat",
        model="toy",
        max_new_tokens=24,
        temp=0.0,
        top_p=1.0,
        top_k=0,
        seed=5,
        draft_k=3,
    )
    values.update(fields)
    with make_session_factory(db_url)() as session:
        job = Job(**values, user_id=builtin_admin(session).id)
        session.add(job)
        session.commit()
        return job.id


def load(db_url, job_id) -> Job:
    with make_session_factory(db_url)() as session:
        return session.get(Job, job_id)


def run_job(sessions, job_id, make_ring, codec, eos=(), keep_alive=None):
    """The coordinator's loop in a session of its own, as the Celery task gives it one."""
    with sessions() as session:
        return job_run.run_job(session, job_id, make_ring, codec, eos, keep_alive)


def undisturbed(job: Job) -> list[int]:
    params = SamplingParams(
        temp=job.temp, top_p=job.top_p, top_k=job.top_k, seed=job.seed, sampler=job.sampler
    )
    prompt = ToyCodec().prompt_ids(job.prompt)
    return Generation(
        local_ring(),
        "ref",
        prompt,
        params,
        max_new_tokens=job.max_new_tokens,
        draft_k=job.draft_k,
        eos_ids={EOS},
    ).run()


def runs_to_the_end(ran: list[int]):
    """A `run_on_swarm` that records the job's id and ends it done, as a whole run does."""

    def run_on_swarm(session, job, settings, keeper) -> str:
        ran.append(job.id)
        job.status = "done"
        session.commit()
        return "done"

    return run_on_swarm


class DyingRing:
    """A ring whose coordinator process dies (SystemExit) after `rounds` rounds."""

    route = ()  # in this process

    def __init__(self, ring, rounds: int, on_round=None) -> None:
        self.ring, self.left, self.on_round = ring, rounds, on_round

    def reset(self, session, params, prefix=None):
        self.ring.reset(session, params, prefix)

    def reseed(self, session, params):
        self.ring.reseed(session, params)

    def round(self, r):
        if self.on_round is not None:
            self.on_round()
        if self.left == 0:
            raise SystemExit("coordinator killed")
        self.left -= 1
        return self.ring.round(r)

    def drop(self, session, keep=None):
        self.ring.drop(session, keep)

    def close(self):
        self.ring.close()


@pytest.mark.parametrize(("temp", "draft_k"), [(0.0, 3), (0.9, 4), (0.7, 0)])
def test_a_job_runs_to_the_end_and_records_every_round(db_url, temp, draft_k):
    job_id = add_job(db_url, temp=temp, draft_k=draft_k)
    sessions = make_session_factory(db_url)
    assert run_job(sessions, job_id, local_ring, ToyCodec(), {EOS}) == "done"
    job = load(db_url, job_id)
    assert job.status == "done" and job.error is None and job.finished_at
    assert job.output_ids == undisturbed(job)
    assert job.output_text == ToyCodec().decode([t for t in job.output_ids if t != EOS])
    assert job.generated_tokens == len(job.output_ids)
    assert job.prompt_tokens == len(ToyCodec().prompt_ids(job.prompt))
    assert job.rounds == len(job.accepted_drafts) >= 1
    if draft_k == 0:
        assert job.accepted_drafts == [0] * job.rounds
    assert all(0 <= a <= draft_k for a in job.accepted_drafts)


@pytest.mark.parametrize("draft_k", [0, 3])
def test_a_job_with_stop_strings_ends_early_with_its_text_cut(db_url, draft_k):
    sessions = make_session_factory(db_url)
    unstopped = add_job(db_url, temp=0.9, draft_k=draft_k, max_new_tokens=40)
    assert run_job(sessions, unstopped, local_ring, ToyCodec(), {EOS}) == "done"
    full = load(db_url, unstopped)
    assert len(full.output_ids) == 40  # no EOS on the way: only the stop string can end it early
    # Three tokens from the middle of the text; a second stop string later in it loses.
    stop, later = full.output_text[15:18], full.output_text[30:32]
    job_id = add_job(db_url, temp=0.9, draft_k=draft_k, max_new_tokens=40, stop=[later, stop])
    assert run_job(sessions, job_id, local_ring, ToyCodec(), {EOS}) == "done"
    job = load(db_url, job_id)
    first = min(full.output_text.index(stop), full.output_text.index(later))
    assert job.status == "done" and job.error is None
    assert job.output_text == full.output_text[:first]
    # The ids are every token up to and including the round that completed the stop string.
    ids = job.output_ids
    assert ids == full.output_ids[: len(ids)] and len(ids) < 40
    assert job.generated_tokens == len(ids) and job.rounds == len(job.accepted_drafts)
    last_round = job.accepted_drafts[-1] + 1  # drafts accepted in it plus the model's own
    before_last = ToyCodec().decode(ids[:-last_round])
    assert stop not in before_last and later not in before_last
    assert stop in ToyCodec().decode(ids) or later in ToyCodec().decode(ids)
    assert job.stop == [later, stop] and job.tok_s > 0


def test_a_job_resumed_after_its_stop_string_runs_no_more_rounds(db_url):
    sessions = make_session_factory(db_url)
    job_id = add_job(db_url, temp=0.9, draft_k=3, max_new_tokens=40)
    run_job(sessions, job_id, local_ring, ToyCodec(), {EOS})
    full = load(db_url, job_id)
    stop = full.output_text[10:12]
    stopped_id = add_job(db_url, temp=0.9, draft_k=3, max_new_tokens=40, stop=[stop])
    run_job(sessions, stopped_id, local_ring, ToyCodec(), {EOS})
    stopped = load(db_url, stopped_id)
    # The coordinator died after storing the stopping round, before marking the job done.
    with sessions() as session:
        session.get(Job, stopped_id).status = "running"
        session.commit()
    calls = []
    counting = DyingRing(local_ring(), rounds=100, on_round=lambda: calls.append(1))
    assert run_job(sessions, stopped_id, lambda j: counting, ToyCodec(), {EOS}) == "done"
    job = load(db_url, stopped_id)
    assert calls == [] and job.output_ids == stopped.output_ids
    assert job.output_text == stopped.output_text
    assert stopped.output_text == full.output_text[: full.output_text.index(stop)]


def test_a_rerun_after_the_coordinator_died_resumes_to_the_same_output(db_url):
    job_id = add_job(db_url, temp=0.9, draft_k=3, max_new_tokens=30)
    sessions = make_session_factory(db_url)
    with pytest.raises(SystemExit):
        run_job(sessions, job_id, lambda j: DyingRing(local_ring(), 4), ToyCodec(), {EOS})
    partial = load(db_url, job_id)
    assert partial.status == "running" and 0 < len(partial.output_ids) < 30
    calls = []
    counting = DyingRing(local_ring(), rounds=100, on_round=lambda: calls.append(1))
    assert run_job(sessions, job_id, lambda j: counting, ToyCodec(), {EOS}) == "done"
    job = load(db_url, job_id)
    assert job.output_ids == undisturbed(job)
    assert job.output_ids[: len(partial.output_ids)] == partial.output_ids
    # It went on from the stored tokens: the re-run needed fewer rounds than a whole run.
    assert len(calls) == job.rounds - partial.rounds < job.rounds


def test_a_job_with_missing_layers_fails_with_the_reason(db_url, ring_settings):
    job_id = add_job(db_url)
    sessions = make_session_factory(db_url)

    def from_inventory(_job):
        return RedisRing.from_inventory(ring_settings, "toy", 4)

    assert run_job(sessions, job_id, from_inventory, ToyCodec()) == "failed"
    job = load(db_url, job_id)
    assert job.error == "RouteError: no online stage serves layers 0:4"
    assert job.output_ids == [] and job.finished_at


def test_a_cancel_request_stops_the_job_at_its_next_round(db_url):
    job_id = add_job(db_url, max_new_tokens=40, draft_k=0)
    sessions = make_session_factory(db_url)
    calls = []

    def cancel_from_the_web_app():
        calls.append(1)
        if len(calls) == 3:
            with sessions() as other:
                other.get(Job, job_id).request_cancel()
                other.commit()

    ring = DyingRing(local_ring(), rounds=100, on_round=cancel_from_the_web_app)
    assert run_job(sessions, job_id, lambda j: ring, ToyCodec(), {EOS}) == "cancelled"
    job = load(db_url, job_id)
    assert job.status == "cancelled" and job.rounds == 3 and len(job.output_ids) == 3


def test_finished_missing_and_cancelled_jobs_are_left_alone(db_url):
    sessions = make_session_factory(db_url)
    assert run_job(sessions, 10_000, local_ring, ToyCodec()) is None
    done = add_job(db_url, status="done", output_ids=[1, 2])
    assert run_job(sessions, done, local_ring, ToyCodec()) == "done"
    assert load(db_url, done).output_ids == [1, 2]
    queued = add_job(db_url, cancel_requested=True)
    assert run_job(sessions, queued, local_ring, ToyCodec()) == "cancelled"
    assert load(db_url, queued).rounds == 0


def test_a_job_over_real_stage_processes_equals_the_local_run(
    db_url, stages, ring_settings, redis_url
):
    stages.start("a", "0:2", redis_url, wait=False)
    stages.start("b", "2:4", redis_url, wait=False)
    stages.wait_ready(["a", "b"])
    job_id = add_job(db_url, temp=0.8, top_p=0.9, top_k=20, seed=123, draft_k=4)
    sessions = make_session_factory(db_url)

    def from_inventory(_job):
        return RedisRing.from_inventory(ring_settings, "toy", 4, timeout_s=20)

    assert run_job(sessions, job_id, from_inventory, ToyCodec(), {EOS}) == "done"
    job = load(db_url, job_id)
    assert job.output_ids == undisturbed(job)


def test_the_task_fails_a_job_whose_model_cannot_be_opened(db_url, monkeypatch):
    monkeypatch.setenv("DATABASE_URL", db_url)
    job_id = add_job(db_url, model="/nonexistent/model")
    assert coordinator.generate(job_id) == "failed"
    job = load(db_url, job_id)
    assert job.error.startswith("cannot open model '/nonexistent/model'")
    assert coordinator.generate(10_000) is None


def test_stalled_jobs_are_running_ones_without_progress_or_a_live_lock(db_url, redis_url, swarm):
    import redis

    from models.db import utcnow

    old = utcnow() - timedelta(seconds=120)
    stalled = add_job(db_url, status="running", updated_at=old)
    locked = add_job(db_url, status="running", updated_at=old)
    add_job(db_url, status="running")  # progress just now
    add_job(db_url, status="queued", updated_at=old)
    add_job(db_url, status="done", updated_at=old)
    client = redis.Redis.from_url(redis_url)
    client.set(job_lock.lock_key(swarm, locked), "token", ex=30)
    with make_session_factory(db_url)() as session:
        assert job_lock.stalled_jobs(session, client, swarm, after_s=60) == [stalled]
        assert job_lock.stalled_jobs(session, client, swarm, after_s=600) == []
    client.delete(job_lock.lock_key(swarm, locked))
    with make_session_factory(db_url)() as session:
        assert job_lock.stalled_jobs(session, client, swarm, after_s=60) == [stalled, locked]
    client.close()


class FailingRing:
    """A ring whose rounds raise `error` after `rounds` good ones."""

    route = ()  # in this process

    def __init__(self, error: BaseException, rounds: int = 2) -> None:
        self.ring, self.error, self.left = local_ring(), error, rounds

    def reset(self, session, params, prefix=None):
        self.ring.reset(session, params, prefix)

    def reseed(self, session, params):
        self.ring.reseed(session, params)

    def round(self, r):
        if self.left == 0:
            raise self.error
        self.left -= 1
        return self.ring.round(r)

    def drop(self, session, keep=None):
        self.ring.drop(session, keep)

    def close(self):
        self.ring.close()


@pytest.mark.parametrize(
    "error",
    [TypeError("unsupported operand"), KeyError("params"), RuntimeError("Redis said no")],
    ids=["TypeError", "KeyError", "RuntimeError"],
)
def test_any_exception_ends_the_job_failed_with_one_line(db_url, error):
    job_id = add_job(db_url)
    sessions = make_session_factory(db_url)
    assert run_job(sessions, job_id, lambda j: FailingRing(error), ToyCodec(), {EOS}) == "failed"
    job = load(db_url, job_id)
    assert job.status == "failed" and job.finished_at is not None
    assert job.error.startswith(type(error).__name__ + ":") and "\n" not in job.error
    assert job.rounds == 2  # what was committed before stays


def test_a_reason_never_shows_a_redis_password(db_url):
    from specpipe.swarm.redis_ring import RingError

    job_id = add_job(db_url)
    sessions = make_session_factory(db_url)
    error = RingError("cannot reach h1's Redis at redis://:hunter2@10.0.0.9:6379/0: refused")
    assert run_job(sessions, job_id, lambda j: FailingRing(error, 0), ToyCodec()) == "failed"
    reason = load(db_url, job_id).error
    assert "hunter2" not in reason and "redis://:***@10.0.0.9:6379/0" in reason


def test_a_job_whose_coordinator_keeps_dying_ends_after_three_attempts(db_url):
    job_id = add_job(db_url, max_new_tokens=40)
    sessions = make_session_factory(db_url)
    for attempt in range(1, 4):
        with pytest.raises(SystemExit):  # each time before its first round is stored
            run_job(sessions, job_id, lambda j: DyingRing(local_ring(), 0), ToyCodec(), {EOS})
        job = load(db_url, job_id)
        assert (job.status, job.attempts) == ("running", attempt)
    assert run_job(sessions, job_id, local_ring, ToyCodec(), {EOS}) == "failed"
    job = load(db_url, job_id)
    assert job.error == "gave up after 3 attempts: its coordinator stopped each time"


def test_the_holder_of_a_lapsed_lock_runs_the_job_its_first_holder_started(db_url):
    """Under load a queued job's lock lapsed and a second delivery took it, having read the job
    before the first holder (its lock gone, not yet told) started it and ran a round: the second
    holder's start, fenced by the attempt it had read, matched no row, and both left the job
    running with nobody running it. The holder starts it over whichever attempt started it."""
    job_id = add_job(db_url, temp=0.9, seed=7, max_new_tokens=30)
    sessions = make_session_factory(db_url)
    checks = iter([True, True, False])  # the first holder learns it lost the lock after 2 rounds

    def first_holder_runs_meanwhile(job, ring, need):
        assert run_job(sessions, job_id, local_ring, ToyCodec(), {EOS}, lambda: next(checks))
        partial = load(db_url, job_id)
        assert (partial.status, partial.attempts, partial.generated_tokens > 0) == (
            "running",
            1,
            True,
        )
        return lambda: None  # its room

    with sessions() as session:
        status = job_run.run_job(
            session,
            job_id,
            local_ring,
            ToyCodec(),
            {EOS},
            lambda: True,
            first_holder_runs_meanwhile,
        )
    job = load(db_url, job_id)
    assert (status, job.status, job.attempts) == ("done", "done", 2)
    assert job.output_ids == undisturbed(job)


def test_a_holder_that_lost_the_lock_before_the_start_leaves_the_job_to_the_new_one(db_url):
    job_id = add_job(db_url)
    sessions = make_session_factory(db_url)
    assert run_job(sessions, job_id, local_ring, ToyCodec(), {EOS}, lambda: False) == "queued"
    job = load(db_url, job_id)
    assert (job.status, job.attempts, job.generated_tokens) == ("queued", 0, 0)


class NulCodec(ToyCodec):
    """Decodes some ids to NUL (as real tokenizers do for one of theirs), some to a backslash
    followed by 0, and some to a backslash: what an escape must tell apart."""

    def decode(self, ids: list[int]) -> str:
        special = {0: "\x00", 1: "\\0", 2: "\\"}
        return "".join(special.get(i % 7, ALPHABET[i]) for i in ids)


def test_text_with_nul_and_backslashes_is_stored_and_read_back_exactly(db_url):
    job_id = add_job(db_url, temp=0.9, seed=3, max_new_tokens=40, draft_k=0)
    sessions = make_session_factory(db_url)
    assert run_job(sessions, job_id, local_ring, NulCodec(), {EOS}) == "done"
    job = load(db_url, job_id)
    assert job.output_text == NulCodec().decode([t for t in job.output_ids if t != EOS])
    assert "\x00" in job.output_text and "\\0" in job.output_text


def test_a_queued_job_whose_message_the_broker_lost_is_found(db_url, second_redis):
    import json

    import redis

    from models.db import utcnow
    from workers.names import GENERATE_TASK
    from workers.submission import make_client

    long_ago = utcnow() - timedelta(seconds=120)
    lost = add_job(db_url, status="queued", created_at=long_ago)
    waiting = add_job(db_url, status="queued", created_at=long_ago)
    taken = add_job(db_url, status="queued", created_at=long_ago)
    add_job(db_url, status="queued")  # just submitted: its message may still be on its way
    add_job(db_url, status="running", created_at=long_ago)  # the stalled check's business
    queue = "coordinator"
    make_client(second_redis).send_task(GENERATE_TASK, args=[waiting], queue=queue)
    client = redis.Redis.from_url(second_redis)
    # A worker took `taken`'s message and has not acknowledged it: the transport keeps it here.
    make_client(second_redis).send_task(GENERATE_TASK, args=[taken], queue="elsewhere")
    message = client.rpop("elsewhere")
    client.hset("unacked", "tag-1", json.dumps([json.loads(message), "", queue]))
    try:
        with make_session_factory(db_url)() as session:
            assert stranded_jobs(session, client, queue) == [lost]
    finally:
        client.delete(queue, "unacked", "elsewhere")
        client.close()


def test_queued_jobs_take_turns_between_users(db_session):
    from models.db import utcnow
    from tests.factories import gen_job, gen_user

    alice, bob = gen_user(db_session, "alice"), gen_user(db_session, "bob")
    hers = [gen_job(db_session, owner=alice) for _ in range(3)]
    his = gen_job(db_session, owner=bob)
    db_session.commit()
    order = turns.fair_order
    assert order(db_session) == [hers[0].id, hers[1].id, hers[2].id, his.id]  # nobody served
    hers[0].status, hers[0].started_at = "running", utcnow()
    db_session.commit()
    assert order(db_session) == [his.id, hers[1].id, hers[2].id]  # she has one running
    hers[0].status = "done"
    db_session.commit()
    assert order(db_session)[0] == his.id  # nobody running: he was never served
    his.status, his.started_at = "done", utcnow()
    gen_job(db_session, owner=bob)  # he has another waiting
    db_session.commit()
    assert order(db_session)[0] == hers[1].id  # she was served longer ago: her turn


def test_a_queued_jobs_place_in_line_follows_the_turns(db_session):
    from tests.factories import gen_job, gen_user

    alice, bob = gen_user(db_session, "alice"), gen_user(db_session, "bob")
    hers = [gen_job(db_session, owner=alice) for _ in range(2)]
    running = gen_job(db_session, owner=alice, status="running")
    his = gen_job(db_session, owner=bob)
    db_session.commit()
    place = turns.queue_place
    assert place(db_session, his) == {"position": 1, "queued": 3}  # she has one running
    assert place(db_session, hers[1]) == {"position": 3, "queued": 3}
    assert place(db_session, running) is None
    his.status = "cancelled"
    db_session.commit()
    assert place(db_session, hers[0]) == {"position": 1, "queued": 2}


def test_a_delivery_runs_the_job_whose_turn_it_is(db_url, monkeypatch):
    """The delivery of alice's third job runs bob's, which waited behind it."""
    from models.db import utcnow
    from tests.factories import gen_job, gen_user

    with make_session_factory(db_url)() as session:
        alice, bob = gen_user(session, "alice"), gen_user(session, "bob")
        first = gen_job(session, owner=alice, status="done", started_at=utcnow())
        third = gen_job(session, owner=alice)
        his = gen_job(session, owner=bob)
        session.commit()
        ids = (first.id, third.id, his.id)
    ran = []
    monkeypatch.setattr(job_run, "run_on_swarm", runs_to_the_end(ran))
    monkeypatch.setenv("DATABASE_URL", db_url)
    coordinator.generate.apply(args=[ids[1]])
    assert ran == [ids[2], ids[1]]  # bob's turn first, then alice's: none is left after


def test_a_delivery_whose_job_another_took_over_runs_the_next_queued_job(
    db_url, redis_url, swarm, monkeypatch
):
    """Four jobs submitted together once left one queued for good: a job's lock lapsed on a
    loaded machine before its run started, a second delivery took that job and ran it, and the
    first delivery ended with it, so the job whose delivery the second one was had none left.
    A delivery goes on until it finds no queued job it can take."""
    import threading

    import redis as redis_client

    first, second = add_job(db_url), add_job(db_url)
    monkeypatch.setenv("DATABASE_URL", db_url)
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("SPECPIPE_SWARM", swarm)
    ran: list[tuple[str, int]] = []

    def run_on_swarm(session, job, settings, keeper):
        ran.append((threading.current_thread().name, job.id))
        if job.id == first and threading.current_thread().name == "first":
            # The lock lapses; the second job's delivery finds the first job free and runs it.
            client = redis_client.Redis.from_url(redis_url)
            client.delete(job_lock.lock_key(swarm, first))
            client.close()
            other = threading.Thread(
                target=coordinator.generate.apply, args=([second],), name="second"
            )
            other.start()
            other.join(30)
            return "running"  # superseded: the other attempt ended it
        with make_session_factory(db_url)() as other:
            other.get(Job, job.id).status = "done"
            other.commit()
        return "done"

    monkeypatch.setattr(job_run, "run_on_swarm", run_on_swarm)
    delivery = threading.Thread(target=coordinator.generate.apply, args=([first],), name="first")
    delivery.start()
    delivery.join(60)
    assert [job_id for _, job_id in ran] == [first, first, second], ran
    assert [load(db_url, i).status for i in (first, second)] == ["done", "done"]


def test_a_job_whose_start_the_store_refused_is_started_again_by_its_delivery(
    db_url, redis_url, swarm, monkeypatch
):
    """A start write the store refused (its lock held by writers committing rounds on a loaded
    machine) once left the job queued with its delivery gone: it started only when another
    delivery ended its own job, or beat sent it again 30 s later. The delivery takes it again."""
    from sqlalchemy.exc import OperationalError

    from workers.attempt import Attempt

    job_id = add_job(db_url, temp=0.9, max_new_tokens=20)
    monkeypatch.setenv("DATABASE_URL", db_url)
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("SPECPIPE_SWARM", swarm)
    monkeypatch.setattr(coordinator, "RESTART_PAUSE_S", 0.01)
    start, refused = Attempt.start, []

    def refused_once(self, session, prompt_tokens):
        if not refused:
            refused.append(self.job_id)
            raise OperationalError("UPDATE jobs", {}, Exception("database is locked"))
        return start(self, session, prompt_tokens)

    def run_on_swarm(session, job, settings, keeper):
        return job_run.run_job(session, job.id, local_ring, ToyCodec(), {EOS}, keeper.owned)

    monkeypatch.setattr(Attempt, "start", refused_once)
    monkeypatch.setattr(job_run, "run_on_swarm", run_on_swarm)
    coordinator.generate.apply(args=[job_id])
    job = load(db_url, job_id)
    assert refused == [job_id]
    assert job.status == "done" and job.attempts == 1
    assert job.output_ids == undisturbed(job)


def test_a_delivery_takes_a_job_it_cannot_start_a_bounded_number_of_times(
    db_url, redis_url, swarm, monkeypatch
):
    """A store that refuses every start leaves the job queued for beat after a few tries,
    rather than keeping the delivery busy with it forever, also while another queued job is
    taken by someone else (the queue read again then holds nothing this delivery may try)."""
    import threading

    import redis as redis_client

    job_id, other = add_job(db_url), add_job(db_url)
    monkeypatch.setenv("DATABASE_URL", db_url)
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("SPECPIPE_SWARM", swarm)
    monkeypatch.setattr(coordinator, "RESTART_PAUSE_S", 0.01)
    taken = []
    monkeypatch.setattr(
        job_run, "run_on_swarm", lambda session, job, settings, keeper: taken.append(job.id)
    )
    client = redis_client.Redis.from_url(redis_url)
    client.set(job_lock.lock_key(swarm, other), "another delivery", px=60_000)
    delivery = threading.Thread(target=coordinator.generate.apply, args=([job_id],), daemon=True)
    try:
        delivery.start()
        delivery.join(30)
        assert not delivery.is_alive(), "the delivery never ended"
    finally:
        client.delete(job_lock.lock_key(swarm, other))
        client.close()
    assert taken == [job_id] * coordinator.STARTS_PER_DELIVERY
    assert load(db_url, job_id).status == "queued"


def test_a_store_outage_leaves_the_job_running_to_be_resumed_identically(db_url):
    from sqlalchemy.exc import OperationalError

    job_id = add_job(db_url, temp=0.9, draft_k=3, max_new_tokens=30)
    sessions = make_session_factory(db_url)
    with sessions() as session:
        commit, commits = session.commit, []

        def failing_once() -> None:
            commits.append(1)
            if len(commits) == 4:  # a round's commit, once: the store is back right after
                raise OperationalError("COMMIT", {}, Exception("server closed the connection"))
            commit()

        session.commit = failing_once
        outcome = job_run.run_job(session, job_id, local_ring, ToyCodec(), {EOS})
    assert outcome == "running"
    partial = load(db_url, job_id)
    assert (partial.status, partial.error, partial.finished_at) == ("running", None, None)
    assert 0 < len(partial.output_ids) < 30
    assert run_job(sessions, job_id, local_ring, ToyCodec(), {EOS}) == "done"
    job = load(db_url, job_id)
    assert job.output_ids == undisturbed(job) and job.attempts == 2


class GappyRing:
    """A routed toy ring whose stage `gap_at` rounds in answers gap once (it restarted)."""

    def __init__(self, route, gap_at: int | None = None) -> None:
        self.route, self.ring, self.gap_at, self.rounds = route, local_ring(), gap_at, 0
        self.watchdog = None

    def reset(self, session, params, prefix=None):
        self.ring.reset(session, params, prefix)

    def reseed(self, session, params):
        self.ring.reseed(session, params)

    def round(self, r):
        from specpipe.core.ring import GapError

        self.rounds += 1
        if self.rounds == self.gap_at:
            raise GapError("h1: lost the session's cache")
        return self.ring.round(r)

    def drop(self, session, keep=None, skip=()):
        self.ring.drop(session, keep)

    def close(self):
        self.ring.close()


def routed(*ranges):
    from specpipe.swarm.inventory import NodeInfo

    return [NodeInfo(f"h{i}", a, b, "redis://x") for i, (a, b) in enumerate(ranges)]


@pytest.mark.parametrize("resplit", [False, True], ids=["same-layers", "other-layers"])
def test_after_a_gap_the_ring_is_built_again_only_when_a_stage_serves_other_layers(db_url, resplit):
    job_id = add_job(db_url, temp=0.9, draft_k=3, max_new_tokens=30)
    now = {"h0": (0, 2), "h1": (2, 4)}
    rings = [GappyRing(routed((0, 2), (2, 4)), gap_at=3), GappyRing(routed((0, 1), (1, 4)))]
    built = iter(rings)

    def layers_now():
        if resplit:  # h1 came back serving 1:4; h0 was restarted as 0:1
            return {"h0": (0, 1), "h1": (1, 4)}
        return now

    def make(_job):
        return CheckedRing(lambda: next(built), layers_now)

    assert run_job(make_session_factory(db_url), job_id, make, ToyCodec(), {EOS}) == "done"
    job = load(db_url, job_id)
    assert job.output_ids == undisturbed(job)
    assert (rings[1].rounds > 0) == resplit  # the replay ran on the new ring, or the old one


def test_a_stage_back_with_layers_nobody_else_completes_fails_the_job_with_them(db_url):
    from specpipe.swarm.inventory import RouteError

    job_id = add_job(db_url, max_new_tokens=30)
    rings = iter([GappyRing(routed((0, 2), (2, 4)), gap_at=2)])

    def build():
        ring = next(rings, None)
        if ring is None:
            raise RouteError("no online stage serves layers 2:3")
        return ring

    def make(_job):
        return CheckedRing(build, lambda: {"h0": (0, 2), "h1": (3, 4)})

    assert run_job(make_session_factory(db_url), job_id, make, ToyCodec(), {EOS}) == "failed"
    assert load(db_url, job_id).error == "RouteError: no online stage serves layers 2:3"


class LosingRing(GappyRing):
    """A routed toy ring whose round `lose_at` finds a hop gone: the watchdog's verdict, or a
    stage that could not pass the round on to it (`error`)."""

    def __init__(self, route, lose_at: int | None = None, error: bool = False) -> None:
        super().__init__(route)
        self.lose_at, self.error, self.dropped_on = lose_at, error, None

    def round(self, r):
        from specpipe.swarm.redis_ring import HopLostError, RingError

        self.rounds += 1
        if self.rounds == self.lose_at:
            if self.error:
                raise RingError("round failed: h0: cannot pass the round to h1")
            raise HopLostError(self.watchdog() or "the watchdog saw nothing")
        return self.ring.round(r)

    def drop(self, session, keep=None, skip=()):
        self.dropped_on = [hop.host for hop in self.route if hop.host not in skip]
        self.ring.drop(session, keep)


class CutAtReset(LosingRing):
    """A routed toy ring whose h1 is cut off as a job starts: the reset finds h1's Redis not
    answering, and the watchdog says h1 is gone (with `error`, the reset's wait runs out)."""

    def reset(self, session, params, prefix=None):
        from specpipe.swarm.redis_ring import HopLostError, RingError

        if self.error:
            raise RingError("cannot reach h1's Redis at redis://x: Timeout connecting to server")
        raise HopLostError(self.watchdog() or "the watchdog saw nothing")


@pytest.mark.parametrize("when", ["round", "reset"], ids=["mid-job", "as-it-starts"])
@pytest.mark.parametrize("error", [False, True], ids=["watchdog", "its-redis-error"])
def test_a_lost_hop_with_a_spare_fails_over_and_the_job_ends_undisturbed(db_url, error, when):
    job_id = add_job(db_url, temp=0.9, draft_k=3, max_new_tokens=30)
    if when == "round":
        first = LosingRing(routed((0, 2), (2, 4)), lose_at=4, error=error)
    else:  # lost as the job starts: its reset finds h1 gone
        first = CutAtReset(routed((0, 2), (2, 4)), error=error)
    spare = LosingRing([*routed((0, 2)), NodeInfo("h1b", 2, 4, "redis://x")])
    avoided = []

    def build(avoid=frozenset()):
        avoided.append(set(avoid))
        return spare if avoid else first

    def make(_job):
        return CheckedRing(build, lambda: {}, lambda route: ["h1"])

    assert run_job(make_session_factory(db_url), job_id, make, ToyCodec(), {EOS}) == "done"
    job = load(db_url, job_id)
    assert job.output_ids == undisturbed(job)
    assert avoided == [set(), {"h1"}] and spare.rounds > 0
    assert first.watchdog is not None  # the ring's late rounds ask the inventory
    assert first.dropped_on == ["h0"]  # the session is dropped on the survivors only
    assert (first.rounds == 0) == (when == "reset")


def test_a_hop_restarted_without_a_spare_is_replayed_on_at_once(db_url):
    """A stage without a spare killed and started again mid-round: the round in flight died
    with the old process, so waiting for its reply would cost the job a whole round's wait.
    Its new incarnation in the inventory says so; the ring is built again at once and the job
    replays on the same hosts, ending as it would undisturbed."""
    from dataclasses import replace

    job_id = add_job(db_url, temp=0.9, draft_k=3, max_new_tokens=30)
    before = [replace(hop, incarnation="a0") for hop in routed((0, 2), (2, 4))]
    after = [before[0], replace(before[1], incarnation="b1")]
    first, again = LosingRing(before, lose_at=4), LosingRing(after)
    built, asked = [], []

    def build(avoid=frozenset()):
        built.append(set(avoid))
        return first if len(built) == 1 else again

    def restarted(route):
        asked.append([hop.incarnation for hop in route])
        return [hop.host for hop in route if hop.incarnation == "a0" and hop.host == "h1"]

    checked = []

    def make(_job):
        checked.append(CheckedRing(build, lambda: {}, lambda route: [], restarted))
        return checked[-1]

    assert run_job(make_session_factory(db_url), job_id, make, ToyCodec(), {EOS}) == "done"
    job = load(db_url, job_id)
    assert job.output_ids == undisturbed(job)
    assert built == [set(), set()] and again.rounds > 0  # the same hosts, nothing avoided
    assert checked[0].rebuilt == 1 and checked[0].failovers == 0
    assert asked[0] == ["a0", "a0"]


class UnreachableRing(LosingRing):
    """A routed toy ring whose round `lose_at` finds h1 unreachable from h0 (its Redis full,
    or cut off from h0 only), while h1 still heartbeats: `refusals` times in a row."""

    def __init__(self, route, lose_at: int, refusals: int = 1) -> None:
        super().__init__(route, lose_at)
        self.refusals, self.refused = refusals, 0

    def round(self, r):
        from specpipe.swarm.redis_ring import HopUnreachableError

        if self.rounds + 1 == self.lose_at and self.refused < self.refusals:
            self.refused += 1
            raise HopUnreachableError("round failed: h0: cannot pass the round to h1: OOM", "h1")
        return super().round(r)


def without_a_spare(ring):
    """A job's `make_ring` for a CheckedRing over `ring` whose hop h1 has no spare."""
    from specpipe.swarm.inventory import RouteError

    def build(avoid=frozenset()):
        if avoid:
            raise RouteError("no online stage serves layers 2:4")
        return ring

    return lambda _job: CheckedRing(build, lambda: {}, lambda route: [])


def test_an_unreachable_hop_still_heartbeating_is_gone_around_at_once(db_url, monkeypatch):
    monkeypatch.setattr(failover, "FAILOVER_WAIT_S", 0.5)  # h1 never lapses here
    job_id = add_job(db_url, temp=0.9, draft_k=3, max_new_tokens=30)
    first = UnreachableRing(routed((0, 2), (2, 4)), lose_at=4)
    spare = LosingRing([*routed((0, 2)), NodeInfo("h1b", 2, 4, "redis://x")])
    avoided = []

    def build(avoid=frozenset()):
        avoided.append(set(avoid))
        return spare if avoid else first

    def make(_job):
        return CheckedRing(build, lambda: {}, lambda route: [])  # h1's record is fine

    assert run_job(make_session_factory(db_url), job_id, make, ToyCodec(), {EOS}) == "done"
    job = load(db_url, job_id)
    assert job.output_ids == undisturbed(job)
    assert avoided == [set(), {"h1"}] and spare.rounds > 0


def test_an_unreachable_hop_without_a_spare_fails_the_job_with_the_reason(db_url, monkeypatch):

    monkeypatch.setattr(failover, "FAILOVER_WAIT_S", 0.5)
    monkeypatch.setattr(failover, "ROUND_TIMEOUT_S", 1.5)  # how long it is sent again
    monkeypatch.setattr(failover, "UNREACHABLE_PAUSE_S", 0.1)
    job_id = add_job(db_url, max_new_tokens=30)
    ring = UnreachableRing(routed((0, 2), (2, 4)), lose_at=2, refusals=1000)
    make = without_a_spare(ring)

    assert run_job(make_session_factory(db_url), job_id, make, ToyCodec(), {EOS}) == "failed"
    assert "cannot pass the round to h1: OOM" in load(db_url, job_id).error
    assert ring.refused >= 2  # sent again while the outage lasted, then failed


def test_an_unreachable_hop_without_a_spare_is_waited_out(db_url, monkeypatch):
    """A next hop whose Redis is full for a while, with no way around it: the round goes out
    again until it passes, and the job ends as it would undisturbed (it failed at once)."""

    monkeypatch.setattr(failover, "FAILOVER_WAIT_S", 0.2)
    monkeypatch.setattr(failover, "UNREACHABLE_PAUSE_S", 0.05)
    job_id = add_job(db_url, temp=0.9, draft_k=3, max_new_tokens=30)
    ring = UnreachableRing(routed((0, 2), (2, 4)), lose_at=3, refusals=4)
    make = without_a_spare(ring)

    assert run_job(make_session_factory(db_url), job_id, make, ToyCodec(), {EOS}) == "done"
    job = load(db_url, job_id)
    assert ring.refused == 4 and job.output_ids == undisturbed(job)


def test_without_a_spare_a_ring_error_still_fails_the_job_with_it(db_url, monkeypatch):
    monkeypatch.setattr(failover, "FAILOVER_WAIT_S", 0.5)
    job_id = add_job(db_url, max_new_tokens=30)
    ring = LosingRing(routed((0, 2), (2, 4)), lose_at=2, error=True)
    checks = []

    def no_spare(route):
        checks.append([hop.host for hop in route])
        return []

    def make(_job):
        return CheckedRing(lambda: ring, lambda: {}, no_spare)

    assert run_job(make_session_factory(db_url), job_id, make, ToyCodec(), {EOS}) == "failed"
    assert "cannot pass the round to h1" in load(db_url, job_id).error
    assert checks and checks[0] == ["h0", "h1"]  # it looked for a spare before giving up


RESPLIT = {"h0": (0, 1), "h1": (1, 4)}  # the inventory after the model was split again


class RefusingRing(GappyRing):
    """A routed toy ring whose rounds numbered in `refuse_at` are refused by h1, which serves
    other layers than the route has it for: the stage was restarted on a new split, and its
    new record goes into `inventory` as it refuses."""

    def __init__(self, route, refuse_at=(), gap_at=None, inventory=None) -> None:
        super().__init__(route, gap_at)
        self.refuse_at, self.inventory, self.starts = set(refuse_at), inventory, []

    def round(self, r):
        from specpipe.swarm.redis_ring import StaleRouteError

        self.starts.append(r.start_pos)
        if self.rounds + 1 in self.refuse_at:
            self.rounds += 1
            if self.inventory is not None:
                self.inventory.update(RESPLIT)
            raise StaleRouteError("round refused: h1 serves layers 1:4 of toy, not 2:4", "h1")
        return super().round(r)


@pytest.mark.parametrize(
    ("refuse_at", "gap_at", "replays"),
    [({1}, None, 0), ({4}, None, 1), ({4}, 3, 1)],
    ids=["first-round", "mid-job", "between-a-gap-and-its-replay"],
)
def test_a_refused_round_re_routes_and_the_output_is_the_plain_one(refuse_at, gap_at, replays):
    params = SamplingParams(temp=0.9, seed=5)
    prompt = ToyCodec().prompt_ids("the cat sat on the mat")
    expected = Generation(local_ring(), "ref", prompt, params, max_new_tokens=30, draft_k=3).run()
    inventory = {"h0": (0, 2), "h1": (2, 4)}
    old = RefusingRing(routed((0, 2), (2, 4)), refuse_at, gap_at, inventory)
    new = RefusingRing(routed((0, 1), (1, 4)))
    built = iter([old, new])
    ring = CheckedRing(lambda: next(built), lambda: dict(inventory))
    run = Generation(ring, "s", prompt, params, max_new_tokens=30, draft_k=3)
    assert run.run() == expected
    assert (ring.rebuilt, run.stats.replays, ring.refusals) == (1, replays, 0)
    assert ring.route == tuple(new.route) and new.starts[0] == 0  # replayed from the start


def test_a_route_refused_three_times_in_a_row_fails_the_round(monkeypatch):
    from specpipe.swarm.redis_ring import StaleRouteError

    monkeypatch.setattr(failover, "STALE_WAIT_S", 0.05)  # the inventory never changes here
    rings = []

    def build():
        rings.append(RefusingRing(routed((0, 2), (2, 4)), refuse_at=range(1, 100)))
        return rings[-1]

    ring = CheckedRing(build, lambda: {"h0": (0, 2), "h1": (2, 4)})
    run = Generation(ring, "s", [1, 2, 3], SamplingParams(temp=0.0), max_new_tokens=5)
    with pytest.raises(StaleRouteError, match="h1 serves layers 1:4"):
        run.run()
    assert len(rings) == 3 and ring.rebuilt == 2  # a route from each refusal's inventory


def test_a_refused_round_with_no_route_left_fails_the_job_naming_the_layers(db_url):
    import time

    from specpipe.swarm import inventory

    job_id = add_job(db_url, max_new_tokens=30)
    first = RefusingRing(routed((0, 2), (2, 4)), refuse_at={3})
    # After the re-split h1 serves 3:4, and nobody serves 2:3.
    now = [
        NodeInfo("h0", 0, 2, "redis://x", last_heartbeat=time.time()),
        NodeInfo("h1", 3, 4, "redis://x", last_heartbeat=time.time()),
    ]

    def build():
        if first.rounds == 0:
            return first
        return GappyRing(inventory.route(now, 4, model="toy"))

    def make(_job):
        return CheckedRing(build, lambda: {n.host: (n.layer_start, n.layer_end) for n in now})

    assert run_job(make_session_factory(db_url), job_id, make, ToyCodec(), {EOS}) == "failed"
    assert load(db_url, job_id).error == "RouteError: no online stage serves layers 2:3"


def test_a_lock_is_taken_once_a_restarting_redis_answers_again(tmp_path):
    """A delivery that finds Redis down (killed, restarting) waits for it rather than failing."""
    import threading

    import redis

    from specpipe.ops.redis_server import RedisServer, free_port

    port = free_port()
    server = RedisServer(port=port, data_dir=tmp_path)
    starter = threading.Timer(1.5, server.start)
    starter.start()
    client = redis.Redis.from_url(f"redis://127.0.0.1:{port}/0", socket_connect_timeout=1)
    try:
        chosen = job_lock.lock_first_through_outage(client, "s", [7], outage_s=20)
        assert chosen is not None and chosen[0] == 7
        chosen[1].stop()
    finally:
        starter.join()
        server.stop()
        client.close()


def test_a_delivery_whose_redis_stays_away_leaves_the_job_for_beat(db_url, monkeypatch):
    job_id = add_job(db_url)
    monkeypatch.setenv("DATABASE_URL", db_url)
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setattr(coordinator, "REDIS_OUTAGE_S", 0.5)
    coordinator.generate.apply(args=[job_id])
    job = load(db_url, job_id)
    assert job.status == "queued" and job.error is None and job.finished_at is None


def test_malformed_broker_entries_are_skipped_and_the_rest_still_read(db_url, second_redis):
    import json

    import redis

    from models.db import utcnow
    from workers.names import GENERATE_TASK
    from workers.submission import make_client

    long_ago = utcnow() - timedelta(seconds=120)
    lost = add_job(db_url, status="queued", created_at=long_ago)
    waiting = add_job(db_url, status="queued", created_at=long_ago)
    queue = "coordinator"
    client = redis.Redis.from_url(second_redis)
    client.rpush(queue, b"\xff not json", json.dumps({"headers": 3}), "[]")
    make_client(second_redis).send_task(GENERATE_TASK, args=[waiting], queue=queue)
    client.hset("unacked", mapping={"t1": "{}", "t2": json.dumps([{"body": "!!"}]), "t3": "7"})
    try:
        with make_session_factory(db_url)() as session:
            assert stranded_jobs(session, client, queue) == [lost]
    finally:
        client.delete(queue, "unacked")
        client.close()


def test_a_delivery_that_finds_what_it_read_taken_runs_a_job_queued_since(
    db_url, redis_url, swarm, monkeypatch
):
    """Four jobs submitted together once ran three at a time: the delivery of job 2 read the
    queue as [1, 2], the delivery of job 3 took job 2 meanwhile, and job 4's took job 3; job 2's
    delivery found both it had read taken and ended, and job 4 waited for a job to finish. A
    delivery reads the queue again before it ends."""
    import redis as redis_client

    first, second = add_job(db_url), add_job(db_url)
    monkeypatch.setenv("DATABASE_URL", db_url)
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("SPECPIPE_SWARM", swarm)
    client = redis_client.Redis.from_url(redis_url)
    client.set(job_lock.lock_key(swarm, first), "another delivery", px=60_000)
    later: list[int] = []
    real = coordinator.lock_first_through_outage

    def lock_first(redis, swarm_name, candidates, outage_s):
        if not later:  # between this delivery's read and its lock: job 2 taken, job 3 queued
            client.set(job_lock.lock_key(swarm, second), "another delivery", px=60_000)
            later.append(add_job(db_url))
        return real(redis, swarm_name, candidates, outage_s)

    ran = []
    monkeypatch.setattr(coordinator, "lock_first_through_outage", lock_first)
    monkeypatch.setattr(job_run, "run_on_swarm", runs_to_the_end(ran))
    try:
        coordinator.generate.apply(args=[second])
    finally:
        client.delete(*(job_lock.lock_key(swarm, i) for i in (first, second)))
        client.close()
    assert ran == later


def test_a_delivery_whose_job_another_turn_ran_runs_the_next_queued_job(db_url, monkeypatch):
    """Alice's delivery ran bob's job (his turn); bob's delivery then finds his job done and
    runs alice's, which would otherwise wait for beat without a delivery."""
    from tests.factories import gen_job, gen_user

    with make_session_factory(db_url)() as session:
        alice, bob = gen_user(session, "alice"), gen_user(session, "bob")
        hers = gen_job(session, owner=alice)
        his = gen_job(session, owner=bob, status="done")
        session.commit()
        ids = (hers.id, his.id)
    ran = []
    monkeypatch.setattr(job_run, "run_on_swarm", runs_to_the_end(ran))
    monkeypatch.setenv("DATABASE_URL", db_url)
    coordinator.generate.apply(args=[ids[1]])
    assert ran == [ids[0]]


def _spoil(db_url: str, job_id: int, column: str, stored: str) -> None:
    """Store `stored` (SQL text) in one column of a job, as a hand edit or a damaged file would."""
    from sqlalchemy import text

    from models.db import get_engine

    engine = get_engine(db_url)
    if engine.dialect.name != "sqlite":
        pytest.skip("PostgreSQL checks every value against its column's type as it is stored")
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE jobs SET {column} = {stored} WHERE id = :id"), {"id": job_id})


@pytest.mark.parametrize(
    "column, stored",
    [("stop", "'not json'"), ("output_ids", "'[1,'"), ("seed", "'x'"), ("started_at", "'noon'")],
)
def test_a_job_whose_row_cannot_be_read_is_set_aside_and_the_next_runs(
    db_url, monkeypatch, column, stored
):
    """A delivery of a job whose row no column type can parse fails that job with the reason,
    once, and runs the next job whose turn it is; no delivery or beat pass trips on it again."""
    from tests.factories import gen_job, gen_user

    with make_session_factory(db_url)() as session:
        alice, bob = gen_user(session, "alice"), gen_user(session, "bob")
        spoiled, his = gen_job(session, owner=alice).id, gen_job(session, owner=bob).id
    _spoil(db_url, spoiled, column, stored)
    ran = []
    monkeypatch.setattr(job_run, "run_on_swarm", runs_to_the_end(ran))
    monkeypatch.setenv("DATABASE_URL", db_url)
    coordinator.generate.apply(args=[spoiled])
    assert ran == [his]
    with make_session_factory(db_url)() as session:
        status, error = session.execute(
            Job.__table__.select().with_only_columns(Job.status, Job.error).where(Job.id == spoiled)
        ).one()
        assert status == "failed"
        assert "its stored row cannot be read" in error and "set aside" in error
        assert turns.fair_order(session) == []
        later = gen_job(session, owner=bob).id
        assert turns.fair_order(session) == [later]
    coordinator.generate.apply(args=[spoiled])  # a second delivery of it takes the next turn
    assert ran == [his, later]


def test_start_times_that_cannot_be_read_do_not_stop_the_turns(db_url):
    """A finished job whose start time is not a date: its owner counts as never served, and the
    queued jobs are still ordered (before, every delivery raised and no job ran)."""
    from models.db import utcnow
    from tests.factories import gen_job, gen_user

    with make_session_factory(db_url)() as session:
        alice, bob = gen_user(session, "alice"), gen_user(session, "bob")
        old = gen_job(session, owner=alice, status="done", started_at=utcnow()).id
        gen_job(session, owner=bob, status="done", started_at=utcnow())
        his, hers = gen_job(session, owner=bob).id, gen_job(session, owner=alice).id
    _spoil(db_url, old, "started_at", "'noon'")
    with make_session_factory(db_url)() as session:
        assert turns.fair_order(session) == [hers, his]
