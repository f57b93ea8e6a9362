"""One admitted host acting against the others: each attack it can make from where it stands
(its own key, the swarm key, its place on a route, its own registry user), against real
stage processes on a real Redis. Every other session ends with exactly the tokens it would
have had, and nothing is lost or stuck."""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading

import pytest
import redis
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from specpipe.core.ring import GapError
from specpipe.ops import roster
from specpipe.settings import COORDINATOR_PUB_FILE
from specpipe.swarm import credentials, failover, identity, inventory, mending, streams, trust, wire
from specpipe.swarm.identity import Signer
from specpipe.swarm.redis_ring import RedisRing
from tests.swarm.conftest import host_keyring
from tests.swarm.test_attacks import Tap
from tests.swarm.test_failover import checked_ring
from tests.swarm.test_redis_ring import PARAMS, drive, reference
from tests.waiting import wait_until

BOUNDS = [(0, 2), (2, 4)]


def forge_reply(swarm, home, settings, passed: wire.Message, **fields) -> bytes:
    """A reply to the round `passed` as stage a signs it, with `fields`."""
    as_a = host_keyring(settings, "a")  # its own keys, and the data keys it holds
    reply = wire.Message(
        session=passed.session,
        round_id=passed.round_id,
        seq=wire.next_seq(0),
        to=streams.reply_key(swarm, passed.session, "a"),
        sender="a",
        wait_ms=5000,
        **fields,
    )
    return wire.encode(reply, swarm, as_a)


# Stage a takes this long over each round before it passes it on, so the reply
# it forges reaches the coordinator before the tail's, while every stage heartbeats on.
LIAR_DELAY = ("--delay-ms", "2500")


def lie_during_a_round(ring, swarm, home, settings, redis_url, committed, read, **lie):
    """Drive one round of `ring` while a, its first stage, answers it with the reply `lie`
    before it passes the round on; the round's outcome (committed ids, or the exception) once
    `read()` says the ring read the lie."""
    reader = host_keyring(settings, "a")
    first = ring.route[0].host
    tap = Tap(redis_url, streams.stage_key(swarm, first))
    outcome: list = []

    def one_round():
        try:
            outcome.append(drive(ring, "s", rounds=1, k=3, committed=list(committed))[0])
        except Exception as exc:
            outcome.append(exc)

    driver = threading.Thread(target=one_round)
    try:
        driver.start()
        wait_until(lambda: tap.seen, 20, "the round to pass through the first stage")
        passed = wire.decode(tap.seen[0], swarm, reader, to=streams.stage_key(swarm, first))
        client = redis.Redis.from_url(redis_url)
        client.xadd(  # into a's own reply stream: the only one its registry user may write
            streams.reply_key(swarm, "s", "a"),
            {streams.FIELD: forge_reply(swarm, home, settings, passed, **lie)},
        )
        client.close()
        wait_until(read, 20, "the lie to be read")
    finally:
        tap.close()
    driver.join(60)
    return outcome[0]


def test_a_stages_word_alone_does_not_move_its_next_hops_traffic(
    identified, swarm, redis_url, monkeypatch, caplog
):
    """On main a stage that answered `unreachable` for a healthy next hop sent that hop's
    rounds, every user's, to a spare at once (one it may run itself). Now the coordinator
    writes to that hop's Redis itself first: it answers, so the claim costs its maker its own
    place too, and with no way around both nothing moves."""
    caplog.set_level(logging.WARNING, logger="specpipe.coordinator")
    monkeypatch.setattr(failover, "FAILOVER_WAIT_S", 1.0)
    stages, settings, home = identified
    stages.start("a", "0:2", redis_url, *LIAR_DELAY, wait=False)
    for host, layers in (("b", "2:4"), ("b2", "2:4")):
        stages.start(host, layers, redis_url, wait=False)
    stages.wait_ready(["a", "b", "b2"])
    ring = checked_ring(settings, "toy", 4)
    assert [hop.host for hop in ring.route] == ["a", "b"]
    ring.reset("s", PARAMS)
    committed, _ = drive(ring, "s", rounds=2, k=3)
    lie = dict(kind="unreachable", reason="cannot pass the round to b: (a lie)")
    read = lambda: "round failed: cannot pass" in caplog.text  # noqa: E731
    got = lie_during_a_round(ring, swarm, home, settings, redis_url, committed, read, **lie)
    assert got == reference([(0, 2), (2, 4)], rounds=3, k=3)[0]
    assert [hop.host for hop in ring.route] == ["a", "b"] and ring.failovers == 0

    # With a spare for a as well, the claim moves both: a is left out with b.
    stages.start("a2", "0:2", redis_url)
    caplog.clear()
    gap = lie_during_a_round(ring, swarm, home, settings, redis_url, got, read, **lie)
    assert isinstance(gap, GapError) and ring.failovers == 1
    assert [hop.host for hop in ring.route] == ["a2", "b2"]
    ring.reset("s", PARAMS)  # the job replays from position 0 on the new route
    assert drive(ring, "s", rounds=4, k=3)[0] == reference([(0, 2), (2, 4)], rounds=4, k=3)[0]
    ring.drop("s")
    ring.close()


