"""Each stage host's own user on host 0's registry (`specpipe.swarm.credentials`): made from the
roster with a password no other host holds, able to write only its own record and reply
streams, gone the moment the host is revoked, and shut out when its keys outgrow its quota.
Against a real, locked-down redis-server, with the roster and keys as `host admit` makes them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import redis

from specpipe.ops import roster
from specpipe.ops.redis_server import KEEPER_USER, USER, RedisServer
from specpipe.settings import COORDINATOR_PUB_FILE, KEEPER_PASSWORD_FILE, Settings
from specpipe.swarm import credentials, identity, inventory, streams, trust
from specpipe.swarm.inventory import NodeInfo

SWARM = "users"
HOSTS = ("a", "b")


@pytest.fixture
def registry(tmp_path):
    """Host 0's registry (its own user's URL), hosts a and b admitted by a coordinator whose
    folder is `tmp_path`, and the settings each host's processes would have."""
    (tmp_path / KEEPER_PASSWORD_FILE).write_text("keeper-password\n")
    with RedisServer(password="own-password", keeper_password="keeper-password") as server:
        # As host 0's keeper (what `host admit` and beat log in as): it may also list users.
        client = redis.Redis.from_url(as_keeper(server.url))
        roster.admit_own_hosts(client, SWARM, HOSTS, tmp_path)
        pin = (tmp_path / COORDINATOR_PUB_FILE).read_text().strip()
        config = replace(
            Settings.from_env(), home=tmp_path, tls_dir=None, redis_password=None
        ).for_swarm(server.url, SWARM, b"k" * 32, coordinator_public_key=pin)
        yield server, client, config
        client.close()


def as_keeper(url: str) -> str:
    return url.replace(f"{USER}:own-password@", f"{KEEPER_USER}:keeper-password@")


def test_only_the_keeper_makes_users_not_the_user_every_process_of_host_0_holds(registry):
    server, _, _ = registry
    own = redis.Redis.from_url(server.url)
    with pytest.raises(redis.exceptions.NoPermissionError):
        own.execute_command("ACL", "SETUSER", f"x@{SWARM}", "on", ">x", "+@all", "~*")
    own.close()


def bare(url: str) -> str:
    """The registry's address as a stage host is given it: no user, no password."""
    return "redis://" + url.split("@", 1)[1]


def as_host(server: RedisServer, config: Settings, host: str) -> redis.Redis:
    """A client of the registry as stage host `host` dials it (`trust.registry_url`)."""
    url = trust.registry_url(config, host, bare(server.url))
    assert url.startswith(f"redis://{host}%40{SWARM}:")
    return redis.Redis.from_url(url, socket_timeout=5)


def node(host: str) -> NodeInfo:
    return NodeInfo(host=host, layer_start=0, layer_end=2, redis_url="redis://10.0.0.1:6379/0")


def test_the_pin_carries_the_coordinators_sealing_key_and_each_host_derives_its_own_password(
    registry,
):
    server, _, config = registry
    signing, sealing = identity.pinned(config.coordinator_public_key)
    assert signing is not None and sealing is not None
    urls = {h: trust.registry_url(config, h, bare(server.url)) for h in HOSTS}
    assert urls["a"] != urls["b"]  # no password common to two hosts
    password_a = urls["a"].split(":")[2].split("@")[0]
    with pytest.raises(redis.AuthenticationError):  # a's password does not open b's user
        redis.Redis.from_url(bare(server.url), username=f"b@{SWARM}", password=password_a).ping()
    # An address that names a user (host 0's own processes) is dialled as it is.
    assert trust.registry_url(config, "a", server.url) == server.url


def test_a_host_writes_its_own_record_and_replies_and_nothing_else(registry):
    server, client, config = registry
    a = as_host(server, config, "a")
    inventory.publish(a, SWARM, node("a"), trust.keyring(config, "a"))
    inventory.publish(client, SWARM, node("b"), trust.keyring(config, "b"))  # as b would
    found = inventory.read(a, SWARM, trust.keyring(config))  # by the roster's names: no SCAN
    assert [n.host for n in found.nodes] == ["a", "b"] and found.ignored == 0
    own_reply = streams.reply_key(SWARM, "s1", "a")
    a.xadd(own_reply, {streams.FIELD: b"x"})
    a.expire(own_reply, 60)
    before = client.get(inventory.node_key(SWARM, "b"))
    refused = [
        lambda: a.set(inventory.node_key(SWARM, "b"), "forged"),  # another's record
        lambda: a.delete(inventory.node_key(SWARM, "b")),
        lambda: a.expire(inventory.node_key(SWARM, "b"), 0),
        lambda: a.xadd(inventory.node_key(SWARM, "a"), {"f": "v"}),  # its own, retyped
        lambda: a.xadd(streams.reply_key(SWARM, "s1", "b"), {"f": "v"}),  # another's replies
        lambda: a.expire(streams.reply_key(SWARM, "s1", "b"), 0),
        lambda: a.set(identity.roster_key(SWARM), "x"),  # the roster
        lambda: a.expire(identity.roster_key(SWARM), 0),
        lambda: a.xadd(f"specpipe:{SWARM}:fresh", {"f": "v"}),  # any other key
        lambda: a.lpush("celery", "job"),  # the broker
        lambda: a.keys("*"),
        lambda: a.eval("return 1", 0),
    ]
    for attempt in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    assert client.get(inventory.node_key(SWARM, "b")) == before
    assert client.type(inventory.node_key(SWARM, "a")) == b"string"
    inventory.remove(a, SWARM, "a")  # a clean shutdown takes its own record out
    assert client.exists(inventory.node_key(SWARM, "a")) == 0
    a.close()


