"""Joining by invitation: one line printed on host 0, one command on the new host.

On host 0, `specpipe host invite NAME` makes an invitation (`invite`): a one-time secret, kept on
the registry where only host 0's processes read it, with the host's name, the invitation's
expiry and layers; and a user of the registry for it that may only leave a request and take
its answer. It prints a token: the registry's address, the SHA-256 of the swarm CA's
certificate, the coordinator's pinned keys, the swarm's and the host's names, and the secret.

On the new host, `specpipe join TOKEN` (`redeem`) makes the host's keys (signing, sealing and
TLS) and leaves a request: its public keys and address, with an HMAC under the secret. The
invitation user's password is derived from the secret, never the secret itself, so whoever sees
that password on the first link (TLS the new host cannot verify yet: it has no CA) can neither
forge a request nor read an answer. Host 0's beat (`answer_pending`) checks the HMAC, admits the
host's keys (`roster.admit`, which makes its registry user), signs a certificate for its TLS key
and address with the swarm CA, and answers: the certificate, the CA's, and what every host
still shares (the swarm key, the data-plane password), sealed to the host's sealing key and
signed by the coordinator. The new host checks the signature against the pin in the token and
the CA against the fingerprint, keeps what it got in its instance folder (`keep`), and joins;
from then on it verifies the registry against that CA.

An invitation is answered once, and expires (one hour by default): its user, its keys and its
secret are deleted then, or once its answer has been read.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from specpipe import settings
from specpipe.ops import certificates, roster
from specpipe.swarm import credentials, datakeys, identity
from specpipe.swarm.clock import SwarmClock
from specpipe.swarm.identity import Signer

TOKEN_PREFIX = "specpipe-join-1:"
PASSWORD_INFO = b"specpipe invitation password v1"
ANSWER_INFO = b"specpipe invitation answer v1"
ANSWER_CONTEXT = b"specpipe invitation answer v1\x00"
DEFAULT_EXPIRES_S = 3600.0
MAX_REQUEST_BYTES = 16 * 1024
WAIT_EVERY_S = 0.5

log = logging.getLogger("specpipe.invitations")


class InvitationError(ValueError):
    """An invitation that cannot be made, read, redeemed or answered; the message is one line
    and holds no secret."""


@dataclass(frozen=True)
class Invitation:
    """What a token carries."""

    registry: str  # the registry's address, without user or password
    ca_sha256: str  # of the swarm CA's certificate (DER), hex
    pin: str  # the coordinator's public keys, as `coordinator.pub` holds them
    swarm: str
    host: str
    secret: str  # hex; one time only

    def token(self) -> str:
        body = {
            "registry": self.registry,
            "ca": self.ca_sha256,
            "pin": self.pin,
            "swarm": self.swarm,
            "host": self.host,
            "secret": self.secret,
        }
        raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return TOKEN_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def parse(token: str) -> Invitation:
    """The invitation a token carries; InvitationError for anything else."""
    token = token.strip()
    if not token.startswith(TOKEN_PREFIX):
        raise InvitationError("not an invitation: `specpipe host invite NAME` on host 0 makes one")
    encoded = token[len(TOKEN_PREFIX) :]
    try:
        body = json.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
        invitation = Invitation(
            body["registry"], body["ca"], body["pin"], body["swarm"], body["host"], body["secret"]
        )
        bytes.fromhex(invitation.secret)
        identity.pinned(invitation.pin)
    except (ValueError, KeyError, TypeError):
        raise InvitationError("the invitation is damaged: copy the whole line again") from None
    if not all(isinstance(v, str) for v in body.values()):
        raise InvitationError("the invitation is damaged: copy the whole line again")
    return invitation


def invitations_key(swarm: str) -> str:
    """Host 0's hash of open invitations: host name -> JSON (secret, expiry, layers)."""
    return f"specpipe:{swarm}:invitations"


def request_key(swarm: str, host: str) -> str:
    return f"specpipe:{swarm}:invite:{host}:request"


def answer_key(swarm: str, host: str) -> str:
    return f"specpipe:{swarm}:invite:{host}:answer"


