"""Joining by invitation (`specpipe.ops.invitations`) against a real, locked-down redis-server:
the token, the request only its holder can make, the answer only the new host can open and
only host 0 can sign, once only, and not after it expires."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from specpipe.ops import certificates, invitations, roster
from specpipe.ops.invitations import InvitationError
from specpipe.ops.redis_server import KEEPER_USER, RedisServer
from specpipe.settings import COORDINATOR_PUB_FILE, KEEPER_PASSWORD_FILE
from specpipe.swarm import credentials, identity, inventory
from specpipe.swarm.identity import Signer
from specpipe.swarm.inventory import NodeInfo
from specpipe.swarm.redact import without_credentials
from tests.waiting import wait_until

SWARM = "inv"
SHARED = {"swarm_key": "k" * 64, "redis_password": "data-plane"}


@pytest.fixture
def host0(tmp_path):
    """Host 0: its registry (its own user's URL), its coordinator key and its swarm CA."""
    home = tmp_path / "host0"
    ca = certificates.make_ca(home / "ca")
    (home / KEEPER_PASSWORD_FILE).write_text("keeper-password\n")
    with RedisServer(password="own-password", keeper_password="keeper-password") as server:
        client = redis.Redis.from_url(server.url)
        roster.admit_own_hosts(client, SWARM, ["a"], home)
        yield server, client, home, ca
        client.close()


def new_host(name: str = "mn") -> tuple[Signer, ec.EllipticCurvePrivateKey]:
    signer = Signer(name, Ed25519PrivateKey.generate(), X25519PrivateKey.generate())
    return signer, ec.generate_private_key(ec.SECP256R1())


def make(host0, name: str = "mn", **options) -> invitations.Invitation:
    server, client, home, ca = host0
    return invitations.invite(client, SWARM, name, registry=server.url, ca=ca, home=home, **options)


def answering(host0, stop: threading.Event) -> threading.Thread:
    """Host 0's beat, answering every half second until `stop`."""
    _, client, home, ca = host0

    def beat():
        while not stop.wait(0.2):
            invitations.answer_pending(client, SWARM, ca=ca, home=home, shared=SHARED)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    return thread


def test_the_token_is_one_line_that_names_no_password_and_reads_back(host0):
    invitation = make(host0)
    token = invitation.token()
    assert "\n" not in token and " " not in token and len(token) < 600
    assert invitations.parse(token) == invitation
    assert "own-password" not in json.dumps(invitation.__dict__)
    assert invitation.registry.startswith("redis://127.0.0.1:") and "@" not in invitation.registry
    assert invitation.ca_sha256 == invitations.ca_fingerprint(host0[3].cert.read_bytes())
    for damaged in (token[:-5], "specpipe-join-1:!!", "hello"):
        with pytest.raises(InvitationError) as refused:
            invitations.parse(damaged)
        assert "\n" not in str(refused.value)


def test_a_new_host_is_admitted_certified_and_given_what_hosts_share(host0, tmp_path):
    server, client, home, ca = host0
    invitation = make(host0, layers="2:4")
    signer, tls_key = new_host()
    stop = threading.Event()
    answering(host0, stop)
    try:
        answer = invitations.redeem(invitation, signer, tls_key, "10.0.0.9", timeout_s=20)
    finally:
        stop.set()
    assert answer.shared == SHARED and answer.layers == "2:4"
    cert = x509.load_pem_x509_certificate(answer.cert.encode())
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    assert cert.public_key().public_bytes(*spki) == tls_key.public_key().public_bytes(*spki)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(n) for n in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.9"]
    admitted = roster.current(client, SWARM, roster.coordinator(home), home)
    assert admitted.hosts["mn"] == signer.public_hex
    assert admitted.sealing["mn"] == identity.public_hex(signer.sealing)
    # What it keeps lets it reach the registry as its own user, and publish its record.
    mine, tls = tmp_path / "mn", tmp_path / "mn" / "tls"
    registry = invitations.keep(invitation, answer, tls_key, mine, tls)
    assert (tls / COORDINATOR_PUB_FILE).read_text().strip() == invitation.pin
    assert (mine / "swarm_key").stat().st_mode & 0o777 == 0o600
    assert (tls / "redis.key").stat().st_mode & 0o777 == 0o600
    assert json.loads((mine / "joined.json").read_text())["registry_url"] == registry
    _, coordinator_sealing = identity.pinned(invitation.pin)
    password = credentials.registry_password(signer.sealing, coordinator_sealing, SWARM, "mn")
    own = redis.Redis.from_url(credentials.registry_url(registry, SWARM, "mn", password))
    node = NodeInfo(host="mn", layer_start=2, layer_end=4, redis_url="redis://10.0.0.9:6379/0")
    inventory.publish(own, SWARM, node, b"k" * 32)
    own.close()


def test_an_invitation_works_once(host0):
    invitation = make(host0)
    stop = threading.Event()
    answering(host0, stop)
    try:
        invitations.redeem(invitation, *new_host(), "10.0.0.9", timeout_s=20)
        # Its user is gone once the answer was taken: the token is spent.
        client = host0[1]
        wait_until(
            lambda: not client.hexists(invitations.invitations_key(SWARM), "mn"),
            10,
            "the spent invitation to be dropped",
        )
        with pytest.raises(InvitationError, match="used, expired or withdrawn"):
            invitations.redeem(invitation, *new_host(), "10.0.0.10", timeout_s=5)
    finally:
        stop.set()
    admitted = roster.current(host0[1], SWARM, roster.coordinator(host0[2]), host0[2])
    assert set(admitted.hosts) == {"a", "mn"}


def test_a_request_not_made_with_the_secret_admits_nobody(host0):
    """Whoever saw the invitation user's password on the first link (unverified TLS) can
    leave a request, but without the secret it is refused, and the invitation still works."""
    invitation = make(host0)
    thief = replace(invitation, secret="00" * 32)
    forged = invitations.request(thief, *new_host()[:1], new_host()[1], "10.6.6.6")
    url = invitations._bootstrap_url(invitation)  # the password seen on the link
    client = redis.Redis.from_url(url)
    client.set(invitations.request_key(SWARM, "mn"), forged)
    client.close()
    _, registry, home, ca = host0
    assert invitations.answer_pending(registry, SWARM, ca=ca, home=home, shared=SHARED) == []
    assert "mn" not in roster.current(registry, SWARM, roster.coordinator(home), home).hosts
    stop = threading.Event()
    answering(host0, stop)
    try:
        answer = invitations.redeem(invitation, *new_host(), "10.0.0.9", timeout_s=20)
    finally:
        stop.set()
    assert answer.shared == SHARED


def test_an_answer_opens_only_for_the_new_host_and_only_as_host_0_signed_it(host0):
    invitation = make(host0)
    signer, tls_key = new_host()
    left = invitations.request(invitation, signer, tls_key, "10.0.0.9")
    _, client, home, ca = host0
    client.set(invitations.request_key(SWARM, "mn"), left)
    assert invitations.answer_pending(client, SWARM, ca=ca, home=home, shared=SHARED) == ["mn"]
    raw = client.get(invitations.answer_key(SWARM, "mn"))
    assert b"data-plane" not in raw and b"k" * 64 not in raw  # sealed
    assert invitations._opened(invitation, signer.sealing, raw).shared == SHARED
    with pytest.raises(InvitationError, match="does not open"):
        invitations._opened(invitation, X25519PrivateKey.generate(), raw)
    tampered = raw[:-1] + bytes([raw[-1] ^ 1])
    with pytest.raises(InvitationError, match="not signed by the coordinator"):
        invitations._opened(invitation, signer.sealing, tampered)
    other_ca = replace(invitation, ca_sha256="ab" * 32)
    with pytest.raises(InvitationError, match="CA is not the one"):
        invitations._opened(other_ca, signer.sealing, raw)


def test_an_expired_invitation_is_withdrawn(host0):
    invitation = make(host0, expires_s=0.5)
    server, client, home, ca = host0
    keeper = redis.Redis.from_url(
        without_credentials(server.url), username=KEEPER_USER, password="keeper-password"
    )
    users = lambda: {u.decode() for u in keeper.execute_command("ACL", "USERS")}  # noqa: E731
    assert invitations.user(SWARM, "mn") in users()
    wait_until(
        lambda: (
            not invitations.answer_pending(client, SWARM, ca=ca, home=home, shared=SHARED)
            and not client.hexists(invitations.invitations_key(SWARM), "mn")
        ),
        10,
        "the invitation to expire",
    )
    assert invitations.user(SWARM, "mn") not in users()
    with pytest.raises(InvitationError, match="used, expired or withdrawn"):
        invitations.redeem(invitation, *new_host(), "10.0.0.9", timeout_s=2)


def test_an_invitation_user_may_only_leave_its_request_and_take_its_answer(host0):
    invitation = make(host0)
    client = redis.Redis.from_url(invitations._bootstrap_url(invitation))
    for attempt in (
        lambda: client.get(invitations.invitations_key(SWARM)),
        lambda: client.hgetall(invitations.invitations_key(SWARM)),
        lambda: client.get(identity.roster_key(SWARM)),
        lambda: client.set(inventory.node_key(SWARM, "mn"), "x"),
        lambda: client.set(invitations.request_key(SWARM, "other"), "x"),
        lambda: client.set(invitations.answer_key(SWARM, "mn"), "x"),
        lambda: client.keys("*"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    assert client.getdel(invitations.answer_key(SWARM, "mn")) is None
    client.close()


def test_host_0_refuses_a_name_no_host_may_have(host0):
    for name in ("coordinator", "a b", "x*"):
        with pytest.raises(InvitationError):
            make(host0, name)


def test_join_refuses_in_one_line_a_damaged_line_and_one_to_another_swarm(tmp_path):
    from click.testing import CliRunner

    from specpipe.cli import cli

    coordinator = Signer("coordinator", Ed25519PrivateKey.generate(), X25519PrivateKey.generate())
    pin = identity.pin_text(coordinator)
    line = invitations.Invitation("redis://127.0.0.1:1/0", "ab" * 32, pin, "s1", "mn", "00" * 32)
    env = {"SPECPIPE_HOME": str(tmp_path), "SPECPIPE_SWARM": "s2"}
    for token, said in (
        (
            line.token(),
            "the invitation is to swarm 's1', but SPECPIPE_SWARM (or this instance "
            "folder) names 's2'",
        ),
        (line.token()[:-9], "the invitation is damaged: copy the whole line again"),
    ):
        result = CliRunner().invoke(cli, ["join", token], env=env)
        assert result.exit_code == 1
        assert result.output.strip().splitlines()[-1] == f"Error: {said}"
    assert not (tmp_path / "host_keys").exists()  # nothing made
