"""The swarm end to end: RedisRing through real stage worker processes on real Redis."""

from __future__ import annotations

import itertools
import signal
import threading
import time

import pytest
import redis
import torch

from specpipe.core.ring import GapError, Round
from specpipe.core.sampling import SamplingParams, committed_tokens
from specpipe.decoding.generation import Generation
from specpipe.decoding.local_ring import LocalRing
from specpipe.ops.link_delay import DelayedRing
from specpipe.swarm import inventory, streams, wire
from specpipe.swarm.inventory import NodeInfo, RouteError
from specpipe.swarm.redis_ring import HopUnreachableError, RedisRing, RingError, StaleRouteError
from tests.swarm.toy_stage import ToyConfig, ToyStage
from tests.waiting import wait_until

PARAMS = SamplingParams(temp=0.9, top_p=0.95, top_k=30, seed=11)
PROMPT = [3, 17, 42, 8, 8, 21]


def ReferenceRing(bounds: list[tuple[int, int]]) -> LocalRing:
    """The same toy model in this process: what every swarm must reproduce exactly."""
    return LocalRing([ToyStage(ToyConfig(), a, b) for a, b in bounds])


def drafts_for(committed: list[int], k: int) -> list[int]:
    """A cheap deterministic drafter: repeats the last tokens (accepted now and then)."""
    return [committed[-1 - (i % 2)] for i in range(k)]


def drive(ring, session, rounds: int, k: int, committed=None, log=None):
    """Prefill, then `rounds` verify rounds; returns the committed ids and every result vector."""
    log = [] if log is None else log
    if committed is None:
        committed = list(PROMPT)
        result = ring.round(Round(session, committed, 0))
        log.append(result)
        committed += committed_tokens([], result)
    for _ in range(rounds):
        drafts = drafts_for(committed, k)
        start = len(committed) - 1
        result = ring.round(Round(session, [committed[-1], *drafts], start, len(drafts)))
        log.append(result)
        committed += committed_tokens(drafts, result)
    return committed, log


def reference(bounds, rounds, k, params=PARAMS):
    ring = ReferenceRing(bounds)
    ring.reset("ref", params)
    return drive(ring, "ref", rounds, k)


def nodes(*hosts: tuple[str, str, str]) -> list[NodeInfo]:
    """Records of toy stages: (host, Redis, "first:end") each."""
    out = []
    for host, url, layers in hosts:
        first, end = (int(x) for x in layers.split(":"))
        out.append(
            NodeInfo(host=host, layer_start=first, layer_end=end, redis_url=url, model="toy")
        )
    return out


def stats(url, swarm, host) -> dict[str, float]:
    client = redis.Redis.from_url(url)
    try:
        return streams.read_stats(client, swarm, host)
    finally:
        client.close()


def caught_up(client: redis.Redis, swarm: str, host: str) -> bool:
    """Whether `host` has read and acknowledged every entry of its stream. It acknowledges an
    entry once it has handled it, so whatever the entries make it do (pass a round on, reply) is
    done."""
    key = streams.stage_key(swarm, host)
    last = client.xinfo_stream(key)["last-generated-id"]
    (group,) = [g for g in client.xinfo_groups(key) if g["name"] == streams.GROUP.encode()]
    return group["pending"] == 0 and group["last-delivered-id"] == last


def last_heartbeat(url: str, swarm: str, key: bytes, host: str) -> float:
    client = redis.Redis.from_url(url)
    try:
        return next(n.last_heartbeat for n in inventory.load(client, swarm, key) if n.host == host)
    finally:
        client.close()


def two_heartbeats_later(url: str, swarm: str, key: bytes, host: str) -> None:
    """Wait until `host` has published two heartbeats after this call. A heartbeat writes the
    inventory record, then the counters; the first one seen starts after this call, and the
    second starts once the first has finished. So the counters it held now are in Redis, and
    its loop has gone round (read its stream) at least once since."""
    seen = [last_heartbeat(url, swarm, key, host)]

    def twice() -> bool:
        latest = last_heartbeat(url, swarm, key, host)
        if latest > seen[-1]:
            seen.append(latest)
        return len(seen) > 2

    wait_until(twice, 10, f"two heartbeats from {host}")


