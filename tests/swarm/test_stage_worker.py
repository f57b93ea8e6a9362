"""The stage worker's handling of single messages, in this process, against a real Redis."""

import socket
import threading
import time
from dataclasses import replace

import pytest
import redis
import torch

from specpipe.ops.link_delay import DelayedLink
from specpipe.swarm import gathering, inventory, streams, wire
from specpipe.swarm.stage import activity, routing
from specpipe.swarm.stage.sending import Sender
from specpipe.swarm.stage.worker import StageWorker, WorkerConfig
from tests.swarm.handling import handle
from tests.swarm.toy_stage import ToyConfig, ToyStage
from tests.waiting import wait_until

RESET = {"temp": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}


@pytest.fixture
def make(swarm, key, redis_url):
    def build(host: str, start: int, end: int) -> StageWorker:
        config = WorkerConfig(host=host, swarm=swarm, keys=key, redis_url=redis_url)
        return StageWorker(ToyStage(ToyConfig(), start, end), config)

    return build


_last_seq = 0


def signed(worker: StageWorker, message: wire.Message, **fields) -> bytes:
    """`message` as its rightful sender sends it to `worker`: addressed to its stream, from the
    coordinator (or the previous hop), with the session's next sequence number."""
    global _last_seq
    _last_seq = wire.next_seq(_last_seq)
    hop = message.hop
    sender = message.route[hop - 1].host if message.kind == "round" and hop else wire.COORDINATOR
    rightful = dict(to=worker.stream, sender=sender, seq=_last_seq)
    message = replace(message, **{**rightful, **fields})
    return wire.encode(message, worker.config.swarm, worker.keys)


def deliver(worker: StageWorker, message: wire.Message, **fields) -> None:
    handle(worker, signed(worker, message, **fields))


def replies(redis_url, swarm, key, session="s"):
    """The replies to `session`'s coordinator, every stage host's reply stream together, in the
    order they were written."""
    client = redis.Redis.from_url(redis_url)
    entries = []
    for stream in client.scan_iter(match=streams.reply_key(swarm, session, "*")):
        entries += client.xrange(stream)
    client.close()
    entries.sort(key=lambda entry: tuple(int(part) for part in entry[0].split(b"-")))
    return [wire.decode(f[streams.FIELD], swarm, key) for _, f in entries]


def listed(redis_url, swarm, key, *hosts):
    """Records of `hosts` in the inventory: where a stage finds the hop it passes a round to."""
    client = redis.Redis.from_url(redis_url)
    for host in hosts:
        inventory.publish(client, swarm, inventory.NodeInfo(host, 0, 1, redis_url), key)
    client.close()


def routed(host: str, first: int = 0, end: int = 1, model: str = "toy") -> wire.RouteEntry:
    """A route's entry for `host`. A worker without an inventory record (most of these tests)
    is routed by host alone; one with a record checks the layers and model too."""
    return wire.RouteEntry(host, first, end, model)


def round_message(
    redis_url, hosts, hop=0, tokens=(1, 2, 3), n_draft=0, tensor=None, rid="r", start_pos=0
):
    route = tuple(routed(h) if isinstance(h, str) else h for h in hosts)
    return wire.Message(
        kind="round",
        session="s",
        round_id=rid,
        tokens=tokens,
        n_draft=n_draft,
        tensor=tensor,
        route=route,
        hop=hop,
        start_pos=start_pos,
    )


def test_tail_with_a_draft_outside_the_vocabulary_replies_error(make, swarm, key, redis_url):
    tail = make("t", 2, 4)
    deliver(tail, wire.Message(kind="reset", session="s", params=RESET))
    msg = round_message(
        redis_url,
        ["a", "t"],
        hop=1,
        tokens=(1, 999),
        n_draft=1,
        tensor=torch.zeros(2, ToyConfig.dim),
    )
    deliver(tail, msg)
    (reply,) = replies(redis_url, swarm, key)
    assert reply.kind == "error" and "draft ids" in reply.reason and reply.round_id == "r"
    assert tail.counters["errors"] == 1


def test_tail_answers_the_result_vector(make, swarm, key, redis_url):
    tail = make("t", 0, 4)
    deliver(tail, wire.Message(kind="reset", session="s", params=RESET))
    deliver(tail, round_message(redis_url, ["t"], tokens=(1, 2, 3, 4), n_draft=2))
    (reply,) = replies(redis_url, swarm, key)
    assert reply.kind == "result" and len(reply.tokens) == 3
    assert all(t == -1 or 0 <= t < ToyConfig.vocab for t in reply.tokens)