def user(swarm: str, host: str) -> str:
    """The registry user of `host`'s invitation (`/` is in no host's name, so it is no host's
    user)."""
    return f"invite/{host}@{swarm}"


def password(secret: str) -> str:
    """The invitation user's password: derived from the secret, which never travels."""
    hkdf = HKDF(hashes.SHA256(), length=32, salt=None, info=PASSWORD_INFO)
    return hkdf.derive(bytes.fromhex(secret)).hex()


def ca_fingerprint(cert_pem: bytes) -> str:
    """The SHA-256 (hex) of a certificate's DER bytes."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def bare_address(url: str) -> str:
    """`url` without user, password or options: what other hosts are told to dial."""
    parts = urlsplit(url)
    if not parts.hostname:
        raise InvitationError(f"{parts.scheme}:// is no address another host can reach")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{parts.port or 6379}{parts.path or '/0'}"


# Host 0's side.


def invite(
    client: redis.Redis,
    swarm: str,
    host: str,
    *,
    registry: str,
    ca: certificates.Authority,
    home: Path | None = None,
    expires_s: float = DEFAULT_EXPIRES_S,
    layers: str | None = None,
) -> Invitation:
    """A new invitation for `host` to join `swarm`, whose registry other hosts reach at
    `registry`, signed for by the CA `ca` and the coordinator key of `home`; its user is made
    on the registry (`client`, host 0's own). An earlier open invitation for the name is
    replaced. InvitationError for a name no host may have, or a CA or key not there."""
    try:
        identity.check_host_name(host)
        credentials.rules(swarm, host, "0" * 64)  # a name that fits a key pattern
        signer = roster.coordinator(home)
        fingerprint = ca_fingerprint(ca.cert.read_bytes())
    except (ValueError, OSError) as exc:
        raise InvitationError(str(exc)) from None
    with roster.keeping(client, home) as keeper:
        secret = _open(keeper, swarm, host, expires_s, layers)
    return Invitation(
        bare_address(registry), fingerprint, identity.pin_text(signer), swarm, host, secret
    )


def _open(keeper: redis.Redis, swarm: str, host: str, expires_s: float, layers: str | None) -> str:
    """`host`'s invitation opened on the registry (as its keeper): its secret, returned, kept
    with its expiry and layers, and its user made. An earlier one for the name is dropped."""
    secret = secrets.token_hex(32)
    record = {"secret": secret, "expires": SwarmClock(keeper).now() + expires_s}
    if layers:
        record["layers"] = layers
    _drop(keeper, swarm, host)
    keeper.hset(invitations_key(swarm), host, json.dumps(record))
    digest = hashlib.sha256(password(secret).encode()).hexdigest()
    keeper.execute_command(
        "ACL",
        "SETUSER",
        user(swarm, host),
        "reset",
        "on",
        f"#{digest}",
        *credentials.CONNECTION,
        f"~{request_key(swarm, host)}",
        "+set",
        f"(~{answer_key(swarm, host)} +getdel)",  # read once
    )
    return secret


def withdraw(client: redis.Redis, swarm: str, host: str, home: Path | None = None) -> bool:
    """`host`'s open invitation withdrawn (its user, keys and secret deleted); whether there
    was one."""
    if not client.hexists(invitations_key(swarm), host):
        return False
    with roster.keeping(client, home) as keeper:
        _drop(keeper, swarm, host)
    return True


def _drop(client: redis.Redis, swarm: str, host: str) -> None:
    """An invitation gone: its user (its connections closed), its keys, its secret."""
    client.execute_command("ACL", "DELUSER", user(swarm, host))
    client.delete(request_key(swarm, host), answer_key(swarm, host))
    client.hdel(invitations_key(swarm), host)


def answer_pending(
    client: redis.Redis,
    swarm: str,
    *,
    ca: certificates.Authority,
    home: Path | None = None,
    shared: dict[str, str] | None = None,
) -> list[str]:
    """Host 0's beat: each invitation with a request answered (the host admitted, its
    certificate signed, `shared` sealed to it: what every host still holds, by file name), an
    expired one or one whose answer was read deleted. The hosts answered now."""
    with roster.keeping(client, home) as keeper:
        return _answer_all(keeper, swarm, ca, home, shared or {})


def _answer_all(
    client: redis.Redis,
    swarm: str,
    ca: certificates.Authority,
    home: Path | None,
    shared: dict[str, str],
) -> list[str]:
    now = SwarmClock(client).now()
    answered = []
    for name, value in client.hgetall(invitations_key(swarm)).items():
        host = name.decode()
        record = json.loads(value)
        if record.get("answered"):
            if record["expires"] <= now or not client.exists(answer_key(swarm, host)):
                _drop(client, swarm, host)  # its answer taken (read once), or lapsed
            continue
        if record["expires"] <= now:
            _drop(client, swarm, host)
            continue
        raw = client.get(request_key(swarm, host))
        if raw is None:
            continue
        try:
            answer = _answer(client, swarm, host, record, raw, ca, home, shared)
        except InvitationError as exc:
            log.warning("invitation of %s: request refused: %s", host, exc)
            client.delete(request_key(swarm, host))
            continue
        ttl_ms = max(1, int((record["expires"] - now) * 1000))
        client.set(answer_key(swarm, host), answer, px=ttl_ms)
        record["answered"] = True
        client.hset(invitations_key(swarm), host, json.dumps(record))
        answered.append(host)
        log.info("invitation of %s answered: admitted", host)
    return answered


def _answer(
    client: redis.Redis,
    swarm: str,
    host: str,
    record: dict,
    raw: bytes,
    ca: certificates.Authority,
    home: Path | None,
    shared: dict[str, str],
) -> bytes:
    if len(raw) > MAX_REQUEST_BYTES:
        raise InvitationError("over its size limit")
    body, _, tag = raw.rpartition(b" ")
    if not hmac.compare_digest(tag, _tag(record["secret"], body)):
        raise InvitationError("not made with the invitation's secret")
    try:
        request = json.loads(body)
        key, sealing, address = request["key"], request["sealing"], request["address"]
        tls_key = serialization.load_pem_public_key(request["tls"].encode())
        if request["host"] != host or not isinstance(tls_key, ec.EllipticCurvePublicKey):
            raise ValueError("another host's request, or a TLS key of another kind")
        sealing_key = identity.sealing_public_key(sealing)
        cert = certificates.certify(ca, tls_key, [address], days=certificates.HOST_DAYS)
        roster.admit(client, swarm, host, key, sealing, home)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvitationError(str(exc).splitlines()[0] if str(exc) else "malformed") from None
    content = {
        "cert": cert.decode(),
        "ca": ca.cert.read_text(),
        "layers": record.get("layers"),
        "shared": shared,
    }
    sealed = datakeys.seal(
        json.dumps(content).encode(), sealing_key, ANSWER_INFO, credentials.scope(swarm, host)
    )
    signer = roster.coordinator(home)
    return signer.sign(ANSWER_CONTEXT + credentials.scope(swarm, host) + sealed) + sealed


# The new host's side.


@dataclass(frozen=True)
class Answer:
    """What host 0 answered: the host's certificate, the CA's, the layers it was invited to
    serve, and what every host still shares (file name: content)."""

    cert: str
    ca: str
    layers: str | None
    shared: dict[str, str]


def request(
    invitation: Invitation, signer: Signer, tls_key: ec.EllipticCurvePrivateKey, address: str
) -> bytes:
    """The request this host leaves: its public keys and address, with the HMAC under the
    invitation's secret."""
    tls = tls_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    body = json.dumps(
        {
            "host": invitation.host,
            "key": signer.public_hex,
            "sealing": identity.public_hex(signer.sealing),
            "address": address,
            "tls": tls.decode(),
        },
        sort_keys=True,
    ).encode()
    return body + b" " + _tag(invitation.secret, body)


