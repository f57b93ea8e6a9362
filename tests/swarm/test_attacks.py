"""The data plane under attack: each replay, redirect and poison entry of the security review,
against real stage processes on a real Redis. The session goes on with exactly the output it
would have had, and every stage keeps serving."""

from __future__ import annotations

import threading

import msgpack
import pytest
import redis

from specpipe.swarm import streams, wire
from specpipe.swarm.redis_ring import RedisRing
from tests.swarm.test_redis_ring import (
    PARAMS,
    caught_up,
    drive,
    reference,
    stats,
    two_heartbeats_later,
)
from tests.waiting import wait_until

BOUNDS = [(0, 2), (2, 4)]
MAX_BYTES = 1024 * 1024  # h1's limit on one message


class Tap:
    """Copies every entry added to `stream` from now on, as an eavesdropper on the link would.

    A blocked XREAD is answered as the entry is added, before its stage can delete it."""

    def __init__(self, url: str, stream: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.stream = stream
        self.seen: list[bytes] = []
        self._stop = threading.Event()
        self._cursor = self.client.xinfo_stream(stream)["last-generated-id"]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            reply = self.client.xread({self.stream: self._cursor}, block=100)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    self._cursor = entry_id
                    self.seen.append(fields[streams.FIELD])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.client.close()


@pytest.fixture
def ring(stages, swarm, key, redis_url):
    stages.start("h0", "0:2", redis_url, wait=False)
    stages.start("h1", "2:4", redis_url, "--max-message-bytes", str(MAX_BYTES), wait=False)
    stages.wait_ready(["h0", "h1"])
    route = (wire.Hop("h0", redis_url, 0, 2, "toy"), wire.Hop("h1", redis_url, 2, 4, "toy"))
    ring = RedisRing(route, swarm, key, redis_url, timeout_s=20)
    yield ring
    ring.close()


def all_caught_up(url: str, swarm: str) -> bool:
    client = redis.Redis.from_url(url)
    try:
        return caught_up(client, swarm, "h0") and caught_up(client, swarm, "h1")
    finally:
        client.close()


def test_a_stage_round_copied_into_the_reply_stream_does_not_end_the_job(ring, swarm, redis_url):
    """On main: "round failed: round"."""
    tap = Tap(redis_url, streams.stage_key(swarm, "h1"))
    ring.reset("s", PARAMS)
    committed, _ = drive(ring, "s", rounds=1, k=2)
    tap.close()
    client = redis.Redis.from_url(redis_url)
    reply_streams = [streams.reply_key(swarm, "s", host) for host in ("h0", "h1")]
    for data in tap.seen:  # h0's rounds to h1, signed by the swarm key, in each host's stream
        for reply_stream in reply_streams:
            client.xadd(reply_stream, {streams.FIELD: data})
    got, _ = drive(ring, "s", rounds=3, k=2, committed=committed)
    assert got == reference(BOUNDS, rounds=4, k=2)[0]
    assert ring.dropped_replies >= 2 * len(tap.seen) > 0
    client.close()


def test_replayed_resets_and_rounds_change_nothing(ring, stages, swarm, key, redis_url):
    """On main: two replayed resets force a gap, a replay, a second gap and a failed job; a
    drop and the first rounds replayed make every stage redo its forwards."""
    taps = {host: Tap(redis_url, streams.stage_key(swarm, host)) for host in ("h0", "h1")}
    ring.reset("s", PARAMS)
    committed, _ = drive(ring, "s", rounds=1, k=2)
    for tap in taps.values():
        tap.close()
    wait_until(lambda: all_caught_up(redis_url, swarm), 10, "both stages to be idle")
    for host in taps:
        two_heartbeats_later(redis_url, swarm, key, host)  # its counters are in Redis
    processed = {h: stats(redis_url, swarm, h).get("processed", 0) for h in taps}
    client = redis.Redis.from_url(redis_url)
    drop = wire.Message(kind="drop", session="s")  # what an attacker cannot sign: ignored
    replayed = 0
    for host, tap in taps.items():  # everything each stage received, twice over, and a drop
        stream = streams.stage_key(swarm, host)
        client.xadd(stream, {streams.FIELD: wire.encode(drop, swarm, b"not the swarm key")})
        for data in tap.seen * 2:
            streams.send(client, stream, data)
            replayed += 1
    wait_until(
        lambda: sum(stats(redis_url, swarm, h).get("replayed", 0) for h in taps) == replayed,
        20,
        f"{replayed} replays refused",
    )
    got, _ = drive(ring, "s", rounds=3, k=2, committed=committed)
    assert got == reference(BOUNDS, rounds=4, k=2)[0]
    for host in taps:  # no forward was redone: only the three new rounds ran
        two_heartbeats_later(redis_url, swarm, key, host)
        assert stats(redis_url, swarm, host).get("processed") == processed[host] + 3
        assert stats(redis_url, swarm, host).get("gaps", 0) == 0
    client.close()


def test_poison_entries_are_acked_and_the_stage_keeps_serving(ring, stages, swarm, key, redis_url):
    """On main: a signed reset with seed=inf, a signed shape [0, 2**63] or a clobbered stats
    hash crash-loop the stage, and a 512 MB value is read into its memory."""
    stream = streams.stage_key(swarm, "h1")
    client = redis.Redis.from_url(redis_url)

    def signed(message: wire.Message) -> bytes:
        fields = dict(to=stream, sender=wire.COORDINATOR, seq=wire.next_seq(0))
        return wire.encode(wire.Message(**{**message.__dict__, **fields}), swarm, key)

    inf_seed = {"temp": 0.5, "top_p": 1.0, "top_k": 0, "seed": float("inf")}
    streams.send(client, stream, signed(wire.Message(kind="reset", session="x", params=inf_seed)))
    header = {
        "swarm": swarm,
        "to": stream,
        "dir": "stage",
        "from": wire.COORDINATOR,
        "kind": "round",
        "session": "y",
        "seq": wire.next_seq(0),
        "tokens": [1],
        "dtype": "float32",
        "shape": [0, 2**63],
    }
    head = msgpack.packb(header)
    streams.send(client, stream, wire.seal(wire.HEAD_LEN.pack(len(head)) + head, key))
    client.set(streams.stats_key(swarm, "h1"), "not a hash")
    streams.send(client, stream, b"x" * (2 * MAX_BYTES))
    wait_until(lambda: all_caught_up(redis_url, swarm), 15, "h1 to ack every entry")
    assert stages.procs["h1"].poll() is None
    ring.reset("s", PARAMS)
    got, _ = drive(ring, "s", rounds=2, k=2)
    assert got == reference(BOUNDS, rounds=2, k=2)[0]
    assert stats(redis_url, swarm, "h1").get("dropped", 0) == 3
    [(_, letter)] = client.xrange(streams.dead_key(swarm, "h1"))
    assert letter[b"bytes"] == str(2 * MAX_BYTES).encode()  # dropped in Redis, never read
    client.close()