def test_round_trip_through_three_stage_processes(stages, swarm, key, redis_url):
    for host, layers in [("h0", "0:1"), ("h1", "1:3"), ("h2", "3:4")]:
        stages.start(host, layers, redis_url, wait=False)
    stages.wait_ready(["h0", "h1", "h2"])
    ring = RedisRing(
        nodes(("h0", redis_url, "0:1"), ("h1", redis_url, "1:3"), ("h2", redis_url, "3:4")),
        swarm,
        key,
        redis_url,
        timeout_s=20,
    )
    ring.reset("s", PARAMS)
    got = drive(ring, "s", rounds=6, k=3)
    assert got == reference([(0, 1), (1, 3), (3, 4)], rounds=6, k=3)
    assert len(got[0]) > len(PROMPT) + 6  # every round committed at least one token

    # A second session with greedy parameters runs on the same stages, unaffected by the first.
    greedy = SamplingParams(temp=0.0, seed=0)
    ring.reset("g", greedy)
    assert drive(ring, "g", rounds=3, k=2) == reference([(0, 1), (1, 3), (3, 4)], 3, 2, greedy)
    ring.drop("s")
    ring.drop("g")
    ring.close()
    wait_until(
        lambda: stats(redis_url, swarm, "h2").get("processed") == 1 + 6 + 1 + 3,
        10,
        "h2's count of processed rounds to reach 11",
    )


def test_per_host_redis_each_stream_lives_on_its_hosts_server(
    stages, swarm, ring_settings, redis_url, second_redis
):
    stages.start("a", "0:2", redis_url, wait=False)
    stages.start("b", "2:4", second_redis, wait=False)
    stages.wait_ready(["a", "b"])
    # The route comes from the inventory the stages registered in (on the main Redis).
    ring = RedisRing.from_inventory(ring_settings, "toy", 4)
    assert [(h.host, h.redis_url) for h in ring.route] == [("a", redis_url), ("b", second_redis)]
    ring.reset("s", PARAMS)
    assert drive(ring, "s", rounds=4, k=2) == reference([(0, 2), (2, 4)], rounds=4, k=2)
    ring.close()
    main, other = redis.Redis.from_url(redis_url), redis.Redis.from_url(second_redis)
    assert other.exists(streams.stage_key(swarm, "b")) and not other.exists(
        streams.stage_key(swarm, "a")
    )
    assert main.exists(streams.stage_key(swarm, "a")) and not main.exists(
        streams.stage_key(swarm, "b")
    )
    # b read 1 reset + 5 rounds from its own server, and deleted each once handled
    wait_until(lambda: stats(second_redis, swarm, "b").get("processed") == 5, 10, "b's counters")
    assert caught_up(other, swarm, "b") and other.xlen(streams.stage_key(swarm, "b")) == 0
    other.delete(streams.stage_key(swarm, "b"), streams.stats_key(swarm, "b"))
    main.close()
    other.close()


def test_a_route_from_a_stale_record_is_refused_with_a_stale_route_error(
    stages, swarm, key, redis_url
):
    stages.start("h0", "0:2", redis_url, wait=False)
    stages.start("h1", "2:4", redis_url, wait=False)
    stages.wait_ready(["h0", "h1"])
    # Records from before a re-split: h0 held 0:1 and h1 1:4, or h1 held another model.
    for stale, host, why in (
        (nodes(("h0", redis_url, "0:1"), ("h1", redis_url, "1:4")), "h0", "layers 0:1 of toy"),
        (
            [*nodes(("h0", redis_url, "0:2")), NodeInfo("h1", 2, 4, redis_url, model="old")],
            "h1",
            "layers 2:4 of old",
        ),
    ):
        ring = RedisRing(stale, swarm, key, redis_url, timeout_s=20)
        ring.reset("s", PARAMS)
        with pytest.raises(StaleRouteError, match=f"{host} serves .* of toy, not {why}") as caught:
            ring.round(Round("s", PROMPT, 0))
        assert caught.value.host == host and isinstance(caught.value, RingError)
        ring.close()
    assert stats(redis_url, swarm, "h0").get("misrouted") == 1
    assert stats(redis_url, swarm, "h1").get("misrouted") == 1
    # Both kept serving: a route from their records now gives the plain output.
    ring = RedisRing(
        nodes(("h0", redis_url, "0:2"), ("h1", redis_url, "2:4")), swarm, key, redis_url
    )
    ring.reset("s", PARAMS)
    assert drive(ring, "s", rounds=3, k=2) == reference([(0, 2), (2, 4)], rounds=3, k=2)
    ring.close()


