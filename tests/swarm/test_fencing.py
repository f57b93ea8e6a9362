"""Fenced writes on a real store: an attempt that a newer one superseded (its lock lost in a
registry outage while beat resumed the job elsewhere) changes nothing, and outages that resume
a job which goes on making progress never use up its starts."""

from __future__ import annotations

import threading

import pytest

from models import Job
from models.db import make_session_factory
from models.runs import Run, start_run
from tests.swarm.test_coordinator import (
    EOS,
    DyingRing,
    ToyCodec,
    add_job,
    load,
    local_ring,
    run_job,
    undisturbed,
)
from workers import job_run
from workers.attempt import Attempt, Superseded


def started(sessions, job_id: int) -> tuple:
    """(a session of its own, the attempt it started on job `job_id`), as a coordinator has."""
    session = sessions()
    job, _ = job_run.pending(session, job_id)
    return session, Attempt.seen(job).start(session, prompt_tokens=5)


def rows(db_url, job_id: int) -> tuple:
    job = load(db_url, job_id)
    return (
        job.status,
        job.attempts,
        job.output_ids,
        job.output_text,
        job.rounds,
        job.accepted_drafts,
        job.error,
        job.finished_at,
    )


def test_a_superseded_attempts_progress_changes_nothing(db_url):
    job_id = add_job(db_url)
    sessions = make_session_factory(db_url)
    old_session, old = started(sessions, job_id)
    old.progress(old_session, [1, 2, 3], "bcd", [0, 0, 0], 1.0)
    new_session, new = started(sessions, job_id)  # beat resumed it elsewhere
    assert (old.number, new.number) == (1, 2)
    assert load(db_url, job_id).starts_since_progress == 1
    new.progress(new_session, [1, 2, 3, 4], "bcde", [0, 0, 0, 0], 2.0)
    stored = rows(db_url, job_id)
    with pytest.raises(Superseded):
        old.progress(old_session, [1, 2], "bc", [0, 0], 1.0)  # a shorter prefix
    assert rows(db_url, job_id) == stored
    assert stored[:5] == ("running", 2, [1, 2, 3, 4], "bcde", 4)
    job = load(db_url, job_id)
    assert (job.starts_since_progress, job.prompt_tokens) == (0, 5)
    new.progress(new_session, [1, 2, 3, 4, 5], "bcdef", [0] * 5, 2.5)  # the newer goes on
    assert load(db_url, job_id).output_ids == [1, 2, 3, 4, 5]
    old_session.close()
    new_session.close()


@pytest.mark.parametrize("status", ["done", "failed"])
def test_a_superseded_attempts_end_changes_nothing(db_url, status):
    job_id = add_job(db_url)
    sessions = make_session_factory(db_url)
    old_session, old = started(sessions, job_id)
    new_session, new = started(sessions, job_id)
    new.run_started(new_session, start_run(new_session, "generation", snapshot=False))
    new.progress(new_session, [1, 2], "bc", [0, 0], 1.0)
    stored = rows(db_url, job_id)
    with pytest.raises(Superseded):
        old.finish(old_session, status, RuntimeError("a lost lock"))
    assert rows(db_url, job_id) == stored and stored[0] == "running"
    # Through the coordinator's `finish`: nothing written, the job's current status returned.
    assert job_run.finish(old_session, old, status) == "running"
    assert rows(db_url, job_id) == stored
    with sessions() as session:
        assert session.get(Run, load(db_url, job_id).run_id).finished_at is None
    new.finish(new_session, "done")
    ended = rows(db_url, job_id)
    assert ended[0] == "done" and ended[-1] is not None
    assert job_run.finish(old_session, old, status) == "done"  # nor after the newer one ended
    assert rows(db_url, job_id) == ended
    with sessions() as session:
        assert session.get(Run, load(db_url, job_id).run_id).finished_at is not None
    old_session.close()
    new_session.close()


def test_a_coordinator_that_read_a_job_ends_it_only_while_nobody_started_it(db_url):
    job_id = add_job(db_url)
    sessions = make_session_factory(db_url)
    with sessions() as reader:
        seen = Attempt.seen(job_run.pending(reader, job_id)[0])
        new_session, new = started(sessions, job_id)
        assert job_run.finish(reader, seen, "cancelled") == "running"
    assert load(db_url, job_id).status == "running"
    new_session.close()


