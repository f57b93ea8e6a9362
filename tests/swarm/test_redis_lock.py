"""The Redis `specpipe up` runs, locked down: a password, an ACL user limited to the commands
the swarm uses, a request size just above the largest wire message, and no eviction."""

from __future__ import annotations

import socket
import stat

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from specpipe import settings
from specpipe.ops import redis_server
from specpipe.ops.redis_server import USER, RedisServer
from specpipe.swarm import streams
from tests.waiting import wait_until

FORBIDDEN = [
    ("CONFIG", "SET", "maxmemory", "0"),
    ("CONFIG", "GET", "requirepass"),
    ("KEYS", "*"),
    ("FLUSHALL",),
    ("FLUSHDB",),
    ("SHUTDOWN", "NOSAVE"),
    ("DEBUG", "SLEEP", "0"),
    ("MODULE", "LIST"),
    ("SAVE",),
    ("BGSAVE",),
    ("BGREWRITEAOF",),
    ("REPLICAOF", "127.0.0.1", "1"),
    ("MIGRATE", "127.0.0.1", "1", "k", "0", "10"),
    ("ACL", "LIST"),
    ("ACL", "SETUSER", USER, "+@all"),
    ("MONITOR",),
    ("CLIENT", "KILL", "ID", "1"),
]


@pytest.fixture(scope="module")
def locked(tmp_path_factory):
    with RedisServer(password="correct horse", maxmemory="64mb") as server:
        yield server


def test_whoever_has_not_the_password_is_refused(locked):
    once = {"retry": Retry(NoBackoff(), 0)}  # a refusal, not a fault to retry
    for client in (
        redis.Redis(port=locked.port, **once),  # no user, no password
        redis.Redis(port=locked.port, password="correct horse", **once),  # default user: off
        redis.Redis(port=locked.port, username="default", password="", **once),  # it has none
        redis.Redis(port=locked.port, username=USER, password="guess", **once),
        redis.Redis(unix_socket_path=str(locked.socket_path), **once),
    ):
        with pytest.raises(redis.AuthenticationError):
            client.ping()
        client.close()
    assert locked.url.startswith(f"redis://{USER}:correct%20horse@127.0.0.1:")


@pytest.mark.parametrize("command", FORBIDDEN, ids=lambda c: " ".join(c[:2]))
def test_the_swarm_user_cannot_reconfigure_stop_list_or_empty_the_server(locked, command):
    client = redis.Redis.from_url(locked.url)
    client.set("kept", "1")
    with pytest.raises(redis.ResponseError) as refused:
        client.execute_command(*command)
    # DEBUG and MODULE are also off for everyone (Redis 7's enable-debug/module-command).
    assert "no permissions" in str(refused.value) or "not allowed" in str(refused.value)
    assert client.ping() and client.get("kept") == b"1"  # still up, nothing lost
    client.close()


def test_the_swarm_user_runs_the_data_plane_on_both_addresses(locked):
    connections = streams.Connections()
    for url in (locked.url, locked.socket_url):
        client = connections.get(url)
        consumer = streams.StreamConsumer(client, f"specpipe:lock:stage:{url[:4]}", "c")
        streams.send(connections.link(url), consumer.key, b"a round")
        assert [data for _, data in consumer.read(block_ms=100)] == [b"a round"]
        consumer.ack([eid for eid, _ in consumer.read(block_ms=10)] or [])
        consumer.flush()
        lock = client.lock("specpipe:lock:job", timeout=5)
        assert lock.acquire(blocking=False) and lock.extend(5)
        lock.release()
    connections.close()


def test_memory_is_bounded_and_nothing_is_evicted(locked):
    memory = redis.Redis.from_url(locked.url).info("memory")
    assert memory["maxmemory"] == 64 * 2**20 and memory["maxmemory_policy"] == "noeviction"