def test_misrouted_and_misplaced_messages_are_dropped(make, swarm, key, redis_url):
    worker = make("a", 0, 2)
    deliver(worker, round_message(redis_url, ["b", "a"]))  # not for a
    deliver(worker, wire.Message(kind="result", session="s"))
    deliver(worker, wire.Message(kind="reset", session="s", params={"temp": 1}))
    deliver(worker, round_message(redis_url, ["a"], tokens=()))
    handle(worker, None)
    assert worker.counters["dropped"] == 5
    assert worker.counters["processed"] == 0
    client = redis.Redis.from_url(redis_url)
    assert client.hget(streams.stats_key(swarm, "a"), "dropped") == b"5"
    client.close()


def test_a_round_routed_for_other_layers_or_another_model_is_refused_and_counted(
    swarm, key, redis_url
):
    # The stage's record says it serves layers 0:4 of toy; a coordinator routing by an older
    # record (before a re-split, or another model under the same host) names something else.
    config = WorkerConfig(host="t", swarm=swarm, keys=key, redis_url=redis_url)
    stage = ToyStage(ToyConfig(), 0, 4)
    tail = StageWorker(stage, config, inventory.NodeInfo("t", 0, 4, redis_url, model="toy"))
    deliver(tail, wire.Message(kind="reset", session="s", params=RESET))
    deliver(tail, round_message(redis_url, [routed("t", 0, 2)], rid="layers"))
    deliver(tail, round_message(redis_url, [routed("t", 0, 4, "other")], rid="model"))
    assert stage.held_tokens() in ({}, {"s": 0})  # nothing ran
    deliver(tail, round_message(redis_url, [routed("t", 0, 4)], rid="right"))
    refused, other, result = replies(redis_url, swarm, key)
    assert (refused.kind, refused.round_id, refused.sender) == ("misrouted", "layers", "t")
    assert refused.reason == "t serves layers 0:4 of toy, not layers 0:2 of toy"
    assert (other.kind, other.round_id) == ("misrouted", "model")
    assert "not layers 0:4 of other" in other.reason
    assert (result.kind, result.round_id, len(result.tokens)) == ("result", "right", 1)
    assert (tail.counters["misrouted"], tail.counters["processed"]) == (2, 1)
    assert tail.counters["dropped"] == tail.counters["errors"] == 0
    client = redis.Redis.from_url(redis_url)
    assert streams.read_stats(client, swarm, "t")["misrouted"] == 2  # published with the rest
    client.close()


def test_a_misrouted_round_in_a_batch_leaves_the_others_to_run(swarm, key, redis_url, tmp_path):
    worker = tiny_worker(tmp_path, "t", swarm, key, redis_url)
    n_layers = worker.stage.cfg.n_layers
    worker.forward.serves = routing.Serves("tiny", 0, n_layers)
    rounds = []
    for session, end in (("s", n_layers), ("u", n_layers - 1)):
        handle(worker, signed(worker, wire.Message(kind="reset", session=session, params=RESET)))
        message = replace(
            round_message(redis_url, [routed("t", 0, end, "tiny")], rid=session), session=session
        )
        rounds.append(signed(worker, message))
    handle(worker, *rounds)
    (result,) = replies(redis_url, swarm, key, "s")
    (refused,) = replies(redis_url, swarm, key, "u")
    assert (result.kind, refused.kind) == ("result", "misrouted")
    assert (worker.counters["processed"], worker.counters["misrouted"]) == (1, 1)
    assert worker.counters["forwards"] == 1


def test_a_tails_result_says_how_many_rounds_its_forward_ran(swarm, key, redis_url, tmp_path):
    worker = tiny_worker(tmp_path, "t", swarm, key, redis_url)
    worker.batcher.arrivals = gathering.Arrivals(groups=1)  # every session in one group
    n_layers = worker.stage.cfg.n_layers
    rounds = []
    for session in ("a", "b", "c"):
        handle(worker, signed(worker, wire.Message(kind="reset", session=session, params=RESET)))
        message = round_message(redis_url, [routed("t", 0, n_layers, "tiny")], rid=session)
        rounds.append(signed(worker, replace(message, session=session)))
    handle(worker, *rounds[:2])  # two sessions in one forward
    handle(worker, rounds[2])  # one alone
    assert [r.batch for s in ("a", "b") for r in replies(redis_url, swarm, key, s)] == [2, 2]
    (alone,) = replies(redis_url, swarm, key, "c")
    assert alone.kind == "result" and alone.batch == 1