def test_pending_reads_the_job_as_the_store_holds_it_now(db_url):
    job_id = add_job(db_url)
    sessions = make_session_factory(db_url)
    with sessions() as long_lived:
        job, _ = job_run.pending(long_lived, job_id)  # held: the session keeps it as it read it
        assert job.attempts == 0
        long_lived.commit()
        with sessions() as other:
            other.get(Job, job_id).attempts = 1
            other.commit()
        assert job_run.pending(long_lived, job_id)[0].attempts == 1


class PausingRing(DyingRing):
    """A ring that calls `on_round(n)` before its n-th round, and counts its rounds."""

    def __init__(self, on_round) -> None:
        super().__init__(local_ring(), rounds=1_000)
        self.count = 0
        self.on_round = self._count
        self.hook = on_round

    def _count(self) -> None:
        self.count += 1
        self.hook(self.count)


def test_an_attempt_superseded_in_a_registry_outage_stops_and_the_newer_one_finishes(db_url):
    """Attempt 1 runs on through an outage (its lock keeper cannot tell it lost the lock);
    beat resumes the job as attempt 2; attempt 1's next round stops it with no write, and
    attempt 2 ends the job with the whole output."""
    job_id = add_job(db_url, temp=0.9, draft_k=3, max_new_tokens=30)
    sessions = make_session_factory(db_url)
    paused, resume = threading.Event(), threading.Event()
    first: dict = {}

    def pause_before_fourth(n: int) -> None:
        if n == 4:
            paused.set()
            assert resume.wait(30)

    first_ring = PausingRing(pause_before_fourth)

    def run_first() -> None:
        first["status"] = run_job(
            sessions, job_id, lambda j: first_ring, ToyCodec(), {EOS}, keep_alive=lambda: True
        )

    thread = threading.Thread(target=run_first)
    thread.start()
    assert paused.wait(30)
    seen: dict = {}

    def let_the_first_go_on(n: int) -> None:
        if n == 2:  # attempt 2 started and stored a round
            seen["before"] = rows(db_url, job_id)
            resume.set()
            thread.join(30)
            seen["after"] = rows(db_url, job_id)

    second_ring = PausingRing(let_the_first_go_on)
    assert run_job(sessions, job_id, lambda j: second_ring, ToyCodec(), {EOS}) == "done"
    assert not thread.is_alive()
    assert first["status"] == "running"  # the job's status as attempt 1 stopped
    assert first_ring.count == 4  # it stopped at the write after its round
    assert seen["after"] == seen["before"] and seen["before"][:2] == ("running", 2)
    job = load(db_url, job_id)
    assert (job.status, job.attempts, job.error) == ("done", 2, None)
    assert job.output_ids == undisturbed(job)
    assert job.output_text == ToyCodec().decode([t for t in job.output_ids if t != EOS])
    assert job.rounds == len(job.accepted_drafts)


def test_starts_that_each_stored_progress_never_use_up_the_job(db_url):
    job_id = add_job(db_url, temp=0.9, draft_k=0, max_new_tokens=40)
    sessions = make_session_factory(db_url)
    for start in range(1, 5):  # more starts than MAX_ATTEMPTS, each storing two rounds
        with pytest.raises(SystemExit):
            run_job(sessions, job_id, lambda j: DyingRing(local_ring(), 2), ToyCodec(), {EOS})
        job = load(db_url, job_id)
        assert (job.status, job.attempts, len(job.output_ids)) == ("running", start, 2 * start)
    assert run_job(sessions, job_id, local_ring, ToyCodec(), {EOS}) == "done"
    job = load(db_url, job_id)
    assert (job.status, job.attempts, job.error) == ("done", 5, None)
    assert job.output_ids == undisturbed(job)


def test_starts_in_a_row_without_progress_still_give_up(db_url):
    job_id = add_job(db_url, temp=0.9, draft_k=0, max_new_tokens=40)
    sessions = make_session_factory(db_url)
    with pytest.raises(SystemExit):  # a start that stored two rounds
        run_job(sessions, job_id, lambda j: DyingRing(local_ring(), 2), ToyCodec(), {EOS})
    for _ in range(job_run.MAX_ATTEMPTS):  # then starts that die before storing any
        with pytest.raises(SystemExit):
            run_job(sessions, job_id, lambda j: DyingRing(local_ring(), 0), ToyCodec(), {EOS})
    assert run_job(sessions, job_id, local_ring, ToyCodec(), {EOS}) == "failed"
    job = load(db_url, job_id)
    assert job.error == "gave up after 3 attempts: its coordinator stopped each time"
    assert (job.attempts, len(job.output_ids)) == (1 + job_run.MAX_ATTEMPTS, 2)