def test_bad_messages_are_dropped_and_counted_while_serving_goes_on(stages, swarm, key, redis_url):
    stages.start("h0", "0:2", redis_url, wait=False)
    stages.start("h1", "2:4", redis_url, wait=False)
    stages.wait_ready(["h0", "h1"])
    route = nodes(("h0", redis_url, "0:2"), ("h1", redis_url, "2:4"))
    ring = RedisRing(route, swarm, key, redis_url, timeout_s=20)
    ring.reset("s", PARAMS)
    committed, _ = drive(ring, "s", rounds=1, k=2)

    client = redis.Redis.from_url(redis_url)
    stream = streams.stage_key(swarm, "h1")
    good = wire.Message(
        kind="round",
        session="s",
        round_id="x",
        start_pos=len(committed) - 1,
        tokens=(committed[-1],),
        tensor=torch.zeros(1, ToyConfig.dim),
        route=tuple(wire.RouteEntry.of(n) for n in route),
        hop=1,
        to=stream,
        sender="h0",
        seq=wire.next_seq(0),
    )
    signed = wire.encode(good, swarm, key)
    bad = [
        b"not a message at all",  # malformed
        signed[: -wire.TAG_BYTES] + bytes(wire.TAG_BYTES),  # a zeroed tag
        wire.encode(good, swarm, b"another swarm's key"),  # wrong key
        signed[:40],  # truncated
        wire.encode(  # signed, but the hidden states have the wrong width for this model
            wire.Message(**{**good.__dict__, "tensor": torch.zeros(1, 5), "round_id": "y"}),
            swarm,
            key,
        ),
    ]
    for data in bad:
        streams.send(client, stream, data)
    client.xadd(stream, {b"other": b"field"})  # an entry without a message
    wait_until(lambda: stats(redis_url, swarm, "h1").get("dropped") == 5, 10, "5 drops on h1")
    # The shape error is not a drop (the message was valid) but an error reply for its round.
    wait_until(lambda: stats(redis_url, swarm, "h1").get("errors") == 1, 10, "an error on h1")
    assert stages.procs["h0"].poll() is None and stages.procs["h1"].poll() is None

    # A signed round the model cannot run is an error reply, not a dead stage.
    with pytest.raises(RingError, match="h0: .*index"):
        ring.round(Round("s", [committed[-1], 10_000], len(committed) - 1, 1))

    # The stage kept serving: the session continues exactly as the reference does.
    got = drive(ring, "s", rounds=3, k=2, committed=committed)
    assert got[0] == reference([(0, 2), (2, 4)], rounds=4, k=2)[0]
    client.close()
    ring.close()


def test_a_round_sent_three_times_runs_once(stages, swarm, key, redis_url):
    stages.start("h0", "0:2", redis_url, wait=False)
    stages.start("h1", "2:4", redis_url, wait=False)
    stages.wait_ready(["h0", "h1"])
    route = (wire.Hop("h0", redis_url, 0, 2, "toy"), wire.Hop("h1", redis_url, 2, 4, "toy"))
    ring = RedisRing(route, swarm, key, redis_url)
    ring.reset("s", PARAMS)
    data = wire.encode(
        wire.Message(
            kind="round",
            session="s",
            round_id="same",
            tokens=tuple(PROMPT),
            route=tuple(wire.RouteEntry.of(hop) for hop in route),
            to=streams.stage_key(swarm, "h0"),
            sender=wire.COORDINATOR,
            seq=wire.next_seq(0),
        ),
        swarm,
        key,
    )
    client = redis.Redis.from_url(redis_url)
    for _ in range(3):
        streams.send(client, streams.stage_key(swarm, "h0"), data)
    wait_until(lambda: stats(redis_url, swarm, "h0").get("replayed") == 2, 10, "2 replays")
    # h0 first, then h1: once h1 has handled all that h0 passed on, no other reply can come.
    wait_until(
        lambda: caught_up(client, swarm, "h0") and caught_up(client, swarm, "h1"),
        10,
        "h0 and h1 to handle every entry of their streams",
    )
    replies = [  # every host's reply stream of the session
        entry
        for stream in client.scan_iter(match=streams.reply_key(swarm, "s", "*"))
        for entry in client.xrange(stream)
    ]
    assert len(replies) == 1
    assert client.xlen(streams.reply_key(swarm, "s", "h1")) == 1  # the tail's
    reply = wire.decode(replies[0][1][streams.FIELD], swarm, key)
    expected = ReferenceRing([(0, 2), (2, 4)])
    expected.reset("s", PARAMS)
    assert reply.kind == "result" and list(reply.tokens) == expected.round(Round("s", PROMPT, 0))
    two_heartbeats_later(redis_url, swarm, key, "h1")  # its processed count is in Redis by then
    assert stats(redis_url, swarm, "h1").get("processed") == 1
    client.close()
    ring.close()


