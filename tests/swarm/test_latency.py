"""Host 0's figures of how far each stage host is (real Redis): measured by PING, published
where only host 0 writes, believed while fresh, and the choice between live replicas of a range
made by them (the nearer, a tie by name), never by what a host says of itself."""

from __future__ import annotations

import json
import time

import redis

from specpipe.ops.redis_server import free_port
from specpipe.swarm import inventory, latency
from specpipe.swarm.clock import SwarmClock
from specpipe.swarm.dialing import Dialer
from specpipe.swarm.inventory import NodeInfo, route

NOW = 1_000_000.0


def shared_key_env(key):
    """The environment `specpipe nodes` reads the swarm with, in the shared-key mode."""
    return {"SPECPIPE_SWARM_KEY": key.decode(), "SPECPIPE_INSECURE_SHARED_KEY": "1"}


def node(host, start, end, age=0.0, **kw):
    return NodeInfo(host, start, end, f"redis://{host}:6379/0", last_heartbeat=NOW - age, **kw)


def hosts(chain):
    return [n.host for n in chain]


def test_among_live_replicas_the_nearer_wins_and_a_near_tie_goes_by_name():
    nodes = [node("a", 0, 2), node("b", 0, 2), node("t", 2, 4)]
    assert hosts(route(nodes, 4, now=NOW)) == ["a", "t"]  # no figures: by name
    assert hosts(route(nodes, 4, now=NOW, latency_ms={"a": 40.0, "b": 3.0})) == ["b", "t"]
    # Within one bucket it is a tie: the name decides, so near-equal replicas do not take turns.
    assert hosts(route(nodes, 4, now=NOW, latency_ms={"a": 2.9, "b": 0.2})) == ["a", "t"]
    # A host not measured comes after the measured ones.
    assert hosts(route(nodes, 4, now=NOW, latency_ms={"b": 80.0})) == ["b", "t"]
    # A live host beats a nearer lapsed one; a host keeping the job's prefix beats a nearer one.
    lapsed = [node("a", 0, 2), node("b", 0, 2, age=2, heartbeat_s=0.5), node("t", 2, 4)]
    assert hosts(route(lapsed, 4, now=NOW, latency_ms={"a": 90.0, "b": 1.0})) == ["a", "t"]
    near_b = {"a": 90.0, "b": 1.0}
    assert hosts(route(nodes, 4, now=NOW, latency_ms=near_b, prefer={"a"})) == ["a", "t"]


def test_figures_are_published_read_while_fresh_and_shrug_off_a_bad_key(redis_url, swarm):
    client = redis.Redis.from_url(redis_url)
    try:
        latency.publish(client, swarm, {"a": 12.5, "b": 0.4})
        now = SwarmClock(client).now()
        assert latency.read(client, swarm, now) == {"a": 12.5, "b": 0.4}
        # Published again, the table is replaced whole: a host gone is no longer measured.
        latency.publish(client, swarm, {"b": 0.5})
        assert latency.read(client, swarm, now) == {"b": 0.5}
        assert latency.read(client, swarm, now + latency.FRESH_S + 5) == {}  # too old
        # A field that is not a figure counts as none; the others still count.
        client.hset(latency.latency_key(swarm), "c", "garbage")
        client.hset(latency.latency_key(swarm), "d", json.dumps({"ms": "x", "at": now}))
        assert latency.read(client, swarm, now) == {"b": 0.5}
        # Of another type, the key gives no figures, and reading the inventory still works.
        client.delete(latency.latency_key(swarm))
        client.xadd(latency.latency_key(swarm), {"x": "y"})
        assert latency.read(client, swarm, now) == {}
        assert inventory.read(client, swarm, b"k").latency_ms == {}
    finally:
        client.delete(latency.latency_key(swarm))
        client.close()


def test_a_host_is_measured_by_ping_and_one_that_does_not_answer_is_left_out(redis_url, swarm):
    dead = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    table = latency.measure({"live": redis_url, "dead": dead}, Dialer())
    assert list(table) == ["live"] and 0 < table["live"] < 500
    assert time.monotonic() - started < 5 * latency.TIMEOUT_S


def test_the_inventory_carries_the_figures_and_a_ring_goes_through_the_nearer_replica(
    stages, swarm, ring_settings, redis_url
):
    from specpipe.swarm.redis_ring import RedisRing

    for host, layers in (("a", "0:2"), ("r1", "2:4"), ("r2", "2:4")):
        stages.start(host, layers, redis_url, wait=False)
    stages.wait_ready(["a", "r1", "r2"])
    client = redis.Redis.from_url(redis_url)
    try:
        ring = RedisRing.from_inventory(ring_settings, "toy", 4)
        assert [h.host for h in ring.route] == ["a", "r1"]  # no figures yet: by name
        ring.close()
        # Host 0's figures say r2 is nearer: the ring takes it.
        latency.publish(client, swarm, {"a": 1.0, "r1": 70.0, "r2": 20.0})
        ring = RedisRing.from_inventory(ring_settings, "toy", 4)
        assert [h.host for h in ring.route] == ["a", "r2"]
        ring.close()
        found = inventory.read(client, swarm, ring_settings.swarm_key)
        assert found.latency_ms == {"a": 1.0, "r1": 70.0, "r2": 20.0}
    finally:
        client.close()


def test_refresh_measures_the_nodes_and_specpipe_nodes_shows_the_figures(redis_url, swarm, key):
    from click.testing import CliRunner

    from specpipe.cli import cli

    client = redis.Redis.from_url(redis_url)
    try:
        here = NodeInfo("h0", 0, 2, redis_url)
        inventory.publish(client, swarm, here, key)
        gone = NodeInfo("h1", 2, 4, f"redis://127.0.0.1:{free_port()}/0")
        table = latency.refresh(client, swarm, [here, gone], Dialer())
        assert list(table) == ["h0"]
    finally:
        client.close()
    args = ["nodes", "--redis", redis_url, "--swarm", swarm]
    shown = CliRunner().invoke(cli, [*args, "--json"], env=shared_key_env(key))
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["host0_rtt_ms"] == table
    text = CliRunner().invoke(cli, args, env=shared_key_env(key)).stdout
    assert "from host 0" in text and f"h0: {table['h0']:.2f} ms" in text