def test_a_route_that_ends_before_the_tail_is_an_error_reply(make, swarm, key, redis_url):
    worker = make("a", 0, 2)
    deliver(worker, round_message(redis_url, ["a"]))
    (reply,) = replies(redis_url, swarm, key)
    assert reply.kind == "error" and "not a tail" in reply.reason


def test_a_next_hop_missing_from_the_inventory_is_an_unreachable_reply(make, swarm, key, redis_url):
    # The round names its hops by host only: the address is the inventory's to give.
    worker = make("a", 0, 2)
    deliver(worker, round_message(redis_url, ["a", "b"]))
    (reply,) = replies(redis_url, swarm, key)
    assert reply.kind == "unreachable" and "cannot pass the round to b: not in the inventory" in (
        reply.reason
    )
    assert worker.counters["errors"] == 1
    listed(redis_url, swarm, key, "b")
    deliver(worker, round_message(redis_url, ["a", "b"], rid="r2"))
    client = redis.Redis.from_url(redis_url)
    assert client.xlen(streams.stage_key(swarm, "b")) == 1
    client.close()


def test_middle_stage_without_hidden_states_drops_the_round(make, swarm, key, redis_url):
    worker = make("m", 1, 3)
    deliver(worker, round_message(redis_url, ["a", "m", "t"], hop=1))
    assert worker.counters["dropped"] == 1 and replies(redis_url, swarm, key) == []


class Clock:
    """The sessions' activity's `time`, with a monotonic clock the test moves by hand."""

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
    monkeypatch.setattr(activity, "time", clock)
    config = WorkerConfig(host="t", swarm=swarm, keys=key, redis_url=redis_url, session_idle_s=0.3)
    stage = ToyStage(ToyConfig(), 0, 4)
    tail = StageWorker(stage, config)

    def send(session: str, message: wire.Message) -> None:
        deliver(tail, replace(message, session=session))

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


def test_what_ended_sessions_freed_goes_back_to_the_system_at_most_every_few_seconds(
    make, redis_url, monkeypatch
):
    from specpipe.swarm.stage import worker as stage_worker
    from specpipe.transformer import heap

    clock = Clock()
    monkeypatch.setattr(stage_worker, "time", clock)
    trims = []
    monkeypatch.setattr(heap, "trim", lambda: trims.append(clock.now))
    tail = make("t", 0, 4)
    tail.housekeeping()
    assert trims == []  # nothing was freed yet
    for session in ("a", "b"):
        deliver(tail, wire.Message(kind="reset", session=session, params=RESET))
        deliver(tail, round_message(redis_url, ["t"], tokens=(1, 2), rid=f"{session}-1"))
    deliver(tail, wire.Message(kind="drop", session="a"))
    clock.now += stage_worker.HOUSEKEEPING_S
    tail.housekeeping()
    assert trims == [clock.now]
    deliver(tail, wire.Message(kind="drop", session="b"))
    clock.now += stage_worker.HOUSEKEEPING_S
    tail.housekeeping()  # freed again, but trimmed too recently
    assert len(trims) == 1
    clock.now += stage_worker.HEAP_TRIM_S
    tail.housekeeping()
    clock.now += stage_worker.HEAP_TRIM_S
    tail.housekeeping()  # nothing freed since
    first = 1000.0 + stage_worker.HOUSEKEEPING_S
    assert trims == [first, clock.now - stage_worker.HEAP_TRIM_S]


def test_processed_rounds_leave_counters_and_timings_in_the_stats(make, swarm, key, redis_url):
    tail = make("t", 0, 4)
    deliver(tail, wire.Message(kind="reset", session="s", params=RESET))
    deliver(tail, round_message(redis_url, ["t"], tokens=(1, 2, 3)))
    deliver(tail, round_message(redis_url, ["x"], rid="r2"))  # dropped
    tail.flush_counters()
    client = redis.Redis.from_url(redis_url)
    stats = streams.read_stats(client, swarm, "t")
    client.close()
    assert stats["processed"] == 1 and stats["dropped"] == 1
    assert stats["forward_ms"] > 0 and stats["hop_ms"] > 0