def test_killed_stage_answers_gap_and_a_replay_restores_the_same_output(
    stages, swarm, key, redis_url
):
    bounds = [(0, 1), (1, 3), (3, 4)]
    for host, (a, b) in zip(["h0", "h1", "h2"], bounds, strict=True):
        stages.start(host, f"{a}:{b}", redis_url, wait=False)
    stages.wait_ready(["h0", "h1", "h2"])
    ring = RedisRing(
        nodes(("h0", redis_url, "0:1"), ("h1", redis_url, "1:3"), ("h2", redis_url, "3:4")),
        swarm,
        key,
        redis_url,
        timeout_s=30,
    )
    ring.reset("s", PARAMS)
    committed, _ = drive(ring, "s", rounds=3, k=2)

    stages.kill9("h1")
    stages.restart("h1")
    drafts = drafts_for(committed, 2)
    with pytest.raises(GapError, match="h1"):
        ring.round(Round("s", [committed[-1], *drafts], len(committed) - 1, 2))
    # Replay the committed prefix as one round, as the generation loop does, and go on.
    result = ring.round(Round("s", committed, 0))
    committed.append(committed_tokens([], result)[0])
    got, _ = drive(ring, "s", rounds=3, k=2, committed=committed)

    ref = ReferenceRing(bounds)
    ref.reset("r", PARAMS)
    expected, _ = drive(ref, "r", rounds=3, k=2)
    result = ref.round(Round("r", expected, 0))
    expected.append(committed_tokens([], result)[0])
    expected, _ = drive(ref, "r", rounds=3, k=2, committed=expected)
    assert got == expected
    # The restart kept the undisturbed output: plain decoding from the prompt agrees.
    assert got[: len(PROMPT) + 4] == reference(bounds, rounds=3, k=0)[0][: len(PROMPT) + 4]
    ring.close()


def test_a_round_taken_by_a_stage_killed_mid_round_is_finished_by_its_restart(
    stages, swarm, key, redis_url
):
    stages.start("h0", "0:1", redis_url, wait=False)
    stages.start("h1", "1:3", redis_url, "--delay-ms", "2000", wait=False)  # the middle stage
    stages.start("h2", "3:4", redis_url, wait=False)
    stages.wait_ready(["h0", "h1", "h2"])
    ring = RedisRing(
        nodes(("h0", redis_url, "0:1"), ("h1", redis_url, "1:3"), ("h2", redis_url, "3:4")),
        swarm,
        key,
        redis_url,
        timeout_s=60,
        retries=0,
    )
    ring.reset("s", PARAMS)
    client = redis.Redis.from_url(redis_url)

    def taken_by_h1():
        pending = client.xpending(streams.stage_key(swarm, "h1"), streams.GROUP)
        return pending["pending"] >= 1 and pending

    def kill_when_taken():
        wait_until(taken_by_h1, 30, "h1 to take the round")  # held inside its 2 s forward
        stages.kill9("h1")
        stages.restart("h1", drop_args=("--delay-ms",))

    killer = threading.Thread(target=kill_when_taken)
    started = time.monotonic()
    killer.start()
    result = ring.round(Round("s", PROMPT, 0))  # a prefill: a fresh stage can run it
    killer.join()
    # No re-send happened (retries=0, well inside the timeout): the restarted h1 re-read the
    # entry it had left pending, ran it and sent the result on.
    assert time.monotonic() - started < 50
    ref = ReferenceRing([(0, 1), (1, 3), (3, 4)])
    ref.reset("r", PARAMS)
    assert result == ref.round(Round("r", PROMPT, 0))
    wait_until(
        lambda: client.xpending(streams.stage_key(swarm, "h1"), streams.GROUP)["pending"] == 0,
        10,
        "h1 to acknowledge the round",
    )
    client.close()
    ring.close()