def _tag(secret: str, body: bytes) -> bytes:
    """A request's HMAC-SHA256 under the invitation's secret (hex)."""
    return hmac.new(bytes.fromhex(secret), body, hashlib.sha256).hexdigest().encode()


def redeem(
    invitation: Invitation,
    signer: Signer,
    tls_key: ec.EllipticCurvePrivateKey,
    address: str,
    timeout_s: float = 60.0,
) -> Answer:
    """Leave this host's request on the registry and wait up to `timeout_s` for host 0's
    answer; InvitationError when the registry refuses the invitation (used, expired, revoked),
    cannot be reached, or the answer does not check out."""
    url = _bootstrap_url(invitation)
    client = redis.Redis.from_url(url, socket_connect_timeout=10, socket_timeout=10)
    try:
        client.set(
            request_key(invitation.swarm, invitation.host),
            request(invitation, signer, tls_key, address),
        )
        deadline = time.monotonic() + timeout_s
        while True:
            raw = client.getdel(answer_key(invitation.swarm, invitation.host))
            if raw is not None:
                return _opened(invitation, signer.sealing, raw)
            if time.monotonic() >= deadline:
                raise InvitationError(
                    f"no answer from host 0 in {timeout_s:g} s: is its beat running?"
                )
            time.sleep(WAIT_EVERY_S)
    except redis.AuthenticationError:
        raise InvitationError(
            "the registry refuses this invitation: it was used, expired or withdrawn"
        ) from None
    except redis.RedisError as exc:
        raise InvitationError(
            f"cannot reach the registry at {invitation.registry}: {exc}"
        ) from None
    finally:
        client.close()