def test_a_replayed_message_is_dropped_and_the_session_goes_on(make, redis_url, swarm, key):
    tail = make("t", 0, 4)
    reset = signed(tail, wire.Message(kind="reset", session="s", params=RESET))
    first = signed(tail, round_message(redis_url, ["t"], tokens=(1, 2, 3), rid="r1"))
    handle(tail, reset)
    handle(tail, first)
    # An attacker replays the reset and the first round: both are refused, nothing is redone.
    handle(tail, reset)
    handle(tail, first)
    deliver(tail, round_message(redis_url, ["t"], tokens=(4,), rid="r2", start_pos=3))
    assert tail.counters["replayed"] == 2 and tail.counters["processed"] == 2
    assert [r.kind for r in replies(redis_url, swarm, key)] == ["result", "result"]
    assert tail.stage.cache_len("s") == 4  # the replayed reset did not clear the cache


def test_a_replay_after_a_drop_is_still_a_replay(make, redis_url):
    tail = make("t", 0, 4)
    reset = signed(tail, wire.Message(kind="reset", session="s", params=RESET))
    first = signed(tail, round_message(redis_url, ["t"], tokens=(1, 2, 3)))
    for data in (reset, first):
        handle(tail, data)
    deliver(tail, wire.Message(kind="drop", session="s"))
    for data in (reset, first):
        handle(tail, data)
    assert tail.counters["replayed"] == 2 and tail.counters["processed"] == 1
    assert "s" not in tail.stage.caches


def test_stale_redirected_and_impersonated_messages_are_dropped(make, redis_url, swarm, key):
    middle = make("m", 1, 3)
    hidden = torch.zeros(3, ToyConfig.dim)
    passed_on = round_message(redis_url, ["a", "m", "t"], hop=1, tensor=hidden)
    stale = wire.next_seq(0, now=time.time() - 2 * wire.CLOCK_SLACK_S)
    deliver(middle, passed_on, seq=stale)
    deliver(middle, passed_on, to=streams.stage_key(swarm, "t"))  # meant for another stage
    deliver(middle, passed_on, sender=wire.COORDINATOR)  # a hop-1 round comes from stage a
    deliver(middle, wire.Message(kind="reset", session="s", params=RESET), sender="a")
    assert middle.counters["replayed"] == 1 and middle.counters["dropped"] == 3
    assert middle.counters["processed"] == 0


def test_a_long_round_is_served_for_as_long_as_its_sender_waits(make, redis_url, swarm, key):
    """A long prefill or replay, or a round queued behind other sessions', may be read minutes
    after it was sent: it is served while the coordinator still waits for it (its `wait_ms`),
    and refused as stale once that is over."""
    middle = make("m", 1, 3)
    hidden = torch.zeros(3, ToyConfig.dim)
    sent_s = time.time() - 400  # stamped 400 s ago: past any fixed 300 s limit
    reset = wire.Message(kind="reset", session="s", params=RESET)
    deliver(middle, reset, seq=wire.next_seq(0, now=sent_s - 1), wait_ms=600_000)
    passed_on = round_message(redis_url, ["a", "m", "t"], hop=1, tensor=hidden)
    listed(redis_url, swarm, key, "t")
    deliver(middle, passed_on, seq=wire.next_seq(0, now=sent_s), wait_ms=600_000)
    assert middle.counters["replayed"] == 0
    served = middle.counters["processed"]
    assert served >= 1
    late = wire.next_seq(0, now=sent_s + 1)  # a later try, whose sender stopped waiting
    deliver(middle, passed_on, seq=late, wait_ms=int((400 - 1 - wire.CLOCK_SLACK_S - 5) * 1000))
    assert middle.counters["replayed"] == 1 and middle.counters["processed"] == served


@pytest.mark.parametrize(
    "params",
    [
        {"temp": 0.5, "top_p": 1.0, "top_k": 0, "seed": float("inf")},
        {"temp": 0.5, "top_p": 1.0, "top_k": float("nan"), "seed": 1},
        {"temp": float("nan"), "top_p": 1.0, "top_k": 0, "seed": 1},
    ],
)
def test_a_signed_reset_with_impossible_numbers_is_dropped(make, params):
    tail = make("t", 0, 4)
    deliver(tail, wire.Message(kind="reset", session="s", params=params))
    assert tail.counters["dropped"] == 1 and "s" not in tail.samplers


def test_whatever_handling_raises_is_counted_and_serving_goes_on(make, redis_url, monkeypatch):
    tail = make("t", 0, 4)
    monkeypatch.setattr(tail.forward, "round", lambda message: 1 / 0)
    handle(tail, signed(tail, round_message(redis_url, ["t"])))
    assert tail.counters["errors"] == 1


