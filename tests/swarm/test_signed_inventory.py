"""The signed inventory: records carry an HMAC under the swarm key, and whatever is unsigned,
forged, malformed or dated in the future is ignored, counted, and never breaks routing."""

import json
import time
from dataclasses import asdict

import pytest
import redis

from specpipe.swarm import inventory
from specpipe.swarm.inventory import NodeInfo, route

KEY = b"0f" * 32


def good(host: str, start: int, end: int, redis_url: str) -> NodeInfo:
    return NodeInfo(host, start, end, redis_url, model="m")


def test_routing_skips_a_record_whose_layers_are_not_numbers():
    now = time.time()
    bad = NodeInfo("bad", "0", 2, "redis://x", last_heartbeat=now)  # a string where an int goes
    ok = [
        NodeInfo("a", 0, 2, "redis://a", last_heartbeat=now),
        NodeInfo("b", 2, 4, "redis://b", last_heartbeat=now),
    ]
    assert [n.host for n in route([bad, *ok], 4, now=now)] == ["a", "b"]
    odd = NodeInfo("odd", 0, 4, "redis://o", last_heartbeat=float("nan"))
    assert [n.host for n in route([odd, *ok], 4, now=now)] == ["a", "b"]


def test_signed_records_load_and_route(swarm, redis_url):
    client = redis.Redis.from_url(redis_url)
    inventory.publish(client, swarm, good("b", 2, 4, redis_url), KEY)
    inventory.publish(client, swarm, good("a", 0, 2, redis_url), KEY)
    found = inventory.read(client, swarm, KEY)
    assert [n.host for n in found.nodes] == ["a", "b"] and found.ignored == 0
    assert [n.host for n in route(inventory.load(client, swarm, KEY), 4)] == ["a", "b"]
    client.close()


def _raw(client, swarm: str, host: str, value: str | bytes) -> None:
    client.set(inventory.node_key(swarm, host), value)


def test_unsigned_forged_malformed_and_future_records_are_ignored_and_counted(swarm, redis_url):
    client = redis.Redis.from_url(redis_url)
    now = time.time()
    inventory.publish(client, swarm, good("a", 0, 2, redis_url), KEY)
    inventory.publish(client, swarm, good("b", 2, 4, redis_url), KEY)
    evil = "redis://attacker.example:6379/0"

    # Unsigned: a plain record, as every record was stored before signing.
    _raw(client, swarm, "u", json.dumps(asdict(good("u", 0, 4, evil)) | {"last_heartbeat": now}))
    # Signed with another key, and signed for another swarm.
    inventory.publish(client, swarm, good("k", 0, 4, evil), b"1" * 64)
    other = redis.Redis.from_url(redis_url)
    inventory.publish(other, swarm + "x", good("s", 0, 4, evil), KEY)
    _raw(client, swarm, "s", client.get(inventory.node_key(swarm + "x", "s")))
    client.delete(inventory.node_key(swarm + "x", "s"))
    other.close()
    # A genuine record with its route altered after signing.
    inventory.publish(client, swarm, good("t", 0, 4, redis_url), KEY)
    signed = client.get(inventory.node_key(swarm, "t")).decode()
    _raw(client, swarm, "t", signed.replace(redis_url, evil))
    # A genuine record copied under another host's name.
    _raw(client, swarm, "a2", client.get(inventory.node_key(swarm, "a")))
    # Malformed: junk, a bad tag, and a signed record with a string where an int goes.
    _raw(client, swarm, "j", "{not json")
    _raw(client, swarm, "j2", "zz " + "{}")
    record = json.dumps(
        asdict(good("m", 0, 4, evil)) | {"layer_start": "0", "last_heartbeat": now},
        sort_keys=True,
        separators=(",", ":"),
    )
    _raw(client, swarm, "m", inventory.sign_record(record, swarm, KEY))
    # Dated in the future: it would win every route as "the freshest" for as long as it likes.
    inventory.publish(client, swarm, good("f", 0, 4, evil), KEY, now=now + 3600)

    found = inventory.read(client, swarm, KEY)
    assert [n.host for n in found.nodes] == ["a", "b"]
    assert found.ignored == 9
    assert all(n.redis_url == redis_url for n in found.nodes)
    assert [n.host for n in route(found.nodes, 4, model="m")] == ["a", "b"]
    client.close()


