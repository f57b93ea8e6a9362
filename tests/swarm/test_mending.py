"""A registry a host retyped: mended by whichever process on host 0 reads it first, and waited
for by every other reader while the stages beat back in (real Redis)."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from specpipe.swarm import inventory, mending
from specpipe.swarm.inventory import NodeInfo, RouteError


def retype(client: redis.Redis, key: str) -> None:
    """What a stage host's registry user can do: expire the key and write a stream there."""
    client.expire(key, 0)
    client.xadd(key, {"by": "a hostile host"})


def route_of(found: inventory.Inventory) -> list[NodeInfo]:
    return inventory.route(found.nodes, 4, now=found.now)


def beat_later(client: redis.Redis, swarm: str, key: bytes, redis_url: str, after_s: float):
    """Both stages beating back in after `after_s`, as they would into an emptied inventory."""

    def beat() -> None:
        time.sleep(after_s)
        for host, start, end in (("a", 0, 2), ("b", 2, 4)):
            inventory.publish(client, swarm, NodeInfo(host, start, end, redis_url), key)

    thread = threading.Thread(target=beat)
    thread.start()
    return thread


def test_a_reader_waits_for_the_stages_after_another_process_mended(swarm, redis_url, key):
    """On main only the process that deleted the retyped key waited for the stages; the CLI
    mended, a coordinator then found half the stages beaten back in and failed the job."""
    client = redis.Redis.from_url(redis_url)
    nodes = inventory.nodes_key(swarm)
    retype(client, nodes)
    assert mending.repair(client, swarm) == [nodes]  # another process's mending
    assert client.pttl(mending.mended_key(swarm)) > 0
    thread = beat_later(client, swarm, key, redis_url, after_s=1.0)
    found, route = mending.read_mended(client, swarm, key, route_of)
    thread.join()
    assert [n.host for n in route] == ["a", "b"]
    assert {n.host for n in found.nodes} == {"a", "b"}
    client.close()


def test_the_reader_that_finds_the_key_retyped_mends_it_and_waits(swarm, redis_url, key):
    client = redis.Redis.from_url(redis_url)
    retype(client, inventory.nodes_key(swarm))
    thread = beat_later(client, swarm, key, redis_url, after_s=1.0)
    _, route = mending.read_mended(client, swarm, key, route_of)
    thread.join()
    assert [n.host for n in route] == ["a", "b"]
    assert client.type(inventory.nodes_key(swarm)) == b"hash"
    client.close()


def test_uncovered_layers_with_no_mending_are_an_error_at_once(swarm, redis_url, key):
    client = redis.Redis.from_url(redis_url)
    inventory.publish(client, swarm, NodeInfo("a", 0, 2, redis_url), key)
    started = time.monotonic()
    with pytest.raises(RouteError, match="layers 2:4"):
        mending.read_mended(client, swarm, key, route_of)
    assert time.monotonic() - started < mending.MEND_PAUSE_S
    client.close()


def test_the_wait_after_a_mending_is_bounded(swarm, redis_url, key, monkeypatch):
    monkeypatch.setattr(mending, "MEND_WAIT_S", 0.6)
    client = redis.Redis.from_url(redis_url)
    client.set(mending.mended_key(swarm), "nodes")  # a mark that never expires: still bounded
    inventory.publish(client, swarm, NodeInfo("a", 0, 2, redis_url), key)
    started = time.monotonic()
    with pytest.raises(RouteError, match="layers 2:4"):
        mending.read_mended(client, swarm, key, route_of)
    assert 0.5 < time.monotonic() - started < 3.0
    client.close()


def test_a_key_of_the_right_type_is_left_alone(swarm, redis_url, key):
    client = redis.Redis.from_url(redis_url)
    inventory.publish(client, swarm, NodeInfo("a", 0, 2, redis_url), key)
    assert mending.repair(client, swarm) == []
    assert not client.exists(mending.mended_key(swarm))
    assert [n.host for n in inventory.load(client, swarm, key)] == ["a"]
    client.close()