def test_killed_tail_lost_its_parameters_and_gets_them_back(stages, swarm, key, redis_url):
    stages.start("h0", "0:2", redis_url, wait=False)
    stages.start("h1", "2:4", redis_url, wait=False)
    stages.wait_ready(["h0", "h1"])
    ring = RedisRing(
        nodes(("h0", redis_url, "0:2"), ("h1", redis_url, "2:4")), swarm, key, redis_url
    )
    ring.reset("s", PARAMS)
    committed, _ = drive(ring, "s", rounds=2, k=1)
    stages.kill9("h1")
    stages.restart("h1")
    with pytest.raises(GapError):
        ring.round(Round("s", [committed[-1]], len(committed) - 1))
    result = ring.round(Round("s", committed, 0))  # replay: the tail has its parameters again
    ref = ReferenceRing([(0, 2), (2, 4)])
    ref.reset("r", PARAMS)
    expected, _ = drive(ref, "r", rounds=2, k=1)
    assert result == ref.round(Round("r", expected, 0))
    ring.close()


def test_a_round_nobody_answers_is_resent_then_fails(swarm, key, redis_url):
    ring = RedisRing(
        [wire.Hop("nobody", redis_url, 0, 4, "toy")],
        swarm,
        key,
        redis_url,
        timeout_s=0.2,
        retries=2,
    )
    ring.reset("s", PARAMS)
    # Two tokens add 2 × 50 ms to the 0.2 s wait.
    with pytest.raises(RingError, match=r"after \d+\.\d s \(no reply in 0.3 s; route nobody\)"):
        ring.round(Round("s", [1, 2], 0, 1))
    client = redis.Redis.from_url(redis_url)
    entries = client.xrange(streams.stage_key(swarm, "nobody"))
    rounds = [wire.decode(f[streams.FIELD], swarm, key) for _, f in entries]
    assert [m.kind for m in rounds] == ["reset", "round", "round", "round"]
    assert len({m.round_id for m in rounds[1:]}) == 3  # each send has an id of its own
    assert len({(m.start_pos, m.tokens) for m in rounds[1:]}) == 1  # of the same round
    # Each try is fresh for as long as the ring still waits: what is left of the 0.9 s of all
    # three tries as it goes out. Each try waits its whole 0.3 s before the next, however late
    # the scheduler runs it (the int() of a millisecond aside), and the last goes out in time.
    waits = [m.wait_ms for m in rounds[1:]]
    assert 850 <= waits[0] <= 900 and waits[-1] > 0, waits
    assert all(earlier - later >= 299 for earlier, later in itertools.pairwise(waits)), waits
    assert rounds[0].wait_ms == 200  # a control waits as long as a round without tokens
    client.close()
    ring.close()


def test_a_full_redis_on_the_way_is_waited_out_like_a_restarting_one(swarm, key):
    """A job that started while a stage host's Redis refused writes (full) failed at once with
    the refusal; it waits, as for a Redis that restarts, until the memory is freed."""
    from specpipe.ops.redis_server import RedisServer

    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used + 2**20)
        junk = 0
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            while junk < 64:
                client.set(f"junk:{junk}", b"x" * 2**16)
                junk += 1
        freed = threading.Timer(1.0, lambda: client.delete(*(f"junk:{i}" for i in range(junk))))
        ring = RedisRing(
            [wire.Hop("h", server.url, 0, 4, "toy")], swarm, key, server.url, timeout_s=3.0
        )
        started = time.monotonic()
        freed.start()
        try:
            ring.reset("s", PARAMS)  # before, RingError: "h's Redis ... refused: OOM ..."
        finally:
            freed.join()
        assert time.monotonic() - started >= 0.9  # it waited for the room
        entries = client.xrange(streams.stage_key(swarm, "h"))
        assert [wire.decode(f[streams.FIELD], swarm, key).kind for _, f in entries] == ["reset"]
        ring.close()
        client.close()


