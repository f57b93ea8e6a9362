"""A key per host: every holder of the swarm key can seal a message, but none can speak as the
coordinator or as another host, write another host's record, or stay in the swarm once revoked.

Each forgery is tried as the holder of one stage host's key and the swarm key would try it; on
the shared swarm key alone (before host identities) every one of them went through.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace

import pytest
import redis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from specpipe.ops import roster
from specpipe.swarm import identity, inventory, streams, trust, wire
from specpipe.swarm.identity import COORDINATOR, Roster, Signer
from specpipe.swarm.inventory import NodeInfo
from specpipe.swarm.redis_ring import ROSTER_EVERY_S, RedisRing
from tests.swarm.conftest import host_keyring
from tests.swarm.test_redis_ring import PARAMS, drive, reference
from tests.waiting import wait_until

SWARM = "idswarm"
KEY = b"k" * 32


def signer(name: str) -> Signer:
    return Signer(name, Ed25519PrivateKey.generate())


@pytest.fixture
def hosts():
    """The coordinator and two admitted hosts, a and b, and a roster naming a and b."""
    found = {name: signer(name) for name in (COORDINATOR, "a", "b")}
    admitted = Roster(SWARM, 1, {h: found[h].public_hex for h in ("a", "b")})
    return found, admitted


def keyring_of(found, admitted, name: str | None) -> wire.Keyring:
    """What host `name` (or the coordinator) seals, signs and believes with."""
    pin = found[COORDINATOR].key.public_key()
    me = found[name] if name else None
    return wire.Keyring([KEY], signer=me, coordinator=pin, roster=admitted)


def round_for(to_host: str, sender: str, hop: int = 0) -> wire.Message:
    route = (wire.RouteEntry("a", 0, 2, "toy"), wire.RouteEntry("b", 2, 4, "toy"))
    return wire.Message(
        kind="round",
        session="s",
        seq=wire.next_seq(0),
        to=streams.stage_key(SWARM, to_host),
        sender=sender,
        tokens=(1, 2, 3),
        route=route,
        hop=hop,
        wait_ms=1000,
    )


def test_the_roster_is_believed_only_as_the_coordinator_signed_it(hosts):
    found, admitted = hosts
    pin = found[COORDINATOR].key.public_key()
    stored = admitted.signed(found[COORDINATOR])
    assert Roster.verified(stored, SWARM, pin) == admitted
    forged = admitted.admitting("evil", found["a"].public_hex).signed(found["a"])
    with pytest.raises(identity.IdentityError, match="not signed by this swarm's coordinator"):
        Roster.verified(forged, SWARM, pin)
    tampered = stored.replace('"version":1', '"version":9')
    with pytest.raises(identity.IdentityError):
        Roster.verified(tampered, SWARM, pin)
    with pytest.raises(identity.IdentityError, match="a roster of swarm"):
        Roster.verified(stored, "other", pin)
    with pytest.raises(identity.IdentityError, match="coordinator's name"):
        admitted.admitting(COORDINATOR, found["a"].public_hex)


def test_an_older_roster_played_back_is_not_believed(hosts, redis_url):
    found, admitted = hosts
    swarm = f"r{time.time_ns()}"
    coordinator = found[COORDINATOR]
    pin = coordinator.key.public_key()
    client = redis.Redis.from_url(redis_url)
    try:
        first = Roster(swarm, 1, dict(admitted.hosts))
        identity.publish_roster(client, first, coordinator)
        assert identity.read_roster(client, swarm, pin) == (first, True)
        second = first.revoking("b")
        identity.publish_roster(client, second, coordinator)
        assert identity.read_roster(client, swarm, pin) == (second, True)
        identity.publish_roster(client, first, coordinator)  # b back, by an old roster
        roster_now, believed = identity.read_roster(client, swarm, pin)
        assert roster_now == second and not believed and roster_now.key_of("b") is None
        client.delete(identity.roster_key(swarm))  # gone: the newest seen still holds
        assert identity.read_roster(client, swarm, pin) == (second, False)
    finally:
        client.delete(identity.roster_key(swarm))
        client.close()


def test_a_host_cannot_speak_as_the_coordinator_or_as_another_host(hosts):
    found, admitted = hosts
    to_b = streams.stage_key(SWARM, "b")
    # What the coordinator and a signed: believed.
    reset = replace(round_for("b", COORDINATOR), kind="reset", route=())
    sealed = wire.encode(reset, SWARM, keyring_of(found, admitted, COORDINATOR))
    assert (
        wire.decode(sealed, SWARM, keyring_of(found, admitted, "b"), to=to_b).sender == COORDINATOR
    )
    passed = round_for("b", "a", hop=1)
    sealed = wire.encode(passed, SWARM, keyring_of(found, admitted, "a"))
    assert wire.decode(sealed, SWARM, keyring_of(found, admitted, "b"), to=to_b).sender == "a"

    # Host a's keyring signs only as a.
    with pytest.raises(wire.WireError, match="cannot sign as"):
        wire.encode(reset, SWARM, keyring_of(found, admitted, "a"))
    # Host a's own key under the coordinator's name, or under b's: refused by b.
    for forged, sender in ((reset, COORDINATOR), (round_for("b", "b"), "b")):
        liar = wire.Keyring([KEY], signer=Signer(sender, found["a"].key))
        data = wire.encode(replace(forged, sender=sender), SWARM, liar)
        with pytest.raises(wire.WireError, match=f"not signed by {sender!r}'s own key"):
            wire.decode(data, SWARM, keyring_of(found, admitted, "b"), to=to_b)
    # Sealed with the swarm key and no signature (as before host identities): refused.
    data = wire.encode(reset, SWARM, KEY)
    with pytest.raises(wire.WireError, match="not signed by 'coordinator'"):
        wire.decode(data, SWARM, keyring_of(found, admitted, "b"), to=to_b)
    # A host the roster does not admit.
    outsider = signer("c")
    data = wire.encode(round_for("b", "c", hop=1), SWARM, wire.Keyring([KEY], signer=outsider))
    with pytest.raises(wire.UnknownSenderError, match="does not admit"):
        wire.decode(data, SWARM, keyring_of(found, admitted, "b"), to=to_b)
    # A keyring without identities (every swarm key holder alike) still reads what is signed.
    sealed = wire.encode(passed, SWARM, keyring_of(found, admitted, "a"))
    assert wire.decode(sealed, SWARM, KEY, to=to_b).tokens == (1, 2, 3)


def test_a_host_cannot_write_another_hosts_record_and_a_revoked_one_is_ignored(hosts, redis_url):
    found, admitted = hosts
    swarm = f"i{time.time_ns()}"
    coordinator = found[COORDINATOR]
    admitted = Roster(swarm, 1, dict(admitted.hosts))
    reader = wire.Keyring([KEY], coordinator=coordinator.key.public_key())
    client = redis.Redis.from_url(redis_url)
    try:
        identity.publish_roster(client, admitted, coordinator)
        for name in ("a", "b"):
            node = NodeInfo(host=name, layer_start=0, layer_end=4, redis_url=redis_url)
            inventory.publish(client, swarm, node, wire.Keyring([KEY], signer=found[name]))
        found_now = inventory.read(client, swarm, reader)
        assert [n.host for n in found_now.nodes] == ["a", "b"] and found_now.ignored == 0
        # a writes b's record (a spare claiming b's layers) with its own key, then with the
        # swarm key: neither is believed.
        forged = NodeInfo(host="b", layer_start=0, layer_end=4, redis_url="redis://evil:1/0")
        inventory.publish(
            client, swarm, forged, wire.Keyring([KEY], signer=Signer("b", found["a"].key))
        )
        assert [n.host for n in inventory.read(client, swarm, reader).nodes] == ["a"]
        inventory.publish(client, swarm, forged, KEY)
        assert inventory.read(client, swarm, reader).ignored == 1
        # A record from a host never admitted.
        outsider = NodeInfo(host="c", layer_start=0, layer_end=4, redis_url=redis_url)
        inventory.publish(client, swarm, outsider, wire.Keyring([KEY], signer=signer("c")))
        assert inventory.read(client, swarm, reader).ignored == 2
        # Revoking a: its record is ignored from the next read, and no route has it.
        identity.publish_roster(client, admitted.revoking("a"), coordinator)
        found_now = inventory.read(client, swarm, reader)
        assert found_now.nodes == [] and found_now.ignored == 3
        with pytest.raises(inventory.RouteError):
            inventory.route(found_now.nodes, 4)
    finally:
        records = (inventory.node_key(swarm, host) for host in ("a", "b", "c"))
        client.delete(*records, identity.roster_key(swarm))
        client.close()


def test_on_stage_processes_a_revoked_host_drops_out_of_routing_and_a_forged_control_is_dropped(
    identified, swarm, redis_url
):
    stages, settings, home = identified
    stages.start("a", "0:2", redis_url)
    stages.start("b", "2:4", redis_url)
    ring = RedisRing.from_inventory(settings, "toy", 4, timeout_s=20)
    assert [hop.host for hop in ring.route] == ["a", "b"]
    ring.reset("s1", PARAMS)
    committed, _ = drive(ring, "s1", rounds=6, k=3)
    assert committed == reference([(0, 2), (2, 4)], rounds=6, k=3)[0]

    # Stage a's keys (the data key it opens and its own key) try to drop the session as the
    # coordinator on b: b drops the message, and the session goes on untouched.
    liar = copy.copy(host_keyring(settings, "a"))  # what a can make of its own code
    liar.signer = Signer(COORDINATOR, liar.signer.key)
    to_b = streams.stage_key(swarm, "b")
    drop = wire.Message(
        kind="drop", session="s1", seq=wire.next_seq(0), to=to_b, sender=COORDINATOR, wait_ms=1000
    )
    client = redis.Redis.from_url(redis_url)
    before = streams.read_stats(client, swarm, "b").get("dropped", 0)
    streams.send(client, to_b, wire.encode(drop, swarm, liar))
    wait_until(
        lambda: streams.read_stats(client, swarm, "b").get("dropped", 0) > before,
        20,
        "b to drop the forged control",
    )
    more, _ = drive(ring, "s1", rounds=2, k=3, committed=list(committed))
    assert more == reference([(0, 2), (2, 4)], rounds=8, k=3)[0]
    ring.drop("s1")
    ring.close()

    # A spare for b's layers, then b revoked: within a heartbeat no read of the inventory
    # has b, and the next ring routes through the spare with the same tokens.
    stages.start("b2", "2:4", redis_url)
    roster.revoke(client, swarm, "b", home)
    started = time.monotonic()
    wait_until(
        lambda: "b" not in {n.host for n in inventory.load(client, swarm, trust.keyring(settings))},
        5,
        "b to drop out of the inventory",
    )
    assert time.monotonic() - started < 1.0  # read at once: the roster goes with the records
    ring = RedisRing.from_inventory(settings, "toy", 4, timeout_s=20)
    assert [hop.host for hop in ring.route] == ["a", "b2"]
    ring.reset("s2", PARAMS)
    assert drive(ring, "s2", rounds=6, k=3)[0] == reference([(0, 2), (2, 4)], rounds=6, k=3)[0]
    ring.drop("s2")
    ring.close()
    client.close()


def test_a_tail_revoked_mid_job_is_gone_around_with_the_same_tokens(identified, swarm, redis_url):
    from specpipe.decoding.generation import Generation
    from tests.swarm.test_failover import FAILOVER_BOUND_S, checked_ring
    from tests.swarm.test_redis_ring import PROMPT, ReferenceRing

    stages, settings, home = identified
    for host, layers in (("a", "0:2"), ("b", "2:4"), ("b2", "2:4")):
        stages.start(host, layers, redis_url, wait=False)
    stages.wait_ready(["a", "b", "b2"])
    options = dict(max_new_tokens=40, draft_k=3)
    expected = Generation(ReferenceRing([(0, 2), (2, 4)]), "l", PROMPT * 2, PARAMS, **options).run()
    ring = checked_ring(settings, "toy", 4)
    tail = ring.route[-1].host
    client = redis.Redis.from_url(redis_url)
    run = Generation(ring, "s", PROMPT * 2, PARAMS, **options)
    stall_s, revoked_at = 0.0, None
    for i, _ in enumerate(run.rounds()):
        if revoked_at is not None and not stall_s:
            stall_s = time.monotonic() - revoked_at
        if i == 2:
            roster.revoke(client, swarm, tail, home)  # the process runs on, its key no good
            revoked_at = time.monotonic()
            time.sleep(ROSTER_EVERY_S)  # a heartbeat passes: from then on b is not believed
    ring.close()
    client.close()
    assert run.generated == expected
    assert tail not in [hop.host for hop in ring.route] and ring.failovers == 1
    assert 0 < stall_s < FAILOVER_BOUND_S, stall_s
    hosts = " -> ".join(hop.host for hop in ring.route)
    print(f"revoked {tail}: the next round {stall_s:.2f} s after the revocation, via {hosts}")
