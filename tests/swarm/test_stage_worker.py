"""The stage worker's handling of single messages, in this process, against a real Redis."""

import time
from dataclasses import replace

import pytest
import redis
import torch

from specpipe import stage_worker, streams, wire
from specpipe.stage_worker import StageWorker, WorkerConfig
from tests.swarm.toy_stage import ToyConfig, ToyStage

RESET = {"temp": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}


@pytest.fixture
def make(swarm, key, redis_url):
    def build(host: str, start: int, end: int) -> StageWorker:
        config = WorkerConfig(host=host, swarm=swarm, key=key, redis_url=redis_url)
        return StageWorker(ToyStage(ToyConfig(), start, end), config)

    return build


def replies(redis_url, swarm, key, session="s"):
    client = redis.Redis.from_url(redis_url)
    entries = client.xrange(streams.reply_key(swarm, session))
    client.close()
    return [wire.decode(f[streams.FIELD], swarm, key) for _, f in entries]


def round_message(redis_url, hosts, hop=0, tokens=(1, 2, 3), n_draft=0, tensor=None, rid="r",
                  start_pos=0):  # fmt: skip
    route = tuple(wire.Hop(h, redis_url) for h in hosts)
    return wire.Message(kind="round", session="s", round_id=rid, tokens=tokens, n_draft=n_draft,
                        tensor=tensor, route=route, hop=hop, reply=redis_url,
                        start_pos=start_pos)  # fmt: skip


def test_tail_with_a_draft_outside_the_vocabulary_replies_error(make, swarm, key, redis_url):
    tail = make("t", 2, 4)
    tail.handle(wire.encode(wire.Message(kind="reset", session="s", params=RESET), swarm, key))
    msg = round_message(redis_url, ["a", "t"], hop=1, tokens=(1, 999), n_draft=1,
                        tensor=torch.zeros(2, ToyConfig.dim))  # fmt: skip
    tail.handle(wire.encode(msg, swarm, key))
    (reply,) = replies(redis_url, swarm, key)
    assert reply.kind == "error" and "draft ids" in reply.reason and reply.round_id == "r"
    assert tail.counters["errors"] == 1


def test_tail_answers_the_result_vector(make, swarm, key, redis_url):
    tail = make("t", 0, 4)
    tail.handle(wire.encode(wire.Message(kind="reset", session="s", params=RESET), swarm, key))
    tail.handle(wire.encode(round_message(redis_url, ["t"], tokens=(1, 2, 3, 4), n_draft=2), swarm,
                            key))  # fmt: skip
    (reply,) = replies(redis_url, swarm, key)
    assert reply.kind == "result" and len(reply.tokens) == 3
    assert all(t == -1 or 0 <= t < ToyConfig.vocab for t in reply.tokens)


def test_misrouted_and_misplaced_messages_are_dropped(make, swarm, key, redis_url):
    worker = make("a", 0, 2)
    worker.handle(wire.encode(round_message(redis_url, ["b", "a"]), swarm, key))  # not for a
    worker.handle(wire.encode(wire.Message(kind="result", session="s"), swarm, key))
    worker.handle(wire.encode(wire.Message(kind="reset", session="s", params={"temp": 1}), swarm,
                              key))  # fmt: skip
    worker.handle(wire.encode(round_message(redis_url, ["a"], tokens=()), swarm, key))
    worker.handle(None)
    assert worker.counters["dropped"] == 5
    assert worker.counters["processed"] == 0
    client = redis.Redis.from_url(redis_url)
    assert client.hget(streams.stats_key(swarm, "a"), "dropped") == b"5"
    client.close()


def test_a_route_that_ends_before_the_tail_is_an_error_reply(make, swarm, key, redis_url):
    worker = make("a", 0, 2)
    worker.handle(wire.encode(round_message(redis_url, ["a"]), swarm, key))
    (reply,) = replies(redis_url, swarm, key)
    assert reply.kind == "error" and "not a tail" in reply.reason


def test_middle_stage_without_hidden_states_drops_the_round(make, swarm, key, redis_url):
    worker = make("m", 1, 3)
    worker.handle(wire.encode(round_message(redis_url, ["a", "m", "t"], hop=1), swarm, key))
    assert worker.counters["dropped"] == 1 and replies(redis_url, swarm, key) == []


class Clock:
    """The stage worker's `time`, with a monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)  # perf_counter, sleep: the real ones


def test_sessions_idle_past_the_limit_are_forgotten_and_answer_a_gap(
    swarm, key, redis_url, monkeypatch
):
    """A dead coordinator's caches are freed; if its job comes back, it gets a gap."""
    clock = Clock()
    monkeypatch.setattr(stage_worker, "time", clock)
    config = WorkerConfig(host="t", swarm=swarm, key=key, redis_url=redis_url,
                          session_idle_s=0.3)  # fmt: skip
    stage = ToyStage(ToyConfig(), 0, 4)
    tail = StageWorker(stage, config)

    def send(session: str, message: wire.Message) -> None:
        tail.handle(wire.encode(replace(message, session=session), swarm, key))

    for session in ("old", "new"):
        send(session, wire.Message(kind="reset", session=session, params=RESET))
        send(session, round_message(redis_url, ["t"], tokens=(1, 2, 3), rid=f"{session}-1"))
    clock.now += 0.4
    send("new", round_message(redis_url, ["t"], tokens=(4,), rid="new-2", start_pos=3))
    assert tail.forget_idle_sessions() == ["old"]
    assert set(stage.caches) == {"new"} and stage.cache_len("new") == 4
    send("old", round_message(redis_url, ["t"], tokens=(4,), rid="old-2", start_pos=3))
    assert [r.kind for r in replies(redis_url, swarm, key, "old")] == ["result", "gap"]
    assert [r.kind for r in replies(redis_url, swarm, key, "new")] == ["result", "result"]


def test_processed_rounds_leave_counters_and_timings_in_the_stats(make, swarm, key, redis_url):
    tail = make("t", 0, 4)
    tail.handle(wire.encode(wire.Message(kind="reset", session="s", params=RESET), swarm, key))
    tail.handle(wire.encode(round_message(redis_url, ["t"], tokens=(1, 2, 3)), swarm, key))
    tail.handle(wire.encode(round_message(redis_url, ["x"], rid="r2"), swarm, key))  # dropped
    tail.flush_counters()
    client = redis.Redis.from_url(redis_url)
    stats = streams.read_stats(client, swarm, "t")
    client.close()
    assert stats["processed"] == 1 and stats["dropped"] == 1
    assert stats["forward_ms"] > 0 and stats["hop_ms"] > 0