def test_a_ring_needs_every_layer_served(stages, ring_settings, redis_url):
    stages.start("a", "0:2", redis_url)
    with pytest.raises(RouteError, match="no online stage serves layers 2:4"):
        RedisRing.from_inventory(ring_settings, "toy", 4)
    stages.stop()  # a clean stop takes the node out of the inventory
    with pytest.raises(RouteError, match="layers 0:4"):
        RedisRing.from_inventory(ring_settings, "toy", 4)


def test_an_unreachable_first_stage_is_a_clear_ring_error(swarm, key, redis_url):
    from specpipe.ops.redis_server import free_port

    gone = f"redis://127.0.0.1:{free_port()}/0"
    ring = RedisRing(
        [wire.Hop("h", gone, 0, 4, "toy")], swarm, key, redis_url, timeout_s=0.1, retries=1
    )
    with pytest.raises(RingError, match="cannot reach h's Redis"):
        ring.reset("s", PARAMS)
    ring._params["s"] = PARAMS  # as if h's Redis went away after the reset
    with pytest.raises(RingError, match=r"after \d+\.\d s \(Redis unavailable"):
        ring.round(Round("s", [1], 0))
    ring.close()


def test_a_reset_stops_waiting_for_a_hops_redis_once_the_watchdog_says_it_is_gone(
    swarm, key, redis_url
):
    from specpipe.ops.redis_server import free_port
    from specpipe.swarm.redis_ring import HopLostError

    gone = f"redis://127.0.0.1:{free_port()}/0"
    route = [wire.Hop("h", redis_url, 0, 2, "toy"), wire.Hop("cut", gone, 2, 4, "toy")]
    asked = []

    def watchdog():
        asked.append(time.monotonic())
        return "cut stopped heartbeating" if len(asked) >= 2 else None

    ring = RedisRing(route, swarm, key, redis_url, timeout_s=30, watchdog=watchdog)
    started = time.monotonic()
    with pytest.raises(HopLostError, match="cut stopped heartbeating"):
        ring.reset("s", PARAMS)  # not the 30 s a restarting Redis is waited for
    assert len(asked) == 2 and time.monotonic() - started < 10
    ring.close()


def test_ring_refuses_bad_rounds_and_parameters(swarm, key, redis_url):
    ring = RedisRing([wire.Hop("h", redis_url, 0, 4, "toy")], swarm, key, redis_url)
    with pytest.raises(RingError, match="not reset"):
        ring.round(Round("s", [1], 0))
    with pytest.raises(ValueError, match="top_p"):
        ring.reset("s", SamplingParams(temp=1.0, top_p=1.5))
    ring.reset("s", PARAMS)
    with pytest.raises(ValueError, match="drafts"):
        ring.round(Round("s", [1, 2], 0, 2))
    ring.close()


def test_a_stage_rides_out_a_restart_of_its_redis(stages, swarm, key, redis_url):
    from specpipe.ops.redis_server import RedisServer, free_port

    port = free_port()
    server = RedisServer(port=port)
    own = server.start()
    try:
        # Frequent heartbeats: the wait below for two of them is short.
        stages.start("a", "0:2", own, "--heartbeat-s", "0.1", wait=False)
        stages.start("b", "2:4", redis_url, wait=False)
        stages.wait_ready(["a", "b"])
        ring = RedisRing(
            nodes(("a", own, "0:2"), ("b", redis_url, "2:4")), swarm, key, redis_url, timeout_s=20
        )
        ring.reset("s", PARAMS)
        committed, _ = drive(ring, "s", rounds=2, k=2)
        server.stop()
        # Restart only once stage a has read (and failed) at least once while its Redis was
        # gone, and is still heartbeating: it lives through the outage, not just a reconnect.
        two_heartbeats_later(redis_url, swarm, key, "a")
        server = RedisServer(port=port)
        server.start()
        # The new Redis is empty, but stage a kept its caches: the session goes on unchanged.
        got, _ = drive(ring, "s", rounds=2, k=2, committed=committed)
        assert got == reference([(0, 2), (2, 4)], rounds=4, k=2)[0]
        ring.close()
    finally:
        stages.stop()
        server.stop()