def test_counters_survive_another_writer_replacing_their_hash(make, swarm, redis_url):
    worker = make("a", 0, 2)
    client = redis.Redis.from_url(redis_url)
    client.set(streams.stats_key(swarm, "a"), "not a hash")
    handle(worker, None)  # counted as a drop: the write meets WRONGTYPE
    worker.flush_counters()
    assert streams.read_stats(client, swarm, "a")["dropped"] == 1
    client.close()


def test_a_rotated_key_is_picked_up_when_a_message_names_it(swarm, redis_url):
    old, new = b"o" * 32, b"n" * 32
    keys = {"ring": wire.Keyring([old])}
    config = WorkerConfig(
        host="t", swarm=swarm, keys=old, redis_url=redis_url, reload_keys=lambda: keys["ring"]
    )
    tail = StageWorker(ToyStage(ToyConfig(), 0, 4), config)
    keys["ring"] = wire.Keyring([new, old])  # `specpipe key rotate` on this host
    message = wire.Message(
        kind="reset",
        session="s",
        params=RESET,
        to=tail.stream,
        sender=wire.COORDINATOR,
        seq=wire.next_seq(0),
    )
    handle(tail, wire.encode(message, swarm, new))
    assert "s" in tail.samplers and tail.keys.current == new
    stranger = replace(message, seq=wire.next_seq(message.seq), session="x")
    handle(tail, wire.encode(stranger, swarm, b"z" * 32))  # no reload makes this one known
    assert "x" not in tail.samplers and tail.counters["dropped"] == 1


def test_rounds_of_several_sessions_in_one_read_run_as_one_forward(swarm, key, redis_url, tmp_path):
    """A tail that finds three sessions' rounds waiting answers each as it does alone."""
    from specpipe.transformer.layer_range import load_stage
    from specpipe.transformer.resolve import open_checkpoint
    from tests.swarmprocs import write_tiny_model

    source = open_checkpoint(str(write_tiny_model(tmp_path / "tiny")))
    n_layers = source.config.n_layers

    def tail(host: str) -> StageWorker:
        config = WorkerConfig(host=host, swarm=swarm, keys=key, redis_url=redis_url)
        return StageWorker(load_stage(source, 0, n_layers), config)

    together, alone = tail("t"), tail("u")
    together.batcher.arrivals = gathering.Arrivals(groups=1)  # all three in one group
    sessions = {"s1": (1, 2, 3, 4, 5), "s2": (7, 8), "s3": (9, 10, 11, 12)}
    for worker in (together, alone):
        for session in sessions:
            deliver(worker, wire.Message(kind="reset", session=session, params=RESET))

    def prefill(worker, session, tokens):
        message = round_message(redis_url, [worker.config.host], tokens=tokens, n_draft=1)
        return signed(worker, replace(message, session=session))

    handle(together, *[prefill(together, s, t) for s, t in sessions.items()])
    for session, tokens in sessions.items():
        handle(alone, prefill(alone, session, tokens))
    for session in sessions:
        got = [r.tokens for r in replies(redis_url, swarm, key, session)]
        assert len(got) == 2 and got[0] == got[1], session  # together's reply, then alone's
    assert together.timings["batch_size"] == 3 and alone.timings["batch_size"] == 1
    assert (together.counters["processed"], together.counters["forwards"]) == (3, 1)
    assert (alone.counters["processed"], alone.counters["forwards"]) == (3, 3)


