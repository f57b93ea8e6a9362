"""One lab host against the others, with everything it holds: its own keys, the swarm key, the
data-plane password, and its own registry user. It tries to retype, overwrite or delete the
registry's keys, fills host 0's Redis through its own reply streams, and once revoked tries to
read the traffic. The other users' jobs give the tokens of the one-process run throughout;
its registry writes are refused, its fill gets it shut out, and after its revocation it reads
nothing."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import redis

from specpipe.settings import COORDINATOR_PUB_FILE, Settings
from specpipe.swarm import credentials, identity, inventory, streams, trust, wire
from specpipe.swarm.clock import SwarmClock
from tests.lab.conftest import run
from tests.lab.test_join import ARGS, PROMPT, admit, join_argv, lab_env, nodes, one_process_tokens
from tests.swarm.test_attacks import Tap
from tests.waiting import wait_until

SWARM = "lab"


def as_host(lab, name: str, monkeypatch) -> tuple[redis.Redis, Settings]:
    """The registry as host `name` reaches it (its own user, its derived password), and the
    settings it holds."""
    monkeypatch.setenv("SPECPIPE_INSECURE_CLEAR_PASSWORDS", "1")  # the lab's plain links
    pin = (lab.home / COORDINATOR_PUB_FILE).read_text().strip()
    registry = lab.env(lab.hosts()[2])["SPECPIPE_REGISTRY_URL"]
    config = replace(Settings.from_env(), home=lab.home).for_swarm(
        registry, SWARM, b"unused", coordinator_public_key=pin
    )
    url = trust.registry_url(config, name, registry)
    return redis.Redis.from_url(url, socket_timeout=10), config


def generated(lab, tiny) -> list[int]:
    result = run("generate", PROMPT, "--model", str(tiny), "--json", *ARGS, env=lab_env(lab))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["tokens"]


@pytest.mark.slow
def test_a_hostile_host_harms_no_other_job_and_reads_nothing_after_its_revocation(
    lab, tiny, monkeypatch
):
    import subprocess

    lab.load()
    bare = lab.hosts()[2]
    admit(lab, bare.name)
    joined = subprocess.Popen(
        join_argv(bare, tiny, "2:4"), env=lab.env(bare), stdout=subprocess.PIPE, text=True
    )
    try:
        wait_until(lambda: any(n.host == "h2" for n in nodes(lab)), 90, "h2 to join")
        want = one_process_tokens(lab, tiny)
        assert generated(lab, tiny) == want
        hostile, config = as_host(lab, "h2", monkeypatch)
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

        # 2. Filling host 0's Redis through its own reply streams: shut out at the next beat.
        chunk = b"z" * (4 * 1024 * 1024)
        try:
            for i in range(20):  # 80 MB, over the 64 MB quota
                hostile.xadd(streams.reply_key(SWARM, f"flood{i}", "h2"), {streams.FIELD: chunk})
        except redis.RedisError:
            pass  # shut out while it wrote
        admin = lab.admin_redis(lab.hosts()[0])
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
            as_host(lab, "h2", monkeypatch)[0].ping()
        assert generated(lab, tiny) == want

        # 3. Revoked: everything it held opens nothing sent after.
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
        admin.close()
    finally:
        if joined.poll() is None:
            joined.terminate()
            joined.wait(20)
