"""A registry whose roster was retyped: mended by whichever process on host 0 reads it first, and
waited for by every other reader while the stages beat back in (real Redis)."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from specpipe import settings
from specpipe.ops import roster
from specpipe.settings import COORDINATOR_PUB_FILE
from specpipe.swarm import identity, inventory, mending, wire
from specpipe.swarm.identity import Signer
from specpipe.swarm.inventory import NodeInfo, RouteError


def retype(client: redis.Redis, key: str) -> None:
    """What a stage host's registry user could do on main, and anything else that writes host
    0's Redis still can: expire the key and write a stream there."""
    client.expire(key, 0)
    client.xadd(key, {"by": "a hostile host"})


def route_of(found: inventory.Inventory) -> list[NodeInfo]:
    return inventory.route(found.nodes, 4, now=found.now)


def beat_later(client: redis.Redis, swarm: str, key, redis_url: str, after_s: float):
    """Both stages beating back in after `after_s`, as they would into an emptied inventory,
    signing with `key` (or each with its own, `key` a dict by host)."""

    def beat() -> None:
        time.sleep(after_s)
        for host, start, end in (("a", 0, 2), ("b", 2, 4)):
            signer = key[host] if isinstance(key, dict) else key
            inventory.publish(client, swarm, NodeInfo(host, start, end, redis_url), signer)

    thread = threading.Thread(target=beat)
    thread.start()
    return thread


def test_a_reader_waits_for_the_stages_after_another_process_mended(swarm, redis_url, key):
    """On main only the process that deleted the retyped key waited for the stages; the CLI
    mended, a coordinator then found half the stages beaten back in and failed the job."""
    client = redis.Redis.from_url(redis_url)
    roster_key = identity.roster_key(swarm)
    retype(client, roster_key)
    assert mending.repair(client, swarm) == [roster_key]  # another process's mending
    assert client.pttl(mending.mended_key(swarm)) > 0
    thread = beat_later(client, swarm, key, redis_url, after_s=1.0)
    found, route = mending.read_mended(client, swarm, key, route_of)
    thread.join()
    assert [n.host for n in route] == ["a", "b"]
    assert {n.host for n in found.nodes} == {"a", "b"}
    client.close()


def test_the_reader_that_finds_the_key_retyped_mends_it_and_waits(swarm, redis_url, key, tmp_path):
    """A reader on host 0 (its folder holds the coordinator key and the roster's copy) that
    finds the roster retyped publishes it again, and waits for the stages."""
    client = redis.Redis.from_url(redis_url)
    home = tmp_path / "instance"
    roster.admit_own_hosts(client, swarm, ["a", "b"], home)
    own = {h: Signer(h, identity.load_private(settings.host_key_path(h, home))) for h in "ab"}
    pin = identity.pinned((home / COORDINATOR_PUB_FILE).read_text())[0]
    reader = wire.Keyring([key], coordinator=pin)
    retype(client, identity.roster_key(swarm))
    signers = {h: wire.Keyring([key], signer=own[h]) for h in own}
    thread = beat_later(client, swarm, signers, redis_url, after_s=1.0)
    _, route = mending.read_mended(client, swarm, reader, route_of, home)
    thread.join()
    assert [n.host for n in route] == ["a", "b"]
    assert client.type(identity.roster_key(swarm)) == b"string"
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