def test_a_session_dropped_in_the_middle_of_a_batch_leaves_the_others_exact(
    swarm, key, redis_url, tmp_path
):
    """A job cancelled while others' rounds share its read: its drop splits the batch, the
    others' answers are the ones they get alone, and its cache is gone (a later round: gap)."""
    from specpipe.transformer.layer_range import load_stage
    from specpipe.transformer.resolve import open_checkpoint
    from tests.swarmprocs import write_tiny_model

    source = open_checkpoint(str(write_tiny_model(tmp_path / "tiny")))

    def tail(host: str) -> StageWorker:
        config = WorkerConfig(host=host, swarm=swarm, keys=key, redis_url=redis_url)
        return StageWorker(load_stage(source, 0, source.config.n_layers), config)

    together, alone = tail("t"), tail("u")
    together.batcher.arrivals = gathering.Arrivals(groups=1)
    prompts = {"s1": (1, 2, 3, 4, 5), "s2": (7, 8), "s3": (9, 10, 11, 12)}
    steps = {"s1": (6, 7, 8), "s2": (9,), "s3": (13, 14)}  # each with its drafts after the first

    def round_of(worker, session, tokens, start_pos, n_draft):
        message = round_message(
            redis_url, [worker.config.host], tokens=tokens, n_draft=n_draft, start_pos=start_pos
        )
        return signed(worker, replace(message, session=session))

    def drop(worker, session):
        return signed(worker, wire.Message(kind="drop", session=session))

    for worker in (together, alone):
        for session in prompts:
            deliver(worker, wire.Message(kind="reset", session=session, params=RESET))
    handle(together, *[round_of(together, s, p, 0, 0) for s, p in prompts.items()])
    handle(
        together,
        round_of(together, "s1", steps["s1"], 5, 2),
        round_of(together, "s2", steps["s2"], 2, 0),
        drop(together, "s2"),  # its job was cancelled
        round_of(together, "s3", steps["s3"], 4, 1),
    )
    for session in ("s1", "s3"):
        handle(alone, round_of(alone, session, prompts[session], 0, 0))
        handle(
            alone,
            round_of(
                alone, session, steps[session], len(prompts[session]), len(steps[session]) - 1
            ),
        )
        got = [r.tokens for r in replies(redis_url, swarm, key, session)]
        assert len(got) == 4 and got[:2] == got[2:], session  # together's two, then alone's
    assert "s2" not in together.stage.sessions
    handle(together, round_of(together, "s2", (3,), 3, 0))
    assert [r.kind for r in replies(redis_url, swarm, key, "s2")] == ["result", "result", "gap"]


def test_over_its_kv_budget_a_stage_forgets_the_sessions_idle_longest(
    swarm, key, redis_url, tmp_path, monkeypatch
):
    from specpipe.transformer.layer_range import load_stage
    from specpipe.transformer.resolve import open_checkpoint
    from tests.swarmprocs import write_tiny_model

    monkeypatch.setenv("SPECPIPE_KV_BUDGET_TOKENS", "12")
    source = open_checkpoint(str(write_tiny_model(tmp_path / "tiny")))
    config = WorkerConfig(host="t", swarm=swarm, keys=key, redis_url=redis_url)
    worker = StageWorker(load_stage(source, 0, source.config.n_layers), config)
    assert worker.kv_budget_tokens == 12
    for session in ("old", "older", "new"):
        deliver(worker, wire.Message(kind="reset", session=session, params=RESET))
        message = round_message(redis_url, ["t"], tokens=(1, 2, 3, 4, 5))
        handle(worker, signed(worker, replace(message, session=session)))
    assert worker.stage.held_tokens() == {"old": 5, "older": 5, "new": 5}
    now = time.monotonic()
    worker.activity.last_used.update(older=now - 100, old=now - 50, new=now - 1)
    assert worker.keep_within_budget(now) == ["older"]  # 10 tokens left: within the budget
    assert set(worker.stage.held_tokens()) == {"old", "new"}
    worker.activity.last_used.update(old=now - 1)
    deliver(worker, wire.Message(kind="reset", session="more", params=RESET))
    message = round_message(redis_url, ["t"], tokens=(1, 2, 3, 4, 5))
    handle(worker, signed(worker, replace(message, session="more")))
    # 15 tokens, but every session was busy a moment ago: none is forgotten.
    assert worker.keep_within_budget(now) == []


def tiny_worker(tmp_path, host, swarm, key, redis_url, start=0, end=None) -> StageWorker:
    from specpipe.transformer.layer_range import load_stage
    from specpipe.transformer.resolve import open_checkpoint
    from tests.swarmprocs import write_tiny_model

    source = open_checkpoint(str(write_tiny_model(tmp_path / "tiny")))
    config = WorkerConfig(host=host, swarm=swarm, keys=key, redis_url=redis_url)
    return StageWorker(load_stage(source, start, end or source.config.n_layers), config)