def test_only_the_tail_ends_a_round(identified, swarm, redis_url):
    """On main a middle stage could answer the rounds it passed on with a `result` of its own
    (signed as itself, with identities): the coordinator took it as the tail's verdict."""
    stages, settings, home = identified
    stages.start("a", "0:2", redis_url, *LIAR_DELAY)
    stages.start("b", "2:4", redis_url)
    ring = RedisRing.from_inventory(settings, "toy", 4, timeout_s=20)
    ring.reset("s", PARAMS)
    committed, _ = drive(ring, "s", rounds=2, k=3)
    before = ring.dropped_replies
    read = lambda: ring.dropped_replies > before  # noqa: E731
    lie = dict(kind="result", tokens=(7, 7, 7, 7))  # the round's token and its 3 drafts
    got = lie_during_a_round(ring, swarm, home, settings, redis_url, committed, read, **lie)
    assert got == reference([(0, 2), (2, 4)], rounds=3, k=3)[0]
    ring.drop("s")
    ring.close()


def retyped(client: redis.Redis, key: str) -> None:
    """What any stage host's registry user could do on main (`EXPIRE key 0`, then `XADD` under
    its name), and what anything else that writes host 0's Redis still can: the key holds a
    stream where a string belongs."""
    client.expire(key, 0)
    client.xadd(key, {"by": "a hostile host"})


def registry_user(redis_url: str, swarm: str, host: str) -> tuple[str, redis.Redis]:
    """A user on the registry with `host`'s registry rules (`credentials.rules`), and a client
    logged in as it. Named for this test's swarm, not `host-NAME`: other tests' roster syncs on
    the same Redis leave it alone."""
    name, password = f"{swarm}-{host}", secrets.token_hex(16)
    admin = redis.Redis.from_url(redis_url)
    digest = hashlib.sha256(password.encode()).hexdigest()
    admin.execute_command("ACL", "SETUSER", name, *credentials.rules(swarm, host, digest))
    admin.close()
    return name, redis.Redis.from_url(redis_url, username=name, password=password)


