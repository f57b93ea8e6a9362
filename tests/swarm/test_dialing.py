"""How a process dials the addresses the inventory gives: its own URLs as configured, any other
host as the peer user with the swarm's data-plane password, and nothing added without one."""

from specpipe.swarm.dialing import PEER_USER, REDIS_USER, Dialer
from specpipe.swarm.redact import has_credentials, without_credentials

OWN = "rediss://specpipe:own-pw@10.0.0.1:6379/0?ssl_ca_certs=/etc/specpipe/ca.pem"
SOCKET = "unix://specpipe:own-pw@/run/specpipe/redis.sock?db=0"


def test_an_address_carries_no_credentials():
    assert without_credentials(OWN) == "rediss://10.0.0.1:6379/0?ssl_ca_certs=/etc/specpipe/ca.pem"
    assert without_credentials(SOCKET) == "unix:///run/specpipe/redis.sock?db=0"
    assert without_credentials("redis://10.0.0.2:6379/0") == "redis://10.0.0.2:6379/0"
    assert has_credentials(OWN) and has_credentials("redis://:pw@h/0")
    assert not has_credentials(without_credentials(OWN))


def test_own_urls_are_dialled_as_configured_and_others_as_the_peer_user():
    """On main another host's address was dialled as `specpipe`, the user with every right."""
    dialer = Dialer.configured([OWN, SOCKET, None], "data pw/1")
    assert dialer.url(without_credentials(OWN)) == OWN
    assert dialer.url(without_credentials(SOCKET)) == SOCKET
    assert dialer.url(OWN) == OWN
    peer = "specpipe-peer:data%20pw%2F1@"
    assert dialer.url("rediss://10.0.0.2:6379/0") == f"rediss://{peer}10.0.0.2:6379/0"
    assert dialer.url("redis://127.0.0.1:6390/0") == f"redis://{peer}127.0.0.1:6390/0"
    assert dialer.url("unix:///other.sock?db=0") == f"unix://{peer}/other.sock?db=0"
    assert PEER_USER == "specpipe-peer" != REDIS_USER
    assert "data pw" not in repr(dialer)


def test_without_a_data_plane_password_an_address_is_dialled_as_it_is():
    dialer = Dialer.configured([OWN], None)
    assert dialer.url("redis://10.0.0.2:6379/0") == "redis://10.0.0.2:6379/0"
    assert dialer.url(without_credentials(OWN)) == OWN


PEER_RECORD = (
    "rediss://10.0.0.2:6379/0?ssl_ca_certs=/elsewhere/ca.pem&ssl_cert_reqs=none"
    "&ssl_check_hostname=false"
)


def test_another_hosts_tls_server_is_verified_against_this_hosts_own_ca():
    """On main the CA file, and any other TLS option, came from the other host's record."""
    dialer = Dialer.configured([OWN], "pw", ca="/var/lib/specpipe/tls/ca.pem")
    mine = "ssl_ca_certs=/var/lib/specpipe/tls/ca.pem"
    assert dialer.url(PEER_RECORD) == f"rediss://specpipe-peer:pw@10.0.0.2:6379/0?{mine}"
    assert Dialer(ca="/var/lib/specpipe/tls/ca.pem").url(PEER_RECORD) == (
        f"rediss://10.0.0.2:6379/0?{mine}"
    )
    # Without a CA of its own: no file and no option at all (the system's CAs, which never
    # signed a swarm's certificate, so the server is refused).
    assert (
        Dialer.configured([], "pw").url(PEER_RECORD) == "rediss://specpipe-peer:pw@10.0.0.2:6379/0"
    )
    # Of a plain address's options only its database is kept.
    assert dialer.url("rediss://10.0.0.2:6379/0?socket_timeout=0.001&db=3") == (
        f"rediss://specpipe-peer:pw@10.0.0.2:6379/0?db=3&{mine}"
    )
    assert dialer.url(without_credentials(OWN)) == OWN  # its own URLs: as configured


def test_a_process_verifies_with_the_ca_of_its_own_tls_folder(tmp_path, monkeypatch):
    from specpipe.settings import Settings

    monkeypatch.setenv("SPECPIPE_HOME", str(tmp_path / "instance"))
    monkeypatch.delenv("SPECPIPE_TLS_DIR", raising=False)
    assert Dialer.for_settings(Settings.from_env()).ca is None
    (tmp_path / "instance" / "tls").mkdir(parents=True)
    (tmp_path / "instance" / "tls" / "ca.pem").write_text("a certificate\n")
    assert Dialer.from_env().ca == str(tmp_path / "instance" / "tls" / "ca.pem")
    monkeypatch.setenv("SPECPIPE_TLS_DIR", str(tmp_path / "elsewhere"))
    assert Dialer.from_env().ca is None


def test_a_password_never_travels_in_clear_to_another_machine(caplog, monkeypatch):
    """On main a host joined with --insecure-no-tls made every other host send it the
    data-plane password in clear."""
    monkeypatch.delenv("SPECPIPE_INSECURE_CLEAR_PASSWORDS", raising=False)
    dialer = Dialer.configured([OWN], "data-pw")
    for clear in ("redis://10.0.0.9:6379/0", "redis://stage.example.org:6379/0?db=2"):
        url = dialer.url(clear)
        assert not has_credentials(url) and "data-pw" not in url
    assert dialer.url("redis://10.0.0.9:6379/0?db=1") == "redis://10.0.0.9:6379/0?db=1"
    warned = [r.getMessage() for r in caplog.records if "without a password" in r.getMessage()]
    assert len(warned) == 2 and "redis://10.0.0.9:6379 " in warned[0]  # once per host
    assert all("data-pw" not in line for line in warned)
    for safe in ("redis://localhost:6379/0", "redis://[::1]:6379/0", "redis://127.0.0.2:6379"):
        assert "specpipe-peer:data-pw@" in dialer.url(safe)


def test_clear_passwords_only_when_said_out_loud(monkeypatch):
    monkeypatch.setenv("SPECPIPE_INSECURE_CLEAR_PASSWORDS", "1")  # a test lab's plain links
    assert Dialer.configured([OWN], "pw").url("redis://10.0.0.9:6379/0") == (
        "redis://specpipe-peer:pw@10.0.0.9:6379/0"
    )
    monkeypatch.setenv("SPECPIPE_INSECURE_CLEAR_PASSWORDS", "yes")
    assert not has_credentials(Dialer.configured([OWN], "pw").url("redis://10.0.0.9:6379/0"))
