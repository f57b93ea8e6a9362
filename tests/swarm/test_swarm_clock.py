"""Swarm time: each process's estimate of the registry Redis's clock, and liveness and freshness
judged on it, so that no host's own clock, however far off, decides who is alive."""

from __future__ import annotations

import itertools
import logging
import time

import pytest
import redis

from specpipe.swarm import clock, inventory, wire
from specpipe.swarm.clock import SwarmClock
from specpipe.swarm.inventory import NodeInfo

TRUE_TIME = time.time  # this machine's clock, the registry's too: the tests skew `time.time`


def skew(monkeypatch, seconds: float) -> None:
    """This process's clock from now on: `seconds` off the true time (and the registry's)."""
    monkeypatch.setattr(time, "time", lambda: TRUE_TIME() + seconds)


class FakeRegistry:
    """A registry whose `TIME` runs `ahead_s` ahead of true time, on a simulated timeline (time
    passes as `true` says): each sample's trip out and back take the next of `trips` (seconds),
    and this process's clock runs `skew_s` off true time."""

    def __init__(self, monkeypatch, skew_s=0.0, ahead_s=0.0, trips=((0.001, 0.001),)) -> None:
        self.true = 1_700_000_000.0
        self.skew_s, self.ahead_s = skew_s, ahead_s
        self.trips = itertools.cycle(trips)
        self.down = False
        monkeypatch.setattr(time, "time", lambda: self.true + self.skew_s)
        monkeypatch.setattr(time, "monotonic", lambda: self.true - 1_600_000_000.0)

    def time(self) -> tuple[int, int]:
        if self.down:
            raise redis.ConnectionError("the registry is away")
        out, back = next(self.trips)
        self.true += out
        server = self.true + self.ahead_s
        self.true += back
        return int(server), round((server - int(server)) * 1_000_000)


@pytest.mark.parametrize(("skew_s", "ahead_s"), [(0, 0), (20, 0), (-20, 0), (-3, 45), (600, -7)])
def test_the_offset_is_the_registrys_clock_less_ours(monkeypatch, skew_s, ahead_s):
    registry = FakeRegistry(monkeypatch, skew_s, ahead_s)
    swarm_clock = SwarmClock(registry)
    assert swarm_clock.offset_s == pytest.approx(ahead_s - skew_s, abs=1e-5)
    assert swarm_clock.now() == pytest.approx(registry.true + ahead_s, abs=1e-5)


def test_an_uneven_trip_errs_by_half_the_round_trip_at_most(monkeypatch):
    registry = FakeRegistry(monkeypatch, skew_s=20, trips=[(0.3, 0.0)])
    swarm_clock = SwarmClock(registry)
    error = swarm_clock.offset_s - -20
    assert swarm_clock.rtt_s == pytest.approx(0.3, abs=1e-6)
    assert abs(error) <= swarm_clock.rtt_s / 2 + 1e-6 and error == pytest.approx(0.15, abs=1e-5)


def test_the_estimate_comes_from_the_quickest_of_the_last_samples(monkeypatch):
    registry = FakeRegistry(monkeypatch, skew_s=-20, trips=[(0.4, 0.0), (0.001, 0.001), (0.0, 0.5)])
    swarm_clock = SwarmClock(registry, refresh_s=0)  # every read of the clock samples again
    offsets = [swarm_clock.offset_s for _ in range(3)]
    assert offsets[0] == pytest.approx(20.2, abs=1e-5)  # the first and only sample so far
    assert offsets[1:] == pytest.approx([20.0, 20.0], abs=1e-5)  # then the quickest one's
    assert swarm_clock.rtt_s == pytest.approx(0.002, abs=1e-6)
    registry.trips = itertools.cycle([(0.1, 0.1)])
    for _ in range(clock.SAMPLES):  # the quick sample ages out of the last SAMPLES
        swarm_clock.offset_s  # noqa: B018 (a read of the clock samples)
    assert swarm_clock.rtt_s == pytest.approx(0.2, abs=1e-6)


def test_the_estimate_is_taken_again_when_old(monkeypatch):
    registry = FakeRegistry(monkeypatch, ahead_s=5)
    swarm_clock = SwarmClock(registry, refresh_s=3600)
    assert swarm_clock.offset_s == pytest.approx(5, abs=1e-5)
    registry.ahead_s = 6  # the registry's clock was stepped: seen only once the estimate is old
    registry.trips = itertools.cycle([(0.01, 0.01)])  # a slower sample, but the one since the step
    assert swarm_clock.offset_s == pytest.approx(5, abs=1e-5)
    registry.true += 3601  # an hour later
    assert swarm_clock.offset_s == pytest.approx(6, abs=1e-5)


