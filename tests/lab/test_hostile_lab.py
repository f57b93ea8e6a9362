"""One lab host against the others, with everything it holds: it joined by invitation, into an
instance folder of its own, so it holds its own keys and what it derives (its registry user,
its users on the other stage hosts' Redis) and nothing of the others'. It tries to retype,
overwrite or delete the registry's keys, dates its record ahead, does on another stage host's
Redis more than a writer may, fills host 0's Redis through its own reply streams, and once
revoked tries to read the traffic and to log in again. The other users' jobs give the tokens
of the one-process run throughout; its writes are refused, its fill gets it shut out, and after
its revocation it reads nothing and logs in nowhere. (What a stage on a route can try with the
messages, `result` or `unreachable` from the middle and its own messages played back, is
`tests/swarm/test_hostile_host.py`'s, against real stage processes.)"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import redis

from specpipe.settings import COORDINATOR_PUB_FILE, Settings
from specpipe.swarm import credentials, identity, inventory, streams, trust, wire
from specpipe.swarm.clock import SwarmClock
from specpipe.swarm.dialing import Dialer, own_peering
from specpipe.swarm.redact import without_credentials
from tests.lab.conftest import run
from tests.lab.test_invite import bare_env, join_argv
from tests.lab.test_join import ARGS, PROMPT, lab_env, nodes, one_process_tokens
from tests.swarm.test_attacks import Tap
from tests.waiting import wait_until

SWARM = "lab"


def as_host(lab, home, monkeypatch) -> tuple[redis.Redis, Settings]:
    """The registry as the host whose instance folder is `home` reaches it (its own user, the
    password it derives), and the settings it holds: its pin, no swarm key."""
    monkeypatch.setenv("SPECPIPE_INSECURE_CLEAR_PASSWORDS", "1")  # the lab's plain links
    pin = (home / "tls" / COORDINATOR_PUB_FILE).read_text().strip()
    registry = lab.env(lab.hosts()[2])["SPECPIPE_REGISTRY_URL"]
    config = replace(Settings.from_env(), home=home, tls_dir=home / "tls").for_swarm(
        registry, SWARM, b"unused", coordinator_public_key=pin
    )
    config = replace(config, swarm_key=None, redis_password=None)
    url = trust.registry_url(config, "h2", registry)
    return redis.Redis.from_url(url, socket_timeout=10), config


def on_stage_host(lab, config: Settings, roster, owner) -> redis.Redis:
    """`owner`'s Redis as host h2 dials it: its own user there, the password the pair derives,
    the server verified against its own copy of the CA."""
    dialer = replace(
        Dialer.configured([], None, str(config.tls_dir / "ca.pem"), own_peering(config, "h2")),
        clear=True,
    )
    address = without_credentials(owner.redis_url)
    dialer.learn(roster, [(owner.name, address)])
    url = dialer.url(address)
    assert f"//h2%40{SWARM}:" in url
    return redis.Redis.from_url(url, socket_timeout=10)


def generated(lab, tiny) -> list[int]:
    result = run("generate", PROMPT, "--model", str(tiny), "--json", *ARGS, env=lab_env(lab))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["tokens"]


@pytest.mark.slow
def test_a_hostile_host_harms_no_other_job_and_reads_nothing_after_its_revocation(
    lab, tiny, monkeypatch, tmp_path
):
    import subprocess

    lab.load()
    bare = lab.hosts()[2]
    invited = run("host", "invite", bare.name, "--layers", "2:4", env=lab_env(lab))
    assert invited.exit_code == 0, invited.output
    home = tmp_path / "h2"
    joined = subprocess.Popen(
        join_argv(bare, tiny, invited.output.strip()),
        env=bare_env(lab, bare, home),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: any(n.host == "h2" for n in nodes(lab)), 90, "h2 to join")
        want = one_process_tokens(lab, tiny)
        assert generated(lab, tiny) == want
        hostile, config = as_host(lab, home, monkeypatch)
        node_key = inventory.node_key(SWARM, "h1")

        # 1. The registry's keys: retyped, overwritten, deleted, expired: all refused.
        for attempt in (
            lambda: hostile.xadd(identity.roster_key(SWARM), {"x": "y"}),
            lambda: hostile.expire(identity.roster_key(SWARM), 0),
            lambda: hostile.set(node_key, "forged"),
            lambda: hostile.delete(inventory.node_key(SWARM, "h0")),
            lambda: hostile.xadd(streams.reply_key(SWARM, "any", "h1"), {"x": "y"}),
            lambda: hostile.xadd(f"specpipe:{SWARM}:nodes", {"x": "y"}),
            lambda: hostile.lpush("celery", "x"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
        # Its own record dated ahead: believed no fresher than its reading.
        ahead = replace(next(n for n in nodes(lab) if n.host == "h2"))
        keys = trust.keyring(config, "h2")
        registry_now = SwarmClock(hostile).now()
        inventory.publish(hostile, SWARM, ahead, keys, now=registry_now + 25)
        assert generated(lab, tiny) == want

        # 2. On another stage host's Redis, as its own user there: only a writer's sends.
        h1 = lab.hosts()[1]
        admin = lab.admin_redis(lab.hosts()[0])
        roster_now, _ = identity.read_roster(admin, SWARM, keys.coordinator)
        peer = on_stage_host(lab, config, roster_now, h1)
        assert peer.ping()
        stage = streams.stage_key(SWARM, "h1")
        for attempt in (
            lambda: peer.xrange(stage),
            lambda: peer.delete(stage),
            lambda: peer.xtrim(stage, maxlen=0),
            lambda: peer.set(streams.stats_key(SWARM, "h1"), "x"),
            lambda: peer.xadd(streams.dead_key(SWARM, "h1"), {"x": "y"}),
            lambda: peer.eval("return 1", 0),
            lambda: peer.execute_command("ACL", "SETUSER", "mine", "on", ">x", "+@all", "~*"),
            lambda: peer.flushall(),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
        assert generated(lab, tiny) == want

        # 3. Filling host 0's Redis through its own reply streams: shut out at the next beat.
        chunk = b"z" * (4 * 1024 * 1024)
        try:
            for i in range(20):  # 80 MB, over the 64 MB quota
                hostile.xadd(streams.reply_key(SWARM, f"flood{i}", "h2"), {streams.FIELD: chunk})
        except redis.RedisError:
            pass  # shut out while it wrote
        # The beat deletes the user first, then the streams: wait for both.
        wait_until(
            lambda: (
                f"h2@{SWARM}".encode() not in admin.execute_command("ACL", "USERS")
                and not list(admin.scan_iter(match=streams.reply_key(SWARM, "flood*", "h2")))
            ),
            30,
            "the beat to shut h2 out and delete its streams",
        )
        assert admin.hget(credentials.shut_out_key(SWARM), "h2") is not None
        with pytest.raises(redis.RedisError):
            as_host(lab, home, monkeypatch)[0].ping()
        assert generated(lab, tiny) == want

        # 4. Revoked: everything it held opens nothing sent after, and logs in nowhere.
        held = trust.keyring(config, "h2")
        roster_before, _ = identity.read_roster(admin, SWARM, held.coordinator)
        held = held.with_roster(roster_before)
        revoked = run("host", "revoke", "h2", env=lab_env(lab))
        assert revoked.exit_code == 0, revoked.output
        tap = Tap(lab.hosts()[0].redis_url, streams.stage_key(SWARM, "h0"))
        try:
            assert generated(lab, tiny) == want
            time.sleep(0.5)
        finally:
            tap.close()
        assert tap.seen
        for data in tap.seen:
            with pytest.raises(wire.WireError):
                wire.decode(data, SWARM, held, to=streams.stage_key(SWARM, "h0"))
        with pytest.raises(redis.RedisError):  # its open connection closed at h1's next beat
            wait_until(lambda: not peer.ping(), 10, "h1 to delete h2's user")
        with pytest.raises(redis.exceptions.AuthenticationError):
            on_stage_host(lab, config, roster_before, h1).ping()
        peer.close()
        admin.close()
    finally:
        if joined.poll() is None:
            joined.terminate()
            joined.wait(20)
