"""KV memory budgets: reservations against the stages' budgets in the real Redis, and the
coordinator's job loop waiting for room, refusing a job that never fits, and giving the room
back however a job ends."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from models import Job
from models.db import make_session_factory
from specpipe.swarm.failover import CheckedRing
from specpipe.swarm.inventory import NodeInfo
from specpipe.swarm.kvbudget import (
    Full,
    NeverFits,
    Reservations,
    Room,
    default_budget_tokens,
    room_name,
)
from specpipe.transformer.kvcache import bytes_per_token
from tests.swarm.test_coordinator import (
    EOS,
    GappyRing,
    LosingRing,
    ToyCodec,
    add_job,
    load,
    local_ring,
)
from tests.waiting import wait_until
from workers.job_run import run_job
from workers.room import room_keeper


def hop(host: str, budget: int) -> NodeInfo:
    return NodeInfo(
        host=host, layer_start=0, layer_end=1, redis_url="redis://x", kv_budget_tokens=budget
    )


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture
def holders(client, swarm):
    """Make holder keys (standing in for jobs' locks) that the test deletes when it likes."""
    made = []

    def make(name: str) -> str:
        key = f"specpipe:{swarm}:holder:{name}"
        client.set(key, "1")
        made.append(key)
        return key

    yield make
    if made:
        client.delete(*made)


def test_the_default_budget_is_a_share_of_memory_over_a_tokens_bytes():
    per_token = bytes_per_token(n_layers=10, n_kv_heads=3, head_dim=64, element_size=4)
    assert per_token == 2 * 10 * 3 * 64 * 4
    assert default_budget_tokens(per_token, 8 * 2**30, share=0.5) == 4 * 2**30 // per_token
    assert default_budget_tokens(per_token, 0) == 0  # memory unknown: no budget


def test_room_is_reserved_on_every_hop_or_none(client, swarm, holders):
    rooms = Reservations(client, swarm)
    route = [hop("a", 100), hop("b", 60)]
    assert rooms.reserve(route, "job-1", 50, holders("1"), "x") is None
    assert (rooms.used("a"), rooms.used("b")) == (50, 50)
    # b has 10 left: nothing is taken anywhere, and b is named.
    assert rooms.reserve(route, "job-2", 20, holders("2"), "y") == Full("b", 50, 60)
    assert (rooms.used("a"), rooms.used("b")) == (50, 50)
    rooms.release(route, "job-1", "x")
    assert rooms.reserve(route, "job-2", 20, holders("2"), "y") is None
    assert (rooms.used("a"), rooms.used("b")) == (20, 20)


def test_a_job_larger_than_a_hops_budget_never_fits(client, swarm, holders):
    rooms = Reservations(client, swarm)
    with pytest.raises(NeverFits, match="stage b ever holds \\(60 tokens\\)"):
        rooms.reserve([hop("a", 100), hop("b", 60)], "job-1", 61, holders("1"), "x")
    assert rooms.used("a") == 0
    # No budget advertised (0): anything fits.
    assert rooms.reserve([hop("c", 0)], "job-1", 10**9, holders("1"), "x") is None


def test_the_room_of_a_holder_that_is_gone_comes_back(client, swarm, holders):
    rooms = Reservations(client, swarm)
    route = [hop("a", 100)]
    dead = holders("dead")
    assert rooms.reserve(route, "job-1", 80, dead, "x") is None
    assert rooms.reserve(route, "job-2", 80, holders("2"), "y") == Full("a", 80, 100)
    client.delete(dead)  # its coordinator died: its lock lapsed
    assert rooms.reserve(route, "job-2", 80, holders("2"), "y") is None
    assert client.hlen(f"specpipe:{swarm}:kv:a") == 1  # the orphan is gone


def test_a_resumed_job_takes_over_its_own_room(client, swarm, holders):
    rooms = Reservations(client, swarm)
    route = [hop("a", 100)]
    lock = holders("1")
    assert rooms.reserve(route, "job-1", 80, lock, "first") is None
    # The same job again (its coordinator died and the lock was taken again): it fits.
    assert rooms.reserve(route, "job-1", 80, lock, "second") is None
    rooms.release(route, "job-1", "first")  # the old attempt's late release takes nothing
    assert rooms.used("a") == 80
    rooms.release(route, "job-1", "second")
    assert rooms.used("a") == 0


def test_a_waiter_whose_coordinator_died_is_not_listed(client, swarm, holders):
    rooms = Reservations(client, swarm)
    alive, dead = holders("alive"), holders("dead")
    rooms.mark_waiting("job-1", alive, Full("a", 90, 100), 20)
    rooms.mark_waiting("job-2", dead, Full("b", 50, 60), 20)
    client.delete(dead)
    assert rooms.waiting() == {"job-1": {"host": "a", "used": 90, "budget": 100, "need": 20}}


class RouteRing:
    """The toy ring with a route whose stages advertise a budget; rounds can be held up."""

    def __init__(self, budget: int, gate: threading.Event | None = None, fail=None):
        self.ring, self.route = local_ring(), [hop("s0", budget), hop("s1", budget)]
        self.gate, self.fail = gate, fail
        self.rounds = 0
        self.on_reroute = None  # its route never changes

    def reset(self, session, params, prefix=None):
        self.ring.reset(session, params, prefix)

    def reseed(self, session, params):
        self.ring.reseed(session, params)

    def round(self, r):
        self.rounds += 1
        if self.gate is not None:
            assert self.gate.wait(30)
        if self.fail is not None:
            raise self.fail
        return self.ring.round(r)

    def drop(self, session, keep=None):
        self.ring.drop(session, keep)

    def close(self):
        self.ring.close()


PROMPT_TOKENS = len(ToyCodec().prompt_ids("the cat sat on the mat"))


def start_job(db_url, job_id, ring, client, swarm, lock, owned=lambda: True):
    """Run the job in a thread of its own, as a coordinator's thread would, with its room kept
    in the real Redis; returns the thread and where its outcome lands."""
    out = {}

    def run():
        with make_session_factory(db_url)() as session:
            admit = room_keeper(session, Reservations(client, swarm), lock, owned, poll_s=0.05)
            try:
                out["status"] = run_job(
                    session, job_id, lambda _j: ring, ToyCodec(), {EOS}, admit=admit
                )
            except BaseException as exc:  # a dying coordinator: SystemExit
                out["raised"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_a_job_that_never_fits_fails_at_once_with_the_reason(db_url, client, swarm, holders):
    job_id = add_job(db_url, max_new_tokens=40)
    ring = RouteRing(budget=PROMPT_TOKENS + 39)
    thread, out = start_job(db_url, job_id, ring, client, swarm, holders("1"))
    thread.join(30)
    job = load(db_url, job_id)
    assert out["status"] == "failed" and ring.rounds == 0
    assert job.error.startswith("NeverFits: the job needs ")
    assert f"({PROMPT_TOKENS + 39} tokens)" in job.error
    assert job.attempts == 0 and job.started_at is None


def test_a_second_job_waits_queued_until_the_first_gives_back_its_room(
    db_url, client, swarm, holders
):
    need = PROMPT_TOKENS + 24
    gate = threading.Event()
    first, second = add_job(db_url), add_job(db_url, seed=6)
    rooms = Reservations(client, swarm)
    t1, out1 = start_job(db_url, first, RouteRing(need + 5, gate), client, swarm, holders("1"))
    wait_until(lambda: rooms.used("s0") == need, 10, "the first job's room")
    ring2 = RouteRing(need + 5)
    t2, out2 = start_job(db_url, second, ring2, client, swarm, holders("2"))
    time.sleep(0.5)
    assert load(db_url, second).status == "queued" and ring2.rounds == 0
    assert load(db_url, first).status == "running"
    assert rooms.waiting() == {
        f"job-{second}": {"host": "s0", "used": need, "budget": need + 5, "need": need}
    }
    gate.set()
    t1.join(30)
    t2.join(30)
    assert (out1["status"], out2["status"]) == ("done", "done")
    a, b = load(db_url, first), load(db_url, second)
    assert b.started_at >= a.finished_at
    assert (rooms.used("s0"), rooms.used("s1")) == (0, 0)
    assert rooms.waiting() == {}


def test_a_job_waits_out_a_redis_that_is_restarting_for_its_room(db_url, client, swarm, holders):
    """Redis killed while a job is about to start: its reservation waits, as a round does,
    instead of failing the job."""

    class Restarting(Reservations):
        refusals = 3

        def reserve(self, *args, **kwargs):
            if self.refusals:
                self.refusals -= 1
                raise redis.ConnectionError("Error 111 connecting to 127.0.0.1. Refused.")
            return super().reserve(*args, **kwargs)

    job_id = add_job(db_url, max_new_tokens=20)
    rooms = Restarting(client, swarm)
    with make_session_factory(db_url)() as session:
        admit = room_keeper(session, rooms, holders("1"), lambda: True, poll_s=0.05)
        status = run_job(session, job_id, lambda _j: RouteRing(500), ToyCodec(), {EOS}, admit=admit)
    assert status == "done" and rooms.refusals == 0
    assert rooms.used("s0") == 0


@pytest.mark.parametrize("ending", ["done", "failed", "cancelled"])
def test_no_room_is_left_reserved_however_a_job_ends(db_url, client, swarm, holders, ending):
    job_id = add_job(db_url, max_new_tokens=40, draft_k=0)
    rooms = Reservations(client, swarm)
    budget = PROMPT_TOKENS + 40

    class Ending(RouteRing):
        def round(self, r):
            assert rooms.used("s1") == budget  # the room is held while the job runs
            if self.rounds == 2 and ending == "failed":
                raise ValueError("a stage broke")
            if self.rounds == 2 and ending == "cancelled":
                with make_session_factory(db_url)() as other:
                    other.get(Job, job_id).request_cancel()
                    other.commit()
            return super().round(r)

    thread, out = start_job(db_url, job_id, Ending(budget), client, swarm, holders("1"))
    thread.join(30)
    assert out["status"] == ending == load(db_url, job_id).status
    assert (rooms.used("s0"), rooms.used("s1")) == (0, 0)
    assert client.hlen(f"specpipe:{swarm}:kv:s0") == 0


def test_the_room_of_a_job_whose_coordinator_died_comes_back_when_its_lock_lapses(
    db_url, client, swarm, holders
):
    """A coordinator killed mid-job runs no clean-up: here its thread hangs in a round for good
    while its lock lapses, as a killed process's does."""
    job_id = add_job(db_url, max_new_tokens=40, draft_k=0)
    rooms = Reservations(client, swarm)
    budget, lock, gate = PROMPT_TOKENS + 40, holders("1"), threading.Event()
    thread, _ = start_job(db_url, job_id, RouteRing(budget, gate), client, swarm, lock)
    try:
        wait_until(lambda: rooms.used("s0") == budget, 10, "the job's room")
        assert rooms.reserve([hop("s0", budget)], "job-2", budget, holders("2"), "a") == Full(
            "s0", budget, budget
        )
        client.delete(lock)
        assert rooms.reserve([hop("s0", budget)], "job-2", budget, holders("2"), "a") is None
    finally:
        gate.set()
        thread.join(30)
    assert rooms.used("s0") == budget  # the dead attempt's late release took nothing of job 2


def test_a_job_cancelled_while_it_waits_ends_cancelled_without_running(
    db_url, client, swarm, holders
):
    rooms = Reservations(client, swarm)
    need = PROMPT_TOKENS + 24
    assert rooms.reserve([hop("s0", need)], "job-other", need, holders("other"), "a") is None
    job_id = add_job(db_url)
    ring = RouteRing(need)
    thread, out = start_job(db_url, job_id, ring, client, swarm, holders("1"))
    # Cancelled once it waits for room (a fixed pause was too short on a loaded machine).
    wait_until(lambda: list(rooms.waiting()) == [f"job-{job_id}"], 30, "the job to wait for room")
    with make_session_factory(db_url)() as session:
        session.get(Job, job_id).request_cancel()
        session.commit()
    thread.join(30)
    assert out["status"] == "cancelled" and ring.rounds == 0
    assert load(db_url, job_id).status == "cancelled"
    assert rooms.waiting() == {}


def test_a_job_beyond_the_models_context_fails_at_once_in_the_coordinator(db_url):
    """Where the submitting process could not open the model, the coordinator checks."""
    from specpipe.decoding.target import Target

    codec = ToyCodec()
    target = Target(
        name="toy",
        n_layers=4,
        prompt_ids=codec.prompt_ids,
        decode=codec.decode,
        context_length=PROMPT_TOKENS + 39,
    )
    job_id = add_job(db_url, max_new_tokens=40)
    ring = RouteRing(budget=0)
    with make_session_factory(db_url)() as session:
        status = run_job(session, job_id, lambda _j: ring, target, {EOS})
    job = load(db_url, job_id)
    assert status == "failed" and ring.rounds == 0
    assert job.error == (
        f"the prompt is {PROMPT_TOKENS} tokens, and with max_new_tokens 40 the job needs "
        f"{PROMPT_TOKENS + 40} positions, beyond the model's context of {PROMPT_TOKENS + 39} tokens"
    )


def test_a_running_jobs_room_is_taken_even_on_a_full_stage(client, swarm, holders):
    rooms = Reservations(client, swarm)
    spare = [hop("spare", 100)]
    assert rooms.reserve(spare, "job-1", 80, holders("1"), "x") is None
    # The job already runs there: its room is taken, and the stage is named as overflowed.
    assert rooms.take(spare, "job-2", 50, holders("2"), "y") == [Full("spare", 80, 100)]
    assert rooms.used("spare") == 130
    rooms.release(spare, "job-1", "x")
    # A later job waits for room there, as long as the running one holds it.
    assert rooms.reserve(spare, "job-3", 60, holders("3"), "z") == Full("spare", 50, 100)
    rooms.release(spare, "job-2", "y")
    assert rooms.reserve(spare, "job-3", 60, holders("3"), "z") is None


def test_a_room_follows_its_route_and_is_released_where_it_is(client, swarm, holders):
    rooms = Reservations(client, swarm)
    lock = holders("1")
    assert rooms.reserve([hop("a", 100), hop("b", 100)], "job-1", 30, lock, "x") is None
    room = Room(rooms, [hop("a", 100), hop("b", 100)], "job-1", 30, lock, "x")
    assert room.follow([hop("a", 100), hop("c", 100)]) == []
    assert [rooms.used(h) for h in "abc"] == [30, 0, 30]
    room.release()
    assert [rooms.used(h) for h in "abc"] == [0, 0, 0]


def fields(client, swarm, *hosts) -> dict[str, set[str]]:
    """The reservations' names on each of `hosts`."""
    return {h: {f.decode() for f in client.hkeys(f"specpipe:{swarm}:kv:{h}")} for h in hosts}


class Watched(LosingRing):
    """The ring a job is moved onto: its first round records `look()`."""

    def __init__(self, route, look) -> None:
        super().__init__(route)
        self.look, self.seen = look, None

    def round(self, r):
        if self.seen is None:
            self.seen = self.look()
        return super().round(r)


NEED = PROMPT_TOKENS + 30  # the room of a job of add_job(max_new_tokens=30)


def moved_job(db_url, client, swarm, holders, rooms, look, change="failover", spare_budget=500):
    """Run a job through room_keeper on s0 -> s1 until its third round, when s1 is lost
    (failover) or serves other layers (rebuild), and then on s0 -> s1b; returns the job's room
    name, its status and what `look()` saw in the first round on s1b."""
    job_id = add_job(db_url, temp=0.9, draft_k=3, max_new_tokens=30)
    if change == "failover":
        first = LosingRing([hop("s0", 500), hop("s1", 500)], lose_at=3)
    else:
        first = GappyRing([hop("s0", 500), hop("s1", 500)], gap_at=3)
    moved = Watched([hop("s0", 500), hop("s1b", spare_budget)], look)
    built = iter([first, moved])

    def build(avoid=frozenset()):
        return next(built)

    ring = CheckedRing(build, lambda: {"s0": (0, 1), "s1": (1, 2)}, lambda r: ["s1"])
    with make_session_factory(db_url)() as session:
        admit = room_keeper(session, rooms, holders("1"), lambda: True)
        status = run_job(session, job_id, lambda _j: ring, ToyCodec(), {EOS}, admit=admit)
    assert moved.rounds > 0
    return room_name(job_id), status, moved.seen


@pytest.mark.parametrize("change", ["failover", "rebuild"])
def test_a_jobs_room_moves_with_its_route_and_its_end_releases_the_new_one(
    db_url, client, swarm, holders, change
):
    rooms = Reservations(client, swarm)
    name, status, seen = moved_job(
        db_url,
        client,
        swarm,
        holders,
        rooms,
        lambda: fields(client, swarm, "s0", "s1", "s1b"),
        change,
    )
    assert status == "done"
    assert seen == {"s0": {name}, "s1": set(), "s1b": {name}}
    assert fields(client, swarm, "s0", "s1", "s1b") == {"s0": set(), "s1": set(), "s1b": set()}


def test_a_job_moved_onto_a_full_stage_takes_its_room_there_and_later_jobs_wait(
    db_url, client, swarm, holders, caplog
):
    rooms = Reservations(client, swarm)
    spare = hop("s1b", NEED + 10)
    assert rooms.reserve([spare], "job-other", 20, holders("other"), "o") is None

    def look():
        return rooms.used("s1b"), rooms.reserve([spare], "job-later", 1, holders("later"), "l")

    _, status, seen = moved_job(db_url, client, swarm, holders, rooms, look, spare_budget=NEED + 10)
    assert status == "done"
    # Over its budget while the job runs there; a job that would fit beside the other waits.
    assert seen == (20 + NEED, Full("s1b", 20 + NEED, NEED + 10))
    assert "stage s1b is over its KV budget: it held 20 of" in caplog.text
    assert rooms.used("s1b") == 20  # the job's end gave its room there back


def test_a_redis_error_while_the_room_moves_does_not_fail_the_job(
    db_url, client, swarm, holders, caplog
):
    class Refusing(Reservations):
        def take(self, *args, **kwargs):
            raise redis.ConnectionError("Error 111 connecting to 127.0.0.1. Refused.")

    rooms = Refusing(client, swarm)
    name, status, seen = moved_job(
        db_url, client, swarm, holders, rooms, lambda: fields(client, swarm, "s1")["s1"]
    )
    assert status == "done"
    assert seen == {name}  # the move failed before s1's room was given back
    assert "could not move its KV room onto its new route" in caplog.text
    # The job's end gave back its room on both routes.
    assert fields(client, swarm, "s0", "s1", "s1b") == {"s0": set(), "s1": set(), "s1b": set()}


BUDGET = 100  # tokens of cache per stage in the swarm below: one job of 60 new tokens at a time


@pytest.fixture(scope="module")
def budget_swarm(tmp_path_factory, database_url):
    """Two `specpipe worker stage` processes of the tiny checkpoint whose KV budget is BUDGET,
    a coordinator process and a private Redis locked down as `specpipe up` runs it."""
    import secrets
    import uuid

    from specpipe.ops.redis_server import RedisServer
    from tests.swarmprocs import Swarm, write_tiny_model

    tiny = write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")
    with RedisServer(password=secrets.token_hex(16)) as server:
        group = Swarm(
            server.url,
            f"t{uuid.uuid4().hex[:8]}",
            secrets.token_hex(16),
            tiny,
            DATABASE_URL=database_url,
            SPECPIPE_STALLED_S="2",
            SPECPIPE_KV_BUDGET_TOKENS=str(BUDGET),
        )
        try:
            group.start_stage("s0", "0:2")
            group.start_stage("s1", "2:4")
            group.start_coordinator(log=tmp_path_factory.mktemp("logs") / "coordinator.log")
            group.wait_stages(["s0", "s1"])
            yield group
        finally:
            group.stop()


@pytest.mark.slow
def test_on_real_stages_a_job_waits_for_room_and_one_that_never_fits_fails(budget_swarm, db_url):
    from specpipe.settings import job_limits
    from specpipe.swarm import inventory
    from workers.submission import Submitter

    swarm = budget_swarm
    client = redis.Redis.from_url(swarm.redis_url)
    try:
        nodes = inventory.load(client, swarm.swarm, swarm.key)
        assert sorted(n.kv_budget_tokens for n in nodes) == [BUDGET, BUDGET]
    finally:
        client.close()
    submitter = Submitter.connect(swarm.redis_url, str(swarm.model), job_limits())

    def submit(**fields) -> int:
        request = {"prompt": "hello world", "temp": 0.8, "top_p": 1.0, "seed": 3, **fields}
        with make_session_factory(db_url)() as session:
            return submitter.submit(session, submitter.check(request)).id

    def finished(ids):
        def check():
            with make_session_factory(db_url)() as session:
                jobs = [session.get(Job, i) for i in ids]
            return jobs if all(j.finished for j in jobs) else None

        return check

    (huge,) = wait_until(finished([submit(max_new_tokens=BUDGET)]), 30, "the huge job to end")
    assert huge.status == "failed" and huge.rounds == 0
    assert "NeverFits" in huge.error and f"stage s0 ever holds ({BUDGET} tokens)" in huge.error
    ids = [submit(max_new_tokens=60, seed=s) for s in (1, 2)]
    first, second = wait_until(finished(ids), 120, "the two jobs to end")
    assert (first.status, second.status) == ("done", "done"), (first.error, second.error)
    # The second waited for the first's room: one ran after the other.
    one, other = sorted((first, second), key=lambda j: j.started_at)
    assert other.started_at >= one.finished_at