def test_a_batch_passes_its_rounds_on_in_one_write(swarm, key, redis_url, tmp_path, monkeypatch):
    """The next stage is woken once, for the whole batch: it finds every round of it waiting
    and runs them as one forward, so sessions that met stay together around the ring."""
    first = tiny_worker(tmp_path, "a", swarm, key, redis_url, 0, 1)
    tail = tiny_worker(tmp_path, "b", swarm, key, redis_url, 1)
    first.batcher.arrivals = gathering.Arrivals(groups=1)
    tail.batcher.arrivals = gathering.Arrivals(groups=1)
    listed(redis_url, swarm, key, "b")
    sessions = {"s1": (1, 2, 3), "s2": (4, 5), "s3": (6, 7, 8, 9)}
    for session in sessions:
        deliver(tail, wire.Message(kind="reset", session=session, params=RESET))
    writes = []
    call = streams.Link.call
    monkeypatch.setattr(
        streams.Link,
        "call",
        lambda self, *commands, **kw: writes.append(commands) or call(self, *commands, **kw),
    )
    handle(
        first,
        *[
            signed(first, replace(round_message(redis_url, ["a", "b"], tokens=t), session=s))
            for s, t in sessions.items()
        ],
    )
    assert len(writes) == 1  # the three rounds and one bell, in that order
    assert [c[0] for c in writes[0]] == ["XADD", "XADD", "XADD", "LPUSH", "LTRIM"]
    monkeypatch.undo()
    tail.serve_once()
    assert (tail.counters["processed"], tail.counters["forwards"]) == (3, 1)
    for session in sessions:
        assert [r.kind for r in replies(redis_url, swarm, key, session)] == ["result"]


def test_a_stage_waits_for_a_round_due_now_and_runs_both_in_one_forward(
    swarm, key, redis_url, tmp_path
):
    tail = tiny_worker(tmp_path, "t", swarm, key, redis_url)
    for session in ("s1", "s2"):
        deliver(tail, wire.Message(kind="reset", session=session, params=RESET))
    route = ["t"]

    def round_of(session, tokens, start_pos):
        message = round_message(redis_url, route, tokens=tokens, start_pos=start_pos)
        return signed(tail, replace(message, session=session))

    handle(tail, round_of("s1", (1, 2, 3), 0), round_of("s2", (4, 5), 0))
    now = time.monotonic()
    tail.batcher.arrivals = gathering.Arrivals()
    # Four sessions came round every 0.1 s: the next ones are due now, in two groups of two.
    for session in ("s1", "s2", "s3", "s4"):
        tail.batcher.arrivals.note(session, now - 0.2)
        tail.batcher.arrivals.note(session, now - 0.1)
    client = redis.Redis.from_url(redis_url)
    streams.send(client, tail.stream, round_of("s1", (7,), 3))
    late = threading.Timer(0.01, streams.send, (client, tail.stream, round_of("s2", (8,), 2)))
    before = dict(tail.counters)
    late.start()
    tail.serve_once()  # s1 and s2 run together; s3 and s4, due too, are the other group's
    late.join()
    assert tail.counters["processed"] - before["processed"] == 2
    assert tail.counters["forwards"] - before["forwards"] == 1
    for session in ("s1", "s2"):
        assert [r.kind for r in replies(redis_url, swarm, key, session)] == ["result"] * 2
    client.close()


def test_a_session_alone_on_the_ring_is_not_held_back(swarm, key, redis_url, tmp_path, monkeypatch):
    tail = tiny_worker(tmp_path, "t", swarm, key, redis_url)
    deliver(tail, wire.Message(kind="reset", session="s1", params=RESET))
    message = round_message(redis_url, ["t"], tokens=(1, 2, 3))
    deliver(tail, replace(message, session="s1"))
    now = time.monotonic()
    tail.batcher.arrivals = gathering.Arrivals()
    tail.batcher.arrivals.note("s1", now - 0.2)
    tail.batcher.arrivals.note("s1", now - 0.1)
    client = redis.Redis.from_url(redis_url)
    streams.send(
        client, tail.stream, signed(tail, replace(message, session="s1", tokens=(4,), start_pos=3))
    )
    reads = []
    read = tail.consumer.read
    monkeypatch.setattr(tail.consumer, "read", lambda *a, **kw: reads.append(kw) or read(*a, **kw))
    tail.serve_once()
    assert len(reads) == 1 and tail.counters["processed"] == 2  # no second read: no wait
    client.close()


def test_a_read_of_more_than_a_group_runs_as_two_forwards(swarm, key, redis_url, tmp_path):
    """Four sessions that arrive together leave as two groups of two (`gathering.GROUPS`)."""
    tail = tiny_worker(tmp_path, "t", swarm, key, redis_url)
    sessions = {"s1": (1, 2, 3), "s2": (4, 5), "s3": (6,), "s4": (7, 8, 9)}
    for session in sessions:
        deliver(tail, wire.Message(kind="reset", session=session, params=RESET))
    handle(
        tail,
        *[
            signed(tail, replace(round_message(redis_url, ["t"], tokens=t), session=s))
            for s, t in sessions.items()
        ],
    )
    assert (tail.counters["processed"], tail.counters["forwards"]) == (4, 2)