def test_a_step_of_this_hosts_clock_is_seen_at_once(monkeypatch):
    registry = FakeRegistry(monkeypatch, skew_s=-20)
    swarm_clock = SwarmClock(registry, refresh_s=3600)
    assert swarm_clock.now() == pytest.approx(registry.true, abs=1e-5)
    registry.true += 1
    registry.skew_s = 0  # NTP put it right
    assert swarm_clock.offset_s == pytest.approx(0, abs=1e-5)
    assert swarm_clock.now() == pytest.approx(registry.true, abs=1e-5)


def test_a_registry_that_does_not_answer_keeps_the_last_estimate(monkeypatch, caplog):
    monkeypatch.setattr(clock, "RETRY_S", 0.0)
    registry = FakeRegistry(monkeypatch, skew_s=20)
    registry.down = True
    swarm_clock = SwarmClock(registry, refresh_s=0)
    with caplog.at_level(logging.WARNING, "specpipe.clock"):
        assert swarm_clock.offset_s == 0.0  # no estimate yet: this host's own clock
        assert swarm_clock.offset_s == 0.0  # tried again: said once
    assert caplog.text.count("cannot read the registry's clock") == 1
    assert "judging time on this host's own" in caplog.text
    registry.down = False
    assert swarm_clock.offset_s == pytest.approx(-20, abs=1e-5)
    registry.down = True
    caplog.clear()
    with caplog.at_level(logging.WARNING, "specpipe.clock"):
        assert swarm_clock.offset_s == pytest.approx(-20, abs=1e-5)
    assert "keeping the offset -20.000 s" in caplog.text


def test_a_clock_far_off_the_registrys_is_logged_once(monkeypatch, caplog):
    registry = FakeRegistry(monkeypatch, skew_s=-20)
    swarm_clock = SwarmClock(registry, refresh_s=0)
    with caplog.at_level(logging.WARNING, "specpipe.clock"):
        for _ in range(3):
            swarm_clock.now()
    assert caplog.text.count("this host's clock is 20.0 s behind the registry's") == 1


def test_against_a_real_redis_the_offset_is_within_the_round_trip(redis_url):
    client = redis.Redis.from_url(redis_url)
    swarm_clock = SwarmClock(client)
    # The test's Redis runs on this machine: its clock is ours, the true offset 0.
    assert abs(swarm_clock.offset_s) <= swarm_clock.rtt_s / 2 + 1e-6
    client.close()


@pytest.mark.parametrize("skew_s", [20.0, -20.0, -3600.0])
def test_a_skewed_clock_gives_the_registrys_time(redis_url, monkeypatch, skew_s):
    client = redis.Redis.from_url(redis_url)
    skew(monkeypatch, skew_s)
    swarm_clock = SwarmClock(client)
    before = swarm_clock.now()
    seconds, micros = client.time()
    after = swarm_clock.now()
    error = swarm_clock.rtt_s / 2 + 1e-6
    assert before - error <= seconds + micros / 1e6 <= after + error
    assert swarm_clock.offset_s == pytest.approx(-skew_s, abs=0.05)
    client.close()


def test_the_clock_may_be_read_from_many_threads(redis_url):
    from concurrent.futures import ThreadPoolExecutor

    client = redis.Redis.from_url(redis_url)
    swarm_clock = SwarmClock(client, refresh_s=0)
    with ThreadPoolExecutor(8) as pool:
        nows = list(pool.map(lambda _: swarm_clock.now(), range(200)))
    assert max(nows) - min(nows) < 5 and abs(swarm_clock.offset_s) < 0.05
    client.close()


# --- liveness in swarm time ---------------------------------------------------------------


def stamped_by(client, swarm, key, host: str, skew_s: float, monkeypatch) -> NodeInfo:
    """Publish `host`'s record as its heartbeat does, from a host whose clock is `skew_s` off."""
    skew(monkeypatch, skew_s)
    stage_clock = SwarmClock(client)
    node = NodeInfo(
        host, 0, 2, "redis://127.0.0.1:6379/0", heartbeat_s=0.5, clock_offset_s=stage_clock.offset_s
    )
    return inventory.publish(client, swarm, node, key, now=stage_clock.now())


