"""Each host's own user on every other stage host's Redis (`specpipe.swarm.peering`): made by
the owner's keeper from the roster, with a password only that pair derives, allowed to append
to the stage streams and nothing else, gone (connections and all) once the host is revoked.
Against real, locked-down redis-servers: host 0's registry holding the roster, and stage host
b's own Redis."""

from __future__ import annotations

from dataclasses import replace

import pytest
import redis

from specpipe.cli.worker import keeper_url
from specpipe.ops import roster
from specpipe.ops.redis_server import KEEPER_USER, USER, RedisServer
from specpipe.settings import COORDINATOR_PUB_FILE, KEEPER_PASSWORD_FILE, Settings
from specpipe.swarm import identity, peering, streams
from specpipe.swarm.dialing import Dialer, own_peering
from specpipe.swarm.redact import without_credentials

SWARM = "peers"
HOSTS = ("a", "b", "c")


@pytest.fixture
def swarm(tmp_path):
    """The registry with a, b and c admitted (their keys in `tmp_path`, as `specpipe up`
    keeps them), b's own Redis as its keeper, and the settings of the swarm's processes."""
    (tmp_path / KEEPER_PASSWORD_FILE).write_text("keeper-password\n")
    with (
        RedisServer(password="own", keeper_password="keeper-password") as registry,
        RedisServer(password="b-own", keeper_password="b-keeper") as b_redis,
    ):
        keeper = redis.Redis.from_url(registry.url.replace(f"{USER}:own@", as_keeper()))
        roster.admit_own_hosts(keeper, SWARM, HOSTS, tmp_path)
        pin = (tmp_path / COORDINATOR_PUB_FILE).read_text().strip()
        config = replace(Settings.from_env(), home=tmp_path, redis_password=None).for_swarm(
            registry.url, SWARM, b"k" * 32, coordinator_public_key=pin
        )
        b_keeper = redis.Redis.from_url(
            b_redis.url.replace(f"{USER}:b-own@", f"{KEEPER_USER}:b-keeper@")
        )
        yield config, keeper, b_redis, b_keeper
        keeper.close()
        b_keeper.close()


def as_keeper() -> str:
    return f"{KEEPER_USER}:keeper-password@"


def current_roster(config: Settings, client: redis.Redis) -> identity.Roster:
    signing, _ = identity.pinned(config.coordinator_public_key)
    found, believed = identity.read_roster(client, SWARM, signing)
    assert believed
    return found


def dialer_of(config: Settings, name: str, found: identity.Roster, owner: str, address: str):
    dialer = Dialer.configured([], None, peering=own_peering(config, name))
    dialer.learn(found, [(owner, address)])
    return dialer


def test_the_owner_makes_a_user_for_each_writer_and_each_pair_has_its_own_password(swarm):
    config, registry, b_redis, b_keeper = swarm
    found = current_roster(config, registry)
    made, deleted = own_peering(config, "b").keep(b_keeper, found)
    assert made == [f"a@{SWARM}", f"c@{SWARM}", f"coordinator@{SWARM}"] and deleted == []
    address = without_credentials(b_redis.url)
    stream = streams.stage_key(SWARM, "b")
    urls = {w: dialer_of(config, w, found, "b", address).url(address) for w in ("a", "c")}
    urls["coordinator"] = dialer_of(config, "coordinator", found, "b", address).url(address)
    assert len(set(urls.values())) == 3  # no password common to two writers
    for writer, url in urls.items():
        assert url.startswith(f"redis://{writer}%40{SWARM}:")
        client = redis.Redis.from_url(url, socket_timeout=5)
        streams.send(client, stream, b"sealed")
        assert client.hgetall(streams.stats_key(SWARM, "b")) == {}
        for attempt in (
            lambda c=client: c.xrange(stream),
            lambda c=client: c.delete(stream),
            lambda c=client: c.set("specpipe:peers:stage:b", "x"),
            lambda c=client: c.xadd("celery", {"x": "y"}),
            lambda c=client: c.xadd(streams.stage_key("other", "b"), {"x": "y"}),
            lambda c=client: c.eval("return 1", 0),
            lambda c=client: c.execute_command("ACL", "USERS"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
        client.close()
    own = redis.Redis.from_url(b_redis.url)
    assert own.xlen(stream) == 3
    own.close()
    # a's password on b opens nothing as c, and a's password for another owner does not open b.
    a_on_b = urls["a"].split(":")[2].split("@")[0]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(address, username=f"c@{SWARM}", password=a_on_b).ping()
    a_on_c = peering.password(
        identity.load_private(config.home / "host_keys" / "a.sealing", peering.X25519PrivateKey),
        identity.sealing_public_key(found.sealing["c"]),
        SWARM,
        "a",
        "c",
    )
    assert a_on_c != a_on_b
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(address, username=f"a@{SWARM}", password=a_on_c).ping()


def test_a_revoked_host_loses_its_user_and_its_connection_at_the_owners_next_keep(swarm):
    config, registry, b_redis, b_keeper = swarm
    found = current_roster(config, registry)
    owner = own_peering(config, "b")
    owner.keep(b_keeper, found)
    address = without_credentials(b_redis.url)
    c = redis.Redis.from_url(dialer_of(config, "c", found, "b", address).url(address))
    c.ping()
    roster.revoke(registry, SWARM, "c", config.home)
    made, deleted = owner.keep(b_keeper, current_roster(config, registry))
    assert f"c@{SWARM}" not in made and deleted == [f"c@{SWARM}"]
    with pytest.raises(redis.RedisError):  # its open connection closed, and no new one
        c.ping()
    c.close()
    a = redis.Redis.from_url(dialer_of(config, "a", found, "b", address).url(address))
    assert a.ping()  # the others keep theirs
    a.close()


def test_an_address_is_dialled_as_this_hosts_user_there_only_when_its_owner_is_known(swarm):
    config, registry, *_ = swarm
    found = current_roster(config, registry)
    dialer = Dialer.configured([], None, peering=own_peering(config, "a"))
    dialer.learn(found, [("b", "rediss://10.9.9.9:6379/0")])
    assert dialer.url("rediss://10.9.9.9:6379/0").startswith(f"rediss://a%40{SWARM}:")
    assert dialer.url("rediss://10.9.9.8:6379/0", "c").startswith(f"rediss://a%40{SWARM}:")
    assert dialer.url("rediss://10.9.9.7:6379/0") == "rediss://10.9.9.7:6379/0"  # whose? none
    # Not to a host the roster does not name, nor to its own Redis as a peer.
    assert own_peering(config, "a").login("rediss://10.9.9.7:6379/0", "zed") is None
    assert dialer.url("rediss://10.9.9.6:6379/0", "a") == "rediss://10.9.9.6:6379/0"
    # Without host identities (no pin), no peering: the swarm-wide password, as before.
    assert own_peering(replace(config, coordinator_public_key=None), "a") is None


def test_the_stage_keeps_its_own_redis_users_only_when_it_is_not_the_registry(swarm, tmp_path):
    config, *_ = swarm
    registry = "rediss://10.0.0.1:6379/0"
    own = "redis://specpipe:pw@10.0.0.2:6379/0"
    assert keeper_url(config, own, registry) == (
        f"redis://{KEEPER_USER}:keeper-password@10.0.0.2:6379/0"
    )
    assert keeper_url(config, own, None) is None  # its Redis is the registry: host 0 keeps it
    assert keeper_url(config, own, "redis://a%40x:pw@10.0.0.2:6379/0") is None
    assert keeper_url(replace(config, home=tmp_path / "elsewhere"), own, registry) is None