def test_a_host_cannot_retype_the_registrys_keys(swarm, redis_url):
    """On main every stage host's registry user could `EXPIRE` and `XADD` the inventory and
    the roster: it turned them into streams. Its own user may write no key but its own record
    (a string, with `SET`) and its own reply streams."""
    name, a = registry_user(redis_url, swarm, "a")
    client = redis.Redis.from_url(redis_url)
    try:
        for host in ("a", "b"):
            client.set(inventory.node_key(swarm, host), f"{host}'s record")
        client.set(identity.roster_key(swarm), "the roster")
        for key in (
            identity.roster_key(swarm),
            inventory.node_key(swarm, "b"),  # another's record
            inventory.node_key(swarm, "a"),  # its own record
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                a.xadd(key, {"by": "a hostile host"})
            with pytest.raises(redis.exceptions.NoPermissionError):
                a.expire(key, 0)
            assert client.type(key) == b"string" and client.ttl(key) == -1
        with pytest.raises(redis.exceptions.NoPermissionError):  # another host's replies
            a.xadd(streams.reply_key(swarm, "s", "b"), {"by": "a hostile host"})
        with pytest.raises(redis.exceptions.NoPermissionError):
            a.set(identity.roster_key(swarm), "forged")
        assert client.get(identity.roster_key(swarm)) == b"the roster"
        assert a.get(inventory.node_key(swarm, "b")) == b"b's record"  # read, as a stage does
        a.xadd(streams.reply_key(swarm, "s", "a"), {"by": "a"})  # its own replies: allowed
        assert client.type(streams.reply_key(swarm, "s", "a")) == b"stream"
    finally:
        a.close()
        client.execute_command("ACL", "DELUSER", name)
        client.close()


def test_registry_keys_of_the_wrong_type_stop_no_job(identified, swarm, redis_url):
    """On main the inventory or the roster turned into a stream failed every heartbeat and
    every read with WRONGTYPE: every new job failed with a RingError, a session whose reply
    key was turned into a string failed at its next round, and `specpipe host admit` could
    not mend the roster because it read it first. No stage host can retype them now (above),
    but whatever else writes host 0's Redis still can."""
    from specpipe.decoding.generation import Generation
    from tests.swarm.test_redis_ring import PROMPT, ReferenceRing

    stages, settings, home = identified
    for host, layers in (("a", "0:2"), ("b", "2:4")):
        stages.start(host, layers, redis_url, wait=False)
    stages.wait_ready(["a", "b"])
    options = dict(max_new_tokens=40, draft_k=3)
    expected = Generation(ReferenceRing(BOUNDS), "l", PROMPT * 2, PARAMS, **options).run()
    client = redis.Redis.from_url(redis_url)
    record, roster_key = inventory.node_key(swarm, "b"), identity.roster_key(swarm)

    # Mid-job: the job goes on, on the addresses and the roster its processes hold.
    ring = checked_ring(settings, "toy", 4)
    run = Generation(ring, "s1", PROMPT * 2, PARAMS, **options)
    for i, _ in enumerate(run.rounds()):
        if i == 2:
            retyped(client, record)
            retyped(client, roster_key)
    ring.close()
    assert run.generated == expected

    # A new job on the damaged registry: the coordinator goes on, with the newest roster it
    # believed.
    wait_until(lambda: client.type(record) == b"string", 20, "b to beat again")
    # A failover mid-job may have mended the roster already (a hop that read b's record while
    # it was retyped cannot pass the round on; the coordinator's new route repairs what it
    # reads): retyped again, so this job starts on a damaged roster whatever the timing.
    retyped(client, roster_key)
    assert client.type(roster_key) == b"stream"
    ring = checked_ring(settings, "toy", 4)
    assert [hop.host for hop in ring.route] == ["a", "b"]

    # A record of the wrong type is not read (no WRONGTYPE: the inventory is read with MGET),
    # and its host's next heartbeat writes it again.
    retyped(client, record)
    keys = trust.keyring(settings)
    assert "b" not in {node.host for node in inventory.read(client, swarm, keys).nodes}
    wait_until(lambda: client.type(record) == b"string", 20, "b to beat again")

    # Its reply key made a hash mid-job: the coordinator deletes what is not of its type and
    # goes on, sending the round again.
    run = Generation(ring, "s2", PROMPT * 2, PARAMS, **options)
    for i, _ in enumerate(run.rounds()):
        if i == 2:
            replies = streams.reply_key(swarm, "s2", "b")  # the tail's
            client.expire(replies, 0)
            client.hset(replies, "by", "a hostile host")
    assert run.generated == expected
    assert ring.ring.dropped_replies >= 1
    ring.close()

    # Host 0's beat puts the roster back from its own copy, and admitting works on a damaged
    # roster too.
    retyped(client, roster_key)
    assert mending.repair(client, swarm, home) == [roster_key]
    pin = identity.pinned((home / COORDINATOR_PUB_FILE).read_text())[0]
    believed, fresh = identity.read_roster(client, swarm, pin)
    assert fresh and {"a", "b"} <= set(believed.hosts)
    retyped(client, roster_key)
    newcomer = Signer("c", identity.Ed25519PrivateKey.generate())
    sealing = identity.public_hex(X25519PrivateKey.generate())
    assert "c" in roster.admit(client, swarm, "c", newcomer.public_hex, sealing, home).hosts
    assert identity.read_roster(client, swarm, pin)[0].hosts.keys() >= {"a", "b", "c"}
    client.close()


def test_a_hosts_own_messages_played_back_change_nothing(identified, swarm, redis_url):
    """Stage a keeps what it signed and sent (its rounds to b, its copies of the coordinator's
    rounds) and plays all of it back later, twice: b refuses every one as a replay, and the
    session ends with the tokens of an undisturbed run."""
    from tests.swarm.test_redis_ring import caught_up, stats, two_heartbeats_later

    stages, settings, home = identified
    stages.start("a", "0:2", redis_url)
    stages.start("b", "2:4", redis_url)
    ring = RedisRing.from_inventory(settings, "toy", 4, timeout_s=20)
    to_b = streams.stage_key(swarm, "b")
    tap = Tap(redis_url, to_b)
    ring.reset("s", PARAMS)
    committed, _ = drive(ring, "s", rounds=2, k=3)
    tap.close()
    client = redis.Redis.from_url(redis_url)
    wait_until(lambda: caught_up(client, swarm, "b"), 10, "b to be idle")
    two_heartbeats_later(redis_url, swarm, trust.keyring(settings), "b")
    before = stats(redis_url, swarm, "b").get("replayed", 0)
    for data in tap.seen * 2:
        streams.send(client, to_b, data)
    played = 2 * len(tap.seen)
    wait_until(
        lambda: stats(redis_url, swarm, "b").get("replayed", 0) >= before + played,
        20,
        f"{played} replays refused",
    )
    got, _ = drive(ring, "s", rounds=2, k=3, committed=committed)
    assert got == reference(BOUNDS, rounds=4, k=3)[0]
    ring.drop("s")
    ring.close()
    client.close()