@pytest.mark.slow
def test_generation_over_the_swarm_survives_a_killed_stage_with_the_same_output(
    stages, ring_settings, redis_url
):
    bounds = [(0, 1), (1, 3), (3, 4)]
    for host, (a, b) in zip(["h0", "h1", "h2"], bounds, strict=True):
        stages.start(host, f"{a}:{b}", redis_url, wait=False)
    stages.wait_ready(["h0", "h1", "h2"])
    ring = RedisRing.from_inventory(ring_settings, "toy", 4, timeout_s=30)
    # Greedy on the toy model soon repeats itself, so the n-gram drafts get accepted.
    greedy = SamplingParams(temp=0.0)
    options = dict(max_new_tokens=30, draft_k=3)

    local = Generation(ReferenceRing(bounds), "l", PROMPT * 2, greedy, **options)
    expected = local.run()
    plain = Generation(ReferenceRing(bounds), "p", PROMPT * 2, greedy, max_new_tokens=30, draft_k=0)
    assert plain.run() == expected  # lossless: speculative equals plain decoding here

    swarm_run = Generation(ring, "s", PROMPT * 2, greedy, **options)
    for i, _ in enumerate(swarm_run.rounds()):
        if i == 2:
            stages.kill9("h1")
            stages.restart("h1")
    assert swarm_run.generated == expected
    assert swarm_run.stats.replays == 1
    assert swarm_run.stats.accepted > 0  # the n-gram drafts did get verified in one trip

    # reseed: new parameters on the tail, caches kept; the same as in-process.
    other = SamplingParams(temp=1.3, top_p=0.8, top_k=0, seed=99)
    ref = ReferenceRing(bounds)
    ref.reset("s", PARAMS)
    ring.reset("s", PARAMS)
    committed, _ = drive(ring, "s", rounds=1, k=2)
    assert committed == drive(ref, "s", rounds=1, k=2)[0]
    ring.reseed("s", other)
    ref.reseed("s", other)
    assert drive(ring, "s", 3, 2, committed=list(committed)) == drive(
        ref, "s", 3, 2, committed=list(committed)
    )
    ring.close()


def test_a_round_waits_as_long_as_its_ring_says_not_a_sockets_five_seconds(
    stages, swarm, key, redis_url
):
    # The stage takes 7 s a forward: longer than redis-py's default socket timeout (5 s).
    stages.start("slow", "0:4", redis_url, "--delay-ms", "7000")
    ring = RedisRing(
        nodes(("slow", redis_url, "0:4")), swarm, key, redis_url, timeout_s=12, retries=0
    )
    ring.reset("s", PARAMS)
    started = time.monotonic()
    result = ring.round(Round("s", PROMPT, 0))
    assert time.monotonic() - started >= 6.5
    want = ReferenceRing([(0, 4)])
    want.reset("ref", PARAMS)
    assert result == want.round(Round("ref", PROMPT, 0))
    ring.close()


def test_a_rounds_wait_grows_with_the_tokens_it_carries(redis_url, swarm, key):
    ring = RedisRing(nodes(("a", redis_url, "0:4")), swarm, key, redis_url, timeout_s=30)
    assert ring.round_wait_s(1) == pytest.approx(30 + 0.05)
    assert ring.round_wait_s(4096) == pytest.approx(30 + 4096 * 0.05)  # a long prefill or replay
    ring.close()


def test_a_delayed_ring_and_its_twins_wait_longer_by_every_links_delay(redis_url, swarm, key):
    delayed = DelayedRing(
        nodes(("a", redis_url, "0:2"), ("b", redis_url, "2:4")),
        swarm,
        key,
        redis_url,
        timeout_s=30,
        delay_s=0.025,
    )
    assert delayed.round_wait_s(1) == pytest.approx(30 + 0.05 + 3 * 0.025)
    twin = delayed.twin()
    assert isinstance(twin, DelayedRing) and twin.round_wait_s(1) == delayed.round_wait_s(1)
    for ring in (delayed, twin):
        ring.close()