def test_revoking_a_host_deletes_its_user_and_closes_its_connections(registry, tmp_path):
    server, client, config = registry
    a, b = as_host(server, config, "a"), as_host(server, config, "b")
    assert a.ping() and b.ping()
    roster.revoke(client, SWARM, "a", tmp_path)
    with pytest.raises(redis.RedisError):  # its open connection is closed at once...
        a.get(identity.roster_key(SWARM))
    with pytest.raises(redis.AuthenticationError):  # ...and it cannot log in again
        as_host(server, config, "a").ping()
    assert b.get(identity.roster_key(SWARM))  # the others are untouched
    users = {u.decode() for u in client.execute_command("ACL", "USERS")}
    assert f"a@{SWARM}" not in users and f"b@{SWARM}" in users
    b.close()


def test_the_beat_makes_the_users_again_after_the_registry_lost_them(registry, tmp_path):
    server, client, config = registry
    for host in HOSTS:  # as after a restart: the config file has no host users
        client.execute_command("ACL", "DELUSER", credentials.user(SWARM, host))
    client.execute_command("ACL", "SETUSER", f"stranger@{SWARM}", "on", ">x", "+@all", "~*")
    client.execute_command("ACL", "SETUSER", "a@another", "on", ">x")  # another swarm's
    assert roster.keep_users(client, SWARM, tmp_path) == []
    users = {u.decode() for u in client.execute_command("ACL", "USERS")}
    assert {f"a@{SWARM}", f"b@{SWARM}", "a@another"} <= users
    assert f"stranger@{SWARM}" not in users
    assert as_host(server, config, "a").ping()


def test_a_host_over_its_quota_is_shut_out_and_the_others_serve_on(registry, tmp_path):
    server, client, config = registry
    a, b = as_host(server, config, "a"), as_host(server, config, "b")
    chunk = b"z" * (256 * 1024)
    for i in range(12):  # 3 MB in fresh reply streams of its own
        a.xadd(streams.reply_key(SWARM, f"flood{i}", "a"), {streams.FIELD: chunk})
    b.xadd(streams.reply_key(SWARM, "job", "b"), {streams.FIELD: b"reply"})
    quota = 2 * 1024 * 1024
    assert roster.keep_users(client, SWARM, tmp_path, quota) == ["a"]
    assert list(client.scan_iter(match=streams.reply_key(SWARM, "*", "a"))) == []
    with pytest.raises(redis.RedisError):
        a.xadd(streams.reply_key(SWARM, "more", "a"), {streams.FIELD: chunk})
    with pytest.raises(redis.AuthenticationError):
        as_host(server, config, "a").ping()
    assert client.xlen(streams.reply_key(SWARM, "job", "b")) == 1  # b's replies are kept
    b.xadd(streams.reply_key(SWARM, "job", "b"), {streams.FIELD: b"next"})
    # Within its quota, the next beat leaves b be; a stays shut out until its time is up.
    assert roster.keep_users(client, SWARM, tmp_path, quota) == []
    with pytest.raises(redis.AuthenticationError):
        as_host(server, config, "a").ping()
    client.hset(credentials.shut_out_key(SWARM), "a", 0)  # its time is up
    roster.keep_users(client, SWARM, tmp_path, quota)
    assert as_host(server, config, "a").ping()
    b.close()


def test_no_password_travels_in_clear_to_another_machine(registry, monkeypatch):
    _, _, config = registry
    monkeypatch.delenv("SPECPIPE_INSECURE_CLEAR_PASSWORDS", raising=False)
    elsewhere = "redis://203.0.113.10:6379/0"
    assert trust.registry_url(config, "a", elsewhere) == elsewhere  # no user, no password
    assert f"a%40{SWARM}:" in trust.registry_url(config, "a", "rediss://203.0.113.10:6379/0")
    monkeypatch.setenv("SPECPIPE_INSECURE_CLEAR_PASSWORDS", "1")  # said out loud
    assert f"a%40{SWARM}:" in trust.registry_url(config, "a", elsewhere)


def test_a_name_that_cannot_go_into_a_key_pattern_gets_no_user():
    for name in ("a*", "a b", "a@b", "[a]", ""):
        with pytest.raises(credentials.CredentialError):
            credentials.rules("s", name, "0" * 64)
