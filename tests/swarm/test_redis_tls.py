"""A stage host on another machine: its Redis behind TLS (verified against the swarm's own CA)
and a password, and a real stage worker process whose input stream lives there."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from specpipe.ops.redis_server import acl_rules, answers, find_binary, free_port
from specpipe.swarm.redis_ring import RedisRing
from tests.swarm.test_redis_ring import PARAMS, drive, reference
from tests.waiting import wait_until

PASSWORD = "tls-test-password"  # the host's own user's
DATA_PASSWORD = "tls-test-data-password"  # the swarm's data-plane password: its peer user's


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(directory: Path) -> None:
    """A CA, and a server certificate it signed for 127.0.0.1 and localhost."""
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=specpipe test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        cwd=directory,
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=localhost",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        cwd=directory,
    )
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.ext",
        "-out",
        "server.pem",
        cwd=directory,
    )


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """A redis-server listening only on TLS, with a password: (port, CA file)."""
    if shutil.which("openssl") is None:
        pytest.fail("the TLS test needs the openssl command (apt install openssl)")
    directory = tmp_path_factory.mktemp("tls")
    make_certificates(directory)
    port = free_port()
    config = directory / "redis.conf"
    # As every stage host's: its own user, and the peer user for the data-plane password.
    config.write_text("\n".join(acl_rules(PASSWORD, peer_password=DATA_PASSWORD)) + "\n")
    config.chmod(0o600)
    argv = [
        find_binary(),
        str(config),
        "--port",
        "0",
        "--tls-port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--tls-cert-file",
        str(directory / "server.pem"),
        "--tls-key-file",
        str(directory / "server.key"),
        "--tls-ca-cert-file",
        str(directory / "ca.pem"),
        "--tls-auth-clients",
        "no",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(directory),
    ]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ca = directory / "ca.pem"
    url = f"rediss://specpipe:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    try:
        wait_until(lambda: process.poll() is not None or answers(url), 10, "the TLS Redis")
        if process.poll() is not None:
            pytest.fail(f"redis-server with TLS did not start: {process.stderr.read()[-300:]!r}")
        yield port, ca
    finally:
        process.terminate()
        process.wait(10)
        process.stderr.close()


def refused(url: str) -> redis.RedisError:
    client = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), socket_connect_timeout=2)
    try:
        with pytest.raises(redis.RedisError) as caught:
            client.ping()
        return caught.value
    finally:
        client.close()


def test_only_a_client_with_the_ca_and_the_password_gets_in(tls_redis):
    port, ca = tls_redis
    assert answers(f"rediss://specpipe:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={ca}")
    # Without the swarm's CA the server's certificate does not verify.
    assert "certificate verify failed" in str(
        refused(f"rediss://specpipe:{PASSWORD}@127.0.0.1:{port}/0")
    )
    # With the CA but without the password, or a wrong one, Redis refuses.
    assert isinstance(
        refused(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}"), redis.AuthenticationError
    )
    assert isinstance(
        refused(f"rediss://:guess@127.0.0.1:{port}/0?ssl_ca_certs={ca}"), redis.AuthenticationError
    )
    # Plain text is not spoken at all.
    assert isinstance(
        refused(f"redis://specpipe:{PASSWORD}@127.0.0.1:{port}/0"), redis.ConnectionError
    )


def test_rounds_go_through_a_stage_whose_stream_lives_on_a_tls_redis(
    tls_redis, stages, ring_settings, redis_url, monkeypatch
):
    port, ca = tls_redis
    address = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    remote = f"rediss://specpipe:{PASSWORD}@127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    # The data-plane password: near and the coordinator add it to far's address, and verify
    # far against their own copy of the CA (their TLS folder's), not the one far's record names.
    monkeypatch.setenv("SPECPIPE_REDIS_PASSWORD", DATA_PASSWORD)
    monkeypatch.setenv("SPECPIPE_TLS_DIR", str(ca.parent))
    ring_settings = replace(ring_settings, redis_password=DATA_PASSWORD, tls_ca=str(ca))
    stages.start("near", "0:2", redis_url, wait=False)
    stages.start("far", "2:4", remote, wait=False)  # registers in the plain registry
    stages.wait_ready(["near", "far"])
    ring = RedisRing.from_inventory(ring_settings, "toy", 4, timeout_s=20)
    assert [hop.redis_url for hop in ring.route] == [redis_url, address]  # no password
    ring.reset("s", PARAMS)
    # Coordinator → near (plain) → far (TLS, sent there by near) → the reply stream.
    assert drive(ring, "s", rounds=3, k=2) == reference([(0, 2), (2, 4)], rounds=3, k=2)
    ring.drop("s")
    ring.close()
    far = redis.Redis.from_url(remote)
    assert far.exists(f"specpipe:{ring_settings.swarm}:stats:far")  # its counters live there
    far.close()