def _bootstrap_url(invitation: Invitation) -> str:
    """The registry's address as the invitation's user. Over TLS, the server is not verified on
    this link (the CA comes with the answer): nothing on it is of use to another."""
    name = user(invitation.swarm, invitation.host)
    url = credentials.with_user(invitation.registry, name, password(invitation.secret))
    return url + "?ssl_cert_reqs=none" if url.startswith("rediss://") else url


def _opened(invitation: Invitation, sealing: X25519PrivateKey, raw: bytes) -> Answer:
    coordinator, _ = identity.pinned(invitation.pin)
    signature, sealed = raw[: identity.SIGNATURE_BYTES], raw[identity.SIGNATURE_BYTES :]
    associated = credentials.scope(invitation.swarm, invitation.host)
    if not identity.verifies(coordinator, signature, ANSWER_CONTEXT + associated + sealed):
        raise InvitationError("the answer is not signed by the coordinator the invitation names")
    try:
        content = json.loads(datakeys.open_sealed(sealed, sealing, ANSWER_INFO, associated))
        answer = Answer(content["cert"], content["ca"], content["layers"], content["shared"])
    except (ValueError, KeyError, TypeError):
        raise InvitationError("the answer does not open with this host's sealing key") from None
    if ca_fingerprint(answer.ca.encode()) != invitation.ca_sha256:
        raise InvitationError("the answer's CA is not the one the invitation names")
    return answer


def keep(
    invitation: Invitation,
    answer: Answer,
    tls_key: ec.EllipticCurvePrivateKey,
    home: Path,
    tls_dir: Path,
) -> str:
    """What the answer brought, kept for this host's processes: its TLS key, certificate, CA
    copy and the coordinator's pin in `tls_dir`, what every host shares in `home` (mode 0600),
    and the swarm's name and registry in `home`'s `joined.json`. The registry URL kept."""
    settings.write_private(tls_dir / settings.TLS_KEY_FILE, certificates.key_pem(tls_key))
    for name, text in (
        (settings.TLS_CERT_FILE, answer.cert),
        (settings.CA_CERT_FILE, answer.ca),
        (settings.COORDINATOR_PUB_FILE, invitation.pin + "\n"),
    ):
        (tls_dir / name).write_text(text)
    for name, text in answer.shared.items():
        if Path(name).name != name:
            raise InvitationError(f"the answer names a file outside the instance folder: {name!r}")
        settings.write_private(home / name, text + "\n")
    registry = invitation.registry
    if registry.startswith("rediss://"):
        registry += f"?ssl_ca_certs={quote(str(tls_dir / settings.CA_CERT_FILE))}"
    record = {"swarm": invitation.swarm, "registry_url": registry, "host": invitation.host}
    settings.write_private(home / settings.JOINED_FILE, json.dumps(record) + "\n")
    return registry
