"""How a process dials the addresses the inventory gives: its own URLs as configured, any other
host with the swarm's data-plane password, and nothing added without one."""

from specpipe.swarm.dialing import Dialer
from specpipe.swarm.redact import has_credentials, without_credentials

OWN = "rediss://specpipe:own-pw@10.0.0.1:6379/0?ssl_ca_certs=/etc/specpipe/ca.pem"
SOCKET = "unix://specpipe:own-pw@/run/specpipe/redis.sock?db=0"


def test_an_address_carries_no_credentials():
    assert without_credentials(OWN) == "rediss://10.0.0.1:6379/0?ssl_ca_certs=/etc/specpipe/ca.pem"
    assert without_credentials(SOCKET) == "unix:///run/specpipe/redis.sock?db=0"
    assert without_credentials("redis://10.0.0.2:6379/0") == "redis://10.0.0.2:6379/0"
    assert has_credentials(OWN) and has_credentials("redis://:pw@h/0")
    assert not has_credentials(without_credentials(OWN))


def test_own_urls_are_dialled_as_configured_and_others_with_the_data_plane_password():
    dialer = Dialer.configured([OWN, SOCKET, None], "data pw/1")
    assert dialer.url(without_credentials(OWN)) == OWN
    assert dialer.url(without_credentials(SOCKET)) == SOCKET
    assert dialer.url(OWN) == OWN
    assert dialer.url("redis://10.0.0.2:6379/0") == "redis://specpipe:data%20pw%2F1@10.0.0.2:6379/0"
    assert dialer.url("unix:///other.sock?db=0") == "unix://specpipe:data%20pw%2F1@/other.sock?db=0"
    assert "data pw" not in repr(dialer)


def test_without_a_data_plane_password_an_address_is_dialled_as_it_is():
    dialer = Dialer.configured([OWN], None)
    assert dialer.url("redis://10.0.0.2:6379/0") == "redis://10.0.0.2:6379/0"
    assert dialer.url(without_credentials(OWN)) == OWN