@pytest.mark.parametrize("reader_skew_s", [0.0, -7.0, 45.0])
def test_stages_20_s_slow_or_fast_are_judged_live_as_one_on_time(
    swarm, redis_url, key, monkeypatch, reader_skew_s
):
    client = redis.Redis.from_url(redis_url)
    for host, skew_s in (("slow", -20.0), ("right", 0.0), ("fast", 20.0)):
        stamped_by(client, swarm, key, host, skew_s, monkeypatch)
    skew(monkeypatch, reader_skew_s)  # whoever reads (a coordinator, host 0) may be off too
    found = inventory.read(client, swarm, key)
    assert found.ignored == 0
    assert {n.host: (n.status(found.now), n.lapsed(found.now)) for n in found.nodes} == {
        "slow": ("online", False),
        "right": ("online", False),
        "fast": ("online", False),
    }
    beats = [n.last_heartbeat for n in found.nodes]
    assert max(beats) - min(beats) < 0.5  # stamped within moments of each other: so they read
    spares = inventory.route(found.nodes, 2, now=found.now)
    assert len(spares) == 1  # one of three spares, none of them lapsed
    client.close()


def test_a_dead_stage_whose_clock_ran_60_s_fast_lapses_after_lapse_s(
    swarm, redis_url, key, monkeypatch
):
    client = redis.Redis.from_url(redis_url)
    last = stamped_by(client, swarm, key, "fast", 60.0, monkeypatch)  # its last beat; then dies
    skew(monkeypatch, 0.0)
    found = inventory.read(client, swarm, key)
    (node,) = found.nodes
    # Its own date, or the moment it was read where that date ran past it by the estimates'
    # error: a record is never believed fresher than its reading.
    assert 0 <= last.last_heartbeat - node.last_heartbeat < 0.01
    assert abs(found.now - node.last_heartbeat) < 0.1  # dated on the registry's clock
    lapse_s = node.lapse_s()
    assert not node.lapsed(node.last_heartbeat + lapse_s - 0.05)
    assert node.lapsed(node.last_heartbeat + lapse_s + 0.05)
    after = found.now + lapse_s + 0.05
    assert inventory.lost_hops([node], inventory.read(client, swarm, key, after).nodes, after)
    client.close()


def test_a_record_dated_10_s_ahead_of_swarm_time_is_refused(swarm, redis_url, key, monkeypatch):
    client = redis.Redis.from_url(redis_url)
    skew(monkeypatch, -30.0)  # the reader's own clock is no judge of the future either
    swarm_now = SwarmClock(client).now()
    node = NodeInfo("ahead", 0, 2, "redis://127.0.0.1:6379/0")
    inventory.publish(client, swarm, node, key, now=swarm_now + 10)
    assert inventory.read(client, swarm, key).ignored == 1
    inventory.publish(client, swarm, node, key, now=swarm_now + 1)  # within the estimates' error
    found = inventory.read(client, swarm, key)
    assert [n.host for n in found.nodes] == ["ahead"] and found.ignored == 0
    client.close()


def test_a_record_says_how_far_its_hosts_clock_is_off(swarm, redis_url, key, monkeypatch):
    client = redis.Redis.from_url(redis_url)
    stamped_by(client, swarm, key, "fast", 20.0, monkeypatch)
    (node,) = inventory.load(client, swarm, key)
    assert node.clock_offset_s == pytest.approx(-20, abs=0.05)
    header, row = inventory.table([node], now=node.last_heartbeat)
    assert header.split()[-1] == "CLOCK" and row.endswith("+20.0 s")
    assert inventory.table([NodeInfo("old", 0, 2, "redis://x")], now=0)[1].endswith("in step")
    client.close()


# --- freshness in swarm time --------------------------------------------------------------


@pytest.mark.parametrize(("sender_skew_s", "receiver_skew_s"), [(20, 0), (-20, 0), (-300, 45)])
def test_a_message_from_a_skewed_sender_is_fresh_in_swarm_time(
    redis_url, monkeypatch, sender_skew_s, receiver_skew_s
):
    client = redis.Redis.from_url(redis_url)
    skew(monkeypatch, sender_skew_s)
    message = wire.Message(
        kind="round", session="s", seq=wire.next_seq(0, SwarmClock(client).now()), wait_ms=1000
    )
    on_their_clock = wire.Message(kind="round", session="s", seq=wire.next_seq(0), wait_ms=1000)
    skew(monkeypatch, receiver_skew_s)
    assert wire.is_fresh(message, SwarmClock(client).now())
    # Stamped and judged on the hosts' own clocks, the sender would be dated off by the
    # difference, more than the slack allows.
    assert not wire.is_fresh(on_their_clock)
    late = wire.Message(kind="round", session="s", seq=message.seq, wait_ms=0)
    time.sleep(0.01)
    assert wire.is_fresh(late, SwarmClock(client).now())  # within the slack
    assert not wire.is_fresh(late, SwarmClock(client).now() + wire.CLOCK_SLACK_S + 0.1)
    client.close()