def test_a_record_with_credentials_is_neither_published_nor_believed(swarm, redis_url):
    client = redis.Redis.from_url(redis_url)
    leaky = good("p", 0, 4, "redis://specpipe:secret@10.0.0.9:6379/0")
    with pytest.raises(ValueError, match="would carry its Redis credentials"):
        inventory.publish(client, swarm, leaky, KEY)
    assert not client.exists(inventory.node_key(swarm, "p"))
    # Signed by a key holder of an older version, which put the password in its record.
    record = json.dumps(
        asdict(leaky) | {"last_heartbeat": time.time()}, sort_keys=True, separators=(",", ":")
    )
    _raw(client, swarm, "p", inventory.sign_record(record, swarm, KEY))
    found = inventory.read(client, swarm, KEY)
    assert (found.nodes, found.ignored) == ([], 1)
    client.close()


def test_a_heartbeat_a_little_ahead_is_the_clock_estimates_error_and_kept(swarm, redis_url):
    client = redis.Redis.from_url(redis_url)
    now = time.time()
    inventory.publish(client, swarm, good("a", 0, 4, redis_url), KEY, now=now + 1.5)
    assert [n.host for n in inventory.load(client, swarm, KEY, now=now)] == ["a"]
    too_far = now + inventory.MAX_AHEAD_S + 0.5
    inventory.publish(client, swarm, good("a", 0, 4, redis_url), KEY, now=too_far)
    assert inventory.read(client, swarm, KEY, now=now).ignored == 1
    client.close()


def test_a_hosts_own_date_only_counts_against_it(swarm, redis_url):
    """On main a record dated ahead (within the 2 s allowed) was that much fresher, and kept
    a host that died alive that much longer; now a record is never fresher than its first
    reading, and one that stopped changing ages on the reader's clock."""
    client = redis.Redis.from_url(redis_url)
    now = time.time()
    inventory.publish(client, swarm, good("a", 0, 4, redis_url), KEY, now=now + 1.9)
    (first,) = inventory.load(client, swarm, KEY, now=now)
    assert first.last_heartbeat == now  # as fresh as it was read, not 1.9 s more
    later = now + 3.0
    (unchanged,) = inventory.load(client, swarm, KEY, now=later)
    assert unchanged.last_heartbeat == now and unchanged.lapsed(later) == (3.0 > first.lapse_s())
    assert later - unchanged.last_heartbeat == pytest.approx(3.0)
    # A new beat is read as new: dated by the host when that is earlier than its reading.
    inventory.publish(client, swarm, good("a", 0, 4, redis_url), KEY, now=later - 0.5)
    (beat,) = inventory.load(client, swarm, KEY, now=later)
    assert beat.last_heartbeat == later - 0.5
    client.close()


def test_a_key_is_required_to_sign_and_to_read(swarm, redis_url):
    client = redis.Redis.from_url(redis_url)
    with pytest.raises(ValueError, match="swarm key"):
        inventory.publish(client, swarm, good("a", 0, 4, redis_url), b"")
    with pytest.raises(ValueError, match="swarm key"):
        inventory.read(client, swarm, None)
    client.close()


def test_the_ring_is_built_from_verified_records_only(swarm, redis_url, key):
    from specpipe.settings import Settings
    from specpipe.swarm.redis_ring import RedisRing

    client = redis.Redis.from_url(redis_url)
    inventory.publish(client, swarm, good("a", 0, 2, redis_url), key)
    inventory.publish(client, swarm, good("b", 2, 4, redis_url), key)
    evil = "redis://attacker.example:6379/0"
    inventory.publish(client, swarm, good("f", 0, 4, evil), key, now=time.time() + 3600)
    inventory.publish(client, swarm, good("k", 0, 4, evil), b"guessed")
    record = json.dumps(
        asdict(good("m", 0, 4, evil)) | {"layer_start": "0", "last_heartbeat": time.time()}
    )
    client.set(inventory.node_key(swarm, "m"), inventory.sign_record(record, swarm, key))
    client.close()
    # No coordinator key pinned: the shared-key mode, opted into out loud.
    settings = Settings.from_env().for_swarm(redis_url, swarm, key, insecure_shared_key=True)
    ring = RedisRing.from_inventory(settings, "m", 4)
    assert [hop.host for hop in ring.route] == ["a", "b"]
    assert all(hop.redis_url == redis_url for hop in ring.route)
    ring.close()
