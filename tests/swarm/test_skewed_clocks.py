"""Stage processes whose wall clock is 20 s off (libfaketime): they date their heartbeats, and
judge the coordinator's rounds, on the registry's clock, so such a stage serves like any other,
is not routed around while a spare waits, and lapses on time once it is killed."""

from __future__ import annotations

import os
import time

import pytest
import redis

from specpipe.bench.soak import faketime_library
from specpipe.core.sampling import SamplingParams
from specpipe.decoding.generation import Generation
from specpipe.swarm import inventory, streams
from specpipe.swarm.failover import lost_with_spare
from tests.swarm.conftest import Stages
from tests.swarm.test_failover import FAILOVER_BOUND_S, checked_ring
from tests.swarm.test_redis_ring import PROMPT, ReferenceRing
from tests.waiting import wait_until

FAKETIME = faketime_library()


@pytest.fixture
def skewed(swarm, key, redis_url):
    """Toy stages whose wall clock runs `skewed.env["FAKETIME"]` off (monotonic time is true)."""
    if FAKETIME is None:
        if os.environ.get("CI"):
            pytest.fail("cannot run under CI: libfaketime is not installed (requirements-dev.txt)")
        pytest.skip("libfaketime is not installed")
    group = Stages(
        swarm, key, redis_url, env={"LD_PRELOAD": FAKETIME, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    )
    yield group
    group.stop()


def record(redis_url: str, swarm: str, key: bytes, host: str):
    """`host`'s verified record and the swarm time it was read at (None: no record)."""
    client = redis.Redis.from_url(redis_url)
    try:
        found = inventory.read(client, swarm, key)
    finally:
        client.close()
    return next((n for n in found.nodes if n.host == host), None), found.now


@pytest.mark.parametrize("skew_s", [20, -20], ids=["20s-fast", "20s-slow"])
def test_a_stage_with_a_skewed_clock_serves_is_kept_and_lapses_on_time(
    stages, skewed, ring_settings, redis_url, swarm, key, skew_s
):
    skewed.env["FAKETIME"] = f"{skew_s:+d}s"
    skewed.start("s", "0:2", redis_url, wait=False)  # the first hop: it reads the coordinator's
    stages.start("t", "2:4", redis_url, wait=False)  # rounds and looks up the tail's address
    stages.wait_ready(["t"])
    wait_until(lambda: record(redis_url, swarm, key, "s")[0], 60, "the skewed stage's record")
    params = SamplingParams(temp=0.0)
    options = dict(max_new_tokens=40, draft_k=3)
    expected = Generation(ReferenceRing([(0, 2), (2, 4)]), "l", PROMPT * 2, params, **options).run()
    ring = checked_ring(ring_settings, "toy", 4)
    assert [hop.host for hop in ring.route] == ["s", "t"]
    stages.start("spare", "0:2", redis_url)

    # With a spare at hand, the watchdog would route around a stage it took for dead.
    lost = lost_with_spare(ring_settings, "toy", 4)
    for _ in range(4):  # over several of its beats
        node, now = record(redis_url, swarm, key, "s")
        assert node is not None and node.status(now) == "online" and not node.lapsed(now)
        assert lost(ring.route) == []
        time.sleep(0.3)
    # It says how far its clock is off the registry's.
    assert node.clock_offset_s == pytest.approx(-skew_s, abs=1.0)

    def counted() -> dict[str, float] | None:
        stats = own_stats(redis_url, swarm, "s")
        return stats if stats.get("processed", 0) >= 4 else None

    run = Generation(ring, "g", PROMPT * 2, params, **options)
    stall_s, killed_at = 0.0, None
    for i, _ in enumerate(run.rounds()):
        if killed_at is not None and not stall_s:
            stall_s = time.monotonic() - killed_at
        if i == 3:
            # Every round so far went through the skewed stage: none was refused as stale.
            assert ring.failovers == 0 and [hop.host for hop in ring.route] == ["s", "t"]
            stats = wait_until(counted, 5, "the skewed stage's counters")
            assert stats.get("replayed", 0) == stats.get("dropped", 0) == 0, stats
            skewed.kill9("s")  # never restarted: it lapses after its lapse_s of swarm time
            killed_at = time.monotonic()
    ring.close()
    assert run.generated == expected
    assert ring.failovers == 1 and [hop.host for hop in ring.route] == ["spare", "t"]
    assert 0 < stall_s < FAILOVER_BOUND_S, stall_s


def own_stats(redis_url: str, swarm: str, host: str) -> dict[str, float]:
    client = redis.Redis.from_url(redis_url)
    try:
        return streams.read_stats(client, swarm, host)
    finally:
        client.close()