def test_a_stage_sends_through_the_link_its_config_wraps_its_sender_in(make, swarm, key, redis_url):
    assert type(make("a", 0, 2).outbox.link) is Sender  # nothing wrapped: written at once
    config = WorkerConfig(
        host="a",
        swarm=swarm,
        keys=key,
        redis_url=redis_url,
        wrap_sender=lambda sender: DelayedLink(sender, 0.2),
    )
    slow = StageWorker(ToyStage(ToyConfig(), 0, 2), config)
    assert isinstance(slow.outbox.link, DelayedLink)
    listed(redis_url, swarm, key, "b")
    client = redis.Redis.from_url(redis_url)
    onward = streams.stage_key(swarm, "b")
    started = time.monotonic()
    deliver(slow, round_message(redis_url, ["a", "b"]))
    assert client.xlen(onward) == 0  # on its way: the stage is not held up
    wait_until(lambda: client.xlen(onward) == 1, 5, "the delayed round")
    assert time.monotonic() - started >= 0.2
    client.close()


def test_the_record_and_counters_are_written_by_the_heartbeat_thread_alone(
    swarm, key, redis_url, monkeypatch
):
    """A long forward holds up the serving loop, never a beat: the loop publishes nothing."""
    publishers = []
    publish = inventory.publish

    def recorded(*args, **kwargs):
        publishers.append(threading.current_thread())
        return publish(*args, **kwargs)

    listed(redis_url, swarm, key, "b")  # before the count of who publishes starts
    monkeypatch.setattr(inventory, "publish", recorded)
    config = WorkerConfig(
        host="a", swarm=swarm, keys=key, redis_url=redis_url, block_ms=50, heartbeat_s=0.1
    )
    node = inventory.NodeInfo("a", 0, 2, redis_url)
    worker = StageWorker(ToyStage(ToyConfig(), 0, 2), config, node)
    stop = threading.Event()
    serving = threading.Thread(target=worker.serve, args=(stop,))
    serving.start()
    client = redis.Redis.from_url(redis_url)
    try:
        wait_until(lambda: len(publishers) >= 3, 10, "three heartbeats")
        route = [routed("a", 0, 2, ""), routed("b", 2, 4, "")]  # what the record says
        streams.send(client, worker.stream, signed(worker, round_message(redis_url, route)))
        wait_until(lambda: client.xlen(streams.stage_key(swarm, "b")) == 1, 10, "the pass-on")
        beats = len(publishers)  # the processed count is written at a beat only
        wait_until(lambda: len(publishers) >= beats + 2, 10, "two more heartbeats")
        assert streams.read_stats(client, swarm, "a")["processed"] == 1
        record = {n.host: n for n in inventory.load(client, swarm, key)}["a"]
        assert record.heartbeat_s == 0.1
    finally:
        stop.set()
        serving.join()
        client.close()
    assert len(set(publishers)) == 1 and serving not in publishers


def test_a_next_hop_that_never_answers_does_not_hold_up_the_record(
    swarm, key, redis_url, monkeypatch
):
    """A host cut off mid-round answers no PING until the socket times out (seconds): the
    stage's own record must keep coming meanwhile, or it lapses and leaves its routes."""
    silent = socket.socket()  # accepts connections (the backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    published = []
    publish = inventory.publish

    def recorded(*args, **kwargs):
        published.append(time.monotonic())
        return publish(*args, **kwargs)

    monkeypatch.setattr(inventory, "publish", recorded)
    config = WorkerConfig(host="a", swarm=swarm, keys=key, redis_url=redis_url, heartbeat_s=0.1)
    worker = StageWorker(
        ToyStage(ToyConfig(), 0, 2), config, inventory.NodeInfo("a", 0, 2, redis_url)
    )
    dead = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
    worker.heartbeat.next_hop = lambda: ("b", dead)
    try:
        with worker.heartbeat.beating():
            time.sleep(2.0)
    finally:
        silent.close()
    gaps = [b - a for a, b in zip(published, published[1:], strict=False)]
    assert len(published) >= 10 and max(gaps) < 1.0, (len(published), max(gaps, default=None))