def _bulk_header_refused(server: RedisServer, length: int) -> bool:
    """Send an authenticated XADD whose message is announced as `length` bytes (none of them
    sent): whether Redis refuses it at once, from the announced length alone."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        auth = f"*3\r\n$4\r\nAUTH\r\n${len(USER)}\r\n{USER}\r\n$13\r\ncorrect horse\r\n"
        sock.sendall(auth.encode())
        assert sock.recv(64) == b"+OK\r\n"
        head = "*5\r\n$4\r\nXADD\r\n$3\r\nbig\r\n$1\r\n*\r\n$1\r\nm\r\n"
        sock.sendall(f"{head}${length}\r\n".encode())
        sock.settimeout(1.0)
        try:
            reply = sock.recv(200)
        except TimeoutError:
            return False  # still waiting for the bytes: a request this large is read
    assert b"invalid bulk length" in reply
    return True


def test_an_xadd_over_the_largest_wire_message_is_refused(locked):
    limit = redis_server.proto_max_bulk_len()
    from specpipe.swarm.wire import MAX_MESSAGE_BYTES

    assert MAX_MESSAGE_BYTES < limit <= MAX_MESSAGE_BYTES + 4 * 2**20
    assert not _bulk_header_refused(locked, limit)
    assert _bulk_header_refused(locked, limit + 1)


def test_a_password_of_any_characters_goes_into_the_urls(tmp_path):
    with RedisServer(data_dir=tmp_path / "r", password="p@ss:w/rd?#%") as server:
        for url in (server.url, server.socket_url):
            client = redis.Redis.from_url(url)
            assert client.ping()
            client.close()


def test_a_restart_keeps_port_password_and_data(tmp_path):
    data = tmp_path / "redis"
    server = RedisServer(data_dir=data, password="pw-1")
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        client.rpush("coordinator", "queued")
        wait_until(
            lambda: any(b"queued" in p.read_bytes() for p in data.rglob("*.aof*")),
            10,
            "the append-only file's fsync",
        )
        client.close()
        server.process.kill()
        server.process.wait()
        again = RedisServer(port=server.port, data_dir=data, password="pw-1")
        assert again.url == server.url and again.argv() == server.argv()
        with again:
            client = redis.Redis.from_url(again.url)
            assert client.lrange("coordinator", 0, -1) == [b"queued"]
            client.close()
    finally:
        server.stop()

    config = data / "acl.conf"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert "pw-1" not in config.read_text()  # only its SHA-256
    assert not [arg for arg in server.argv() if "pw-1" in arg]


def test_a_restart_keeps_what_transactions_and_scripts_wrote(tmp_path):
    # Redis replays MULTI/EXEC blocks (kombu's pipelines, every Lua script's writes) from the
    # append-only file as its default user: a default user allowed less drops them.
    data = tmp_path / "redis"
    server = RedisServer(data_dir=data, password="pw-1")
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        with client.pipeline(transaction=True) as pipe:
            pipe.rpush("queue", "a").hset("unacked", "tag", "b").execute()
        client.eval("redis.call('set', KEYS[1], ARGV[1])", 1, "lock", "owner")
        wait_until(lambda: _aof_holds(data, b"owner"), 10, "the append-only file's fsync")
        client.close()
        server.process.kill()
        server.process.wait()
        with RedisServer(port=server.port, data_dir=data, password="pw-1") as again:
            client = redis.Redis.from_url(again.url)
            assert client.lrange("queue", 0, -1) == [b"a"]
            assert client.hget("unacked", "tag") == b"b"
            assert client.get("lock") == b"owner"
            client.close()
    finally:
        server.stop()


def _aof_holds(data, needle: bytes) -> bool:
    return any(needle in p.read_bytes() for p in data.rglob("*.aof*") if p.is_file())


def test_the_password_is_made_once_and_kept_owner_only(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPIPE_HOME", str(tmp_path))
    monkeypatch.delenv("SPECPIPE_REDIS_PASSWORD", raising=False)
    first = settings.ensure_redis_password()
    assert len(first) == 64 and settings.ensure_redis_password() == first
    assert stat.S_IMODE((tmp_path / "redis_password").stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("value", "ok"),
    [("", True), ("512mb", True), ("4GB", True), ("0", False), ("lots", False), ("-1", False)],
)
def test_maxmemory_is_a_redis_size(monkeypatch, value, ok):
    monkeypatch.setenv("SPECPIPE_REDIS_MAXMEMORY", value)
    if ok:
        assert settings.redis_maxmemory() == (value or settings.DEFAULT_REDIS_MAXMEMORY)
    else:
        with pytest.raises(ValueError, match="SPECPIPE_REDIS_MAXMEMORY"):
            settings.redis_maxmemory()
