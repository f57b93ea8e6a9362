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
    assert dialer.url("redis://10.0.0.2:6379/0") == f"redis://{peer}10.0.0.2:6379/0"
    assert dialer.url("unix:///other.sock?db=0") == f"unix://{peer}/other.sock?db=0"
    assert PEER_USER == "specpipe-peer" != REDIS_USER
    assert "data pw" not in repr(dialer)


def test_without_a_data_plane_password_an_address_is_dialled_as_it_is():
    dialer = Dialer.configured([OWN], None)
    assert dialer.url("redis://10.0.0.2:6379/0") == "redis://10.0.0.2:6379/0"
    assert dialer.url(without_credentials(OWN)) == OWN
