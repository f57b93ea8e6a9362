"""The stage worker's handling of single messages, in this process, against a real Redis."""

import pytest
import redis
import torch

from specpipe import streams, wire
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


def round_message(redis_url, hosts, hop=0, tokens=(1, 2, 3), n_draft=0, tensor=None, rid="r"):
    route = tuple(wire.Hop(h, redis_url) for h in hosts)
    return wire.Message(kind="round", session="s", round_id=rid, tokens=tokens, n_draft=n_draft,
                        tensor=tensor, route=route, hop=hop, reply=redis_url)  # fmt: skip


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
