"""The swarm's own CA (`specpipe.ops.certificates`): a host's certificate verifies against it
for the addresses it names and nothing else, the keys are owner-only, and a real redis-server
started with a host's files is verified by a client holding the CA, and refused by one holding
another."""

from __future__ import annotations

import ipaddress
from datetime import UTC, datetime, timedelta

import pytest
import redis
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from specpipe.ops import certificates
from specpipe.ops.redis_server import RedisServer, TlsFiles
from tests.swarm.test_redis_tls import refused


@pytest.fixture(scope="module")
def authority(tmp_path_factory) -> certificates.Authority:
    return certificates.make_ca(tmp_path_factory.mktemp("swarm") / "ca")


@pytest.fixture(scope="module")
def host(authority, tmp_path_factory):
    """Files for a host reached at 127.0.0.1 or localhost."""
    return certificates.issue(
        authority, ["127.0.0.1", "localhost"], tmp_path_factory.mktemp("h") / "tls", name="h1"
    )


def verify(cert_path, ca_path, subject: x509.GeneralName) -> None:
    """What a TLS client checks: the chain to the CA, and the name it dialled."""
    verifier = (
        PolicyBuilder()
        .store(Store([certificates.load_certificate(ca_path)]))
        .build_server_verifier(subject)
    )
    verifier.verify(certificates.load_certificate(cert_path), [])


def test_a_host_certificate_verifies_against_the_ca_for_the_addresses_it_names(authority, host):
    verify(host.cert, authority.cert, x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    verify(host.cert, authority.cert, x509.DNSName("localhost"))
    verify(host.cert, host.ca, x509.DNSName("localhost"))  # the copy that goes with it
    assert host.ca.read_bytes() == authority.cert.read_bytes()
    with pytest.raises(VerificationError):
        verify(host.cert, authority.cert, x509.IPAddress(ipaddress.ip_address("10.0.0.1")))
    cert = certificates.load_certificate(host.cert)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    assert certificates.certificate_names(host.cert) == ["127.0.0.1", "localhost"]
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    root = certificates.load_certificate(authority.cert)
    assert root.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert root.not_valid_after_utc - root.not_valid_before_utc > timedelta(days=3000)


def test_the_keys_are_owner_only_and_the_certificates_readable(authority, host):
    for key in (authority.key, host.key):
        assert key.stat().st_mode & 0o777 == 0o600
    for folder in (authority.key.parent, host.key.parent):
        assert folder.stat().st_mode & 0o777 == 0o700
    for cert in (authority.cert, host.cert, host.ca):
        assert cert.stat().st_mode & 0o777 == 0o644
    assert b"PRIVATE KEY" not in host.cert.read_bytes() + host.ca.read_bytes()


def test_host_files_fit_only_their_address_their_key_and_their_ca(authority, host, tmp_path):
    certificates.check_host_files(host, "127.0.0.1")
    certificates.check_host_files(host, "localhost")
    with pytest.raises(certificates.CaError, match="for 10.0.0.1: .*subjectAltName"):
        certificates.check_host_files(host, "10.0.0.1")
    other = certificates.issue(authority, ["127.0.0.1"], tmp_path / "other")
    with pytest.raises(certificates.CaError, match="is not the key of"):
        certificates.check_host_files(TlsFiles(host.cert, other.key, host.ca), "127.0.0.1")
    stranger = certificates.make_ca(tmp_path / "stranger")
    with pytest.raises(certificates.CaError, match="does not verify against"):
        certificates.check_host_files(TlsFiles(host.cert, host.key, stranger.cert), "127.0.0.1")
    later = datetime.now(UTC) + timedelta(days=certificates.HOST_DAYS + 1)
    with pytest.raises(certificates.CaError, match="does not verify"):
        certificates.check_host_files(host, "127.0.0.1", now=later)
    with pytest.raises(certificates.CaError, match="no certificate at"):
        certificates.check_host_files(certificates.host_files(tmp_path / "none"), "127.0.0.1")


def test_a_second_ca_is_refused_unless_asked_for(authority):
    before = authority.cert.read_bytes()
    with pytest.raises(certificates.CaExists):
        certificates.make_ca(authority.cert.parent)
    assert authority.cert.read_bytes() == before


@pytest.mark.parametrize(
    "address",
    ["300.1.2.3", "10.0.0", "redis://10.0.0.1:6379", "10.0.0.1:6379", "*.example.org", "", "a b"],
)
def test_a_malformed_address_is_refused_and_nothing_is_written(authority, tmp_path, address):
    with pytest.raises(certificates.CaError, match="neither an IP address nor a DNS name"):
        certificates.issue(authority, ["10.0.0.1", address], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_addresses_of_every_kind_are_taken(authority, tmp_path):
    files = certificates.issue(authority, ["2001:db8::7", "Host-1.Example.org."], tmp_path / "out")
    assert certificates.certificate_names(files.cert) == ["2001:db8::7", "host-1.example.org"]
    certificates.check_host_files(files, "2001:db8::7")
    certificates.check_host_files(files, "host-1.example.org")


def test_a_redis_server_with_issued_files_is_verified_with_the_ca_and_no_other(host, tmp_path):
    stranger = certificates.make_ca(tmp_path / "stranger")
    with RedisServer(tls=host, password="own secret") as server:
        assert server.url.startswith("rediss://") and f"ssl_ca_certs={host.ca}" in server.url
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        client.close()
        base = server.url.split("?", 1)[0]
        port = server.port
        by_name = f"rediss://specpipe:own%20secret@localhost:{port}/0?ssl_ca_certs={host.ca}"
        client = redis.Redis.from_url(by_name)
        assert client.ping()
        client.close()
        error = refused(f"{base}?ssl_ca_certs={stranger.cert}")
        assert "certificate verify failed" in str(error)
        assert "certificate verify failed" in str(refused(base))  # the system's CAs: no
        assert isinstance(
            refused(f"redis://specpipe:own%20secret@127.0.0.1:{port}/0"), redis.ConnectionError
        )


def test_a_peers_record_cannot_choose_how_its_server_is_verified(host, tmp_path):
    """The address another host registers names its CA file and may name options that switch
    verification off; a dialling process uses its own CA and nothing of those."""
    from specpipe.swarm.dialing import Dialer

    stranger = certificates.make_ca(tmp_path / "stranger")
    with RedisServer(tls=host, password="own", peer_password="data") as server:
        where = f"127.0.0.1:{server.port}/0"
        record = f"rediss://{where}?ssl_ca_certs={stranger.cert}&ssl_cert_reqs=none"
        client = redis.Redis.from_url(Dialer.configured([], "data", ca=str(host.ca)).url(record))
        assert client.ping()
        client.close()
        for dialer in (
            Dialer.configured([], "data"),
            Dialer.configured([], "data", str(stranger.cert)),
        ):
            assert "certificate verify failed" in str(refused(dialer.url(record)))