@pytest.mark.slow
def test_a_stage_stopped_for_twenty_seconds_delays_the_job_without_changing_it(
    stages, ring_settings, redis_url
):
    # SIGSTOP, as a stalled host or a long swap-out would: past three 5 s socket timeouts.
    stages.start("a", "0:2", redis_url, wait=False)
    stages.start("b", "2:4", redis_url, wait=False)
    stages.wait_ready(["a", "b"])
    ring = RedisRing.from_inventory(ring_settings, "toy", 4)
    greedy = SamplingParams(temp=0.0)
    expected = Generation(
        ReferenceRing([(0, 2), (2, 4)]), "ref", PROMPT, greedy, max_new_tokens=12, draft_k=2
    ).run()
    run = Generation(ring, "s", PROMPT, greedy, max_new_tokens=12, draft_k=2)
    stalled = 0.0
    for i, _ in enumerate(run.rounds()):
        if i == 1:
            stages.procs["b"].send_signal(signal.SIGSTOP)
            threading.Timer(20.0, stages.procs["b"].send_signal, [signal.SIGCONT]).start()
            stalled = time.monotonic()
    assert run.generated == expected
    assert time.monotonic() - stalled >= 20.0
    ring.close()


def test_a_reset_rides_out_a_redis_that_is_restarting(swarm, key):
    """A job that starts while its Redis restarts waits for it rather than failing."""
    from specpipe.ops.redis_server import RedisServer

    server = RedisServer()
    url = server.url  # nothing listens there yet: the Redis is "restarting"
    ring = RedisRing([wire.Hop("h", url, 0, 4, "toy")], swarm, key, url, timeout_s=20)
    later = threading.Timer(1.5, server.start)
    later.start()
    try:
        ring.reset("s", PARAMS)
        client = redis.Redis.from_url(url)
        [(_, fields)] = client.xrange(streams.stage_key(swarm, "h"))
        assert wire.decode(fields[streams.FIELD], swarm, key).kind == "reset"
        client.close()
    finally:
        later.join()
        ring.close()
        server.stop()


def test_a_next_hop_a_stage_cannot_reach_is_named_to_the_ring(stages, swarm, key, redis_url):
    stages.start("h0", "0:2", redis_url)
    ring = RedisRing(
        nodes(("h0", redis_url, "0:2"), ("gone", redis_url, "2:4")), swarm, key, redis_url
    )
    ring.reset("s", PARAMS)
    with pytest.raises(HopUnreachableError, match="cannot pass the round to gone") as refused:
        ring.round(Round("s", PROMPT, 0))
    assert refused.value.host == "gone"  # the hop after the stage that could not pass it on
    ring.close()


def test_a_jobs_ring_waits_out_a_restarting_registry_and_a_command_does_not(
    ring_settings, swarm, key
):
    """The fault matrix's kill of the broker and registry Redis failed a job whose ring was
    being built while Redis restarted ("cannot read the inventory … Connection refused"). A job's
    ring reads the inventory again while the registry is away, for as long as a round waits."""
    from specpipe.ops.redis_server import RedisServer

    server = RedisServer()
    url = server.url
    # No coordinator key pinned: the shared-key mode, opted into out loud.
    settings = ring_settings.for_swarm(url, swarm, key, insecure_shared_key=True)
    record = nodes(("a", url, "0:4"))[0]
    with pytest.raises(RingError, match="cannot read the inventory"):
        RedisRing.from_inventory(settings, "toy", 4)  # nothing listens: at once

    def restart() -> None:
        time.sleep(1.5)
        server.start()
        client = redis.Redis.from_url(url)
        inventory.publish(client, swarm, record, key)
        client.close()

    thread = threading.Thread(target=restart)
    thread.start()
    try:
        started = time.monotonic()
        ring = RedisRing.from_inventory(settings, "toy", 4, outage_s=20)
        assert [hop.host for hop in ring.route] == ["a"]
        assert 1.5 <= time.monotonic() - started < 20
        ring.close()
    finally:
        thread.join()
        server.stop()
