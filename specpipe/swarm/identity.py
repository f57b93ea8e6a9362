"""Who is who in a swarm: each host's own signing key, and the roster of admitted hosts.

Every stage host signs with an Ed25519 key of its own (`settings.host_key_path`), and the
coordinator's host (host 0) with the coordinator key (`settings.coordinator_key_path`). The
coordinator key also signs the *roster*: the swarm's admitted hosts with their public keys and
a version number, kept on the registry at `specpipe:{swarm}:roster` and in host 0's instance
folder (`specpipe host admit|revoke`). Every host pins the coordinator's public key
(`settings.coordinator_public_key`), so:

- a message is believed to come from its sender only if that sender's key signed it: the
  coordinator's pinned key for what the coordinator sends, the roster's key for a stage host's
  (`specpipe.swarm.wire`);
- a node record is believed only when the roster's key for its host signed it
  (`specpipe.swarm.inventory`), so a revoked host's record is ignored at the next read of the
  inventory, and no host can write another's;
- a roster is believed only when the pinned coordinator key signed it, for this swarm, with a
  version no lower than the highest this process has seen (an old roster that still lists a
  revoked host cannot be played back).

The swarm key still seals every message (what a Redis holds stays unreadable to it); these
signatures say which host, among those that hold it, wrote what. A process that pins no
coordinator key does not start (`specpipe.swarm.trust.check_pinned`), unless its operator opted
out out loud (`SPECPIPE_INSECURE_SHARED_KEY=1`): it then trusts every holder of the swarm key
alike, as before per-host keys (a `Keyring` without `coordinator`). `specpipe up` and the lab
always pin one.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

import redis
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

SIGNATURE_BYTES = 64
PUBLIC_KEY_HEX = 64  # an Ed25519 public key is 32 bytes
ROSTER_CONTEXT = b"specpipe roster v1\x00"
MAX_ROSTER_BYTES = 1024 * 1024
MAX_HOST_NAME = 256
COORDINATOR = "coordinator"  # the signer name of what host 0's coordinator sends; never a host


class IdentityError(ValueError):
    """A key or a roster that cannot be read, or that does not verify."""


@dataclass(frozen=True)
class Signer:
    """A name and the private key it signs with: a stage host, or the coordinator; with the
    X25519 key its copies of the data keys are sealed to (`specpipe.swarm.datakeys`), if any."""

    name: str
    key: Ed25519PrivateKey = field(repr=False)
    sealing: X25519PrivateKey | None = field(default=None, repr=False, compare=False)

    def sign(self, data: bytes) -> bytes:
        return self.key.sign(data)

    @property
    def public_hex(self) -> str:
        return public_hex(self.key)


def public_hex(key: Ed25519PrivateKey | X25519PrivateKey) -> str:
    """The public half of a signing or sealing key, as the 64 hex digits a roster and
    `coordinator.pub` hold."""
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return raw.hex()


def public_key(text: str) -> Ed25519PublicKey:
    """A public key from its 64 hex digits; IdentityError for anything else."""
    return _public(text, Ed25519PublicKey, "a public key")


def _public(text: str, kind: type, what: str):
    text = text.strip()
    if len(text) != PUBLIC_KEY_HEX:
        raise IdentityError(f"{what} is 64 hex digits")
    try:
        return kind.from_public_bytes(bytes.fromhex(text))
    except ValueError:
        raise IdentityError(f"{what} is 64 hex digits") from None


def pin_text(coordinator: Signer) -> str:
    """What `coordinator.pub` holds: the coordinator's public signing key, and its public
    sealing key after a space (what stage hosts derive their registry passwords with)."""
    if coordinator.sealing is None:
        return coordinator.public_hex
    return f"{coordinator.public_hex} {public_hex(coordinator.sealing)}"


def pinned(text: str) -> tuple[Ed25519PublicKey, X25519PublicKey | None]:
    """The coordinator's public signing key and, when the pin has one, its sealing key, from
    what `coordinator.pub` holds; IdentityError for anything else."""
    fields = text.split()
    if len(fields) not in (1, 2):
        raise IdentityError("a coordinator pin is one or two keys of 64 hex digits")
    sealing = sealing_public_key(fields[1]) if len(fields) == 2 else None
    return public_key(fields[0]), sealing


def verifies(key: Ed25519PublicKey, signature: bytes, data: bytes) -> bool:
    try:
        key.verify(bytes(signature), data)
    except InvalidSignature:
        return False
    return True


def sealing_public_key(text: str) -> X25519PublicKey:
    """A sealing (X25519) public key from its 64 hex digits; IdentityError for anything else."""
    return _public(text, X25519PublicKey, "a sealing key")


def load_private(path: Path, kind: type = Ed25519PrivateKey):
    """The private key of type `kind` (Ed25519, or X25519 for a sealing key) in the PEM file
    `path`; IdentityError (naming the file, never its contents) when it is missing or holds
    something else."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise IdentityError(f"cannot read the key file {path}: {exc.strerror}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise IdentityError(f"{path} holds no readable private key") from None
    if not isinstance(key, kind):
        name = "X25519" if kind is X25519PrivateKey else "Ed25519"
        raise IdentityError(f"{path} holds a key of another kind than {name}")
    return key


def ensure_private(path: Path, kind: type = Ed25519PrivateKey):
    """The key of type `kind` in `path`, made there (mode 0600) when there is none."""
    from specpipe.settings import write_private

    if path.exists():
        return load_private(path, kind)
    key = kind.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    write_private(path, pem.decode())
    return key


def roster_key(swarm: str) -> str:
    return f"specpipe:{swarm}:roster"


@dataclass(frozen=True)
class Epoch:
    """One data key of the swarm's, as the roster carries it: its number, when it was made, and
    a copy sealed to each host (and to the coordinator) that may read what it seals
    (`specpipe.swarm.datakeys`); `until`, on the epoch before the current one, is when it stops
    being accepted."""

    number: int
    made: float
    copies: dict[str, str]  # name: the sealed copy, hex
    until: float | None = None

    def to_json(self) -> dict:
        body: dict = {"epoch": self.number, "made": self.made, "copies": self.copies}
        if self.until is not None:
            body["until"] = self.until
        return body


@dataclass(frozen=True)
class Roster:
    """The hosts the coordinator admitted to `swarm`, each with its public key (hex); with the
    sealing keys (X25519, hex) of those that have one, and the data key epochs: the current one
    that seals, and the one before it while it is still accepted."""

    swarm: str
    version: int
    hosts: dict[str, str]
    sealing: dict[str, str] = field(default_factory=dict)
    epoch: Epoch | None = None
    previous: Epoch | None = None

    def key_of(self, host: str) -> Ed25519PublicKey | None:
        """`host`'s public key; None when it is not admitted."""
        found = self.hosts.get(host)
        return public_key(found) if found is not None else None

    def to_json(self) -> str:
        """The one canonical encoding, which is what the coordinator signs."""
        body: dict = {"swarm": self.swarm, "version": self.version, "hosts": self.hosts}
        if self.sealing:
            body["sealing"] = self.sealing
        if self.epoch is not None:
            body["data_key"] = self.epoch.to_json()
        if self.previous is not None:
            body["previous_data_key"] = self.previous.to_json()
        return json.dumps(body, sort_keys=True, separators=(",", ":"))

    def admitting(self, host: str, key_hex: str, sealing_hex: str | None = None) -> Roster:
        """The next version, with `host` admitted under `key_hex` (its old key replaced), and
        under the sealing key `sealing_hex` when given."""
        check_host_name(host)
        public_key(key_hex)  # IdentityError if it is none
        sealing = {h: k for h, k in self.sealing.items() if h != host}
        if sealing_hex is not None:
            sealing_public_key(sealing_hex)
            sealing[host] = sealing_hex.strip().lower()
        hosts = {**self.hosts, host: key_hex.strip().lower()}
        admitted = replace(self, version=self.version + 1, hosts=hosts, sealing=sealing)
        if sealing.get(host) == self.sealing.get(host):
            return admitted
        # Copies sealed to a key the host no longer has open nothing: `datakeys` seals new ones.
        return replace(
            admitted, epoch=_without(self.epoch, host), previous=_without(self.previous, host)
        )

    def revoking(self, host: str) -> Roster:
        """The next version, without `host` (its copies of the data keys too: the data keys
        must still be rotated, `datakeys.rotated`, since it holds them); IdentityError when it
        is not admitted."""
        if host not in self.hosts:
            raise IdentityError(f"{host!r} is not admitted")
        return replace(
            self,
            version=self.version + 1,
            hosts={h: k for h, k in self.hosts.items() if h != host},
            sealing={h: k for h, k in self.sealing.items() if h != host},
            epoch=_without(self.epoch, host),
            previous=_without(self.previous, host),
        )

    def signed(self, coordinator: Signer) -> str:
        """The stored form: the coordinator's signature (hex), a space, the JSON."""
        record = self.to_json()
        return f"{coordinator.sign(_roster_message(record.encode())).hex()} {record}"

    @classmethod
    def verified(cls, value: bytes | str, swarm: str, coordinator: Ed25519PublicKey) -> Roster:
        """The roster a stored value holds; IdentityError unless the coordinator signed it for
        `swarm` and it is well formed."""
        raw = value if isinstance(value, bytes) else value.encode()
        if len(raw) > MAX_ROSTER_BYTES:
            raise IdentityError("the roster is over its size limit")
        tag, _, record = raw.partition(b" ")
        try:
            signature = bytes.fromhex(tag.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise IdentityError("the roster is not signed") from None
        if not verifies(coordinator, signature, _roster_message(record)):
            raise IdentityError("the roster is not signed by this swarm's coordinator")
        try:
            body = json.loads(record)
        except ValueError:
            raise IdentityError("the roster is not JSON") from None
        roster = _roster_of(body)
        if roster.swarm != swarm:
            raise IdentityError(f"a roster of swarm {roster.swarm!r}, not {swarm!r}")
        return roster

    @classmethod
    def empty(cls, swarm: str) -> Roster:
        return cls(swarm, 0, {})


def _without(epoch: Epoch | None, name: str) -> Epoch | None:
    """`epoch` without `name`'s copy."""
    if epoch is None:
        return None
    return replace(epoch, copies={n: c for n, c in epoch.copies.items() if n != name})


def _roster_message(record: bytes) -> bytes:
    return ROSTER_CONTEXT + record


def _roster_of(body) -> Roster:
    if not (
        isinstance(body, dict)
        and isinstance(body.get("swarm"), str)
        and _is_int(body.get("version"))
        and isinstance(body.get("hosts"), dict)
        and isinstance(body.get("sealing", {}), dict)
    ):
        raise IdentityError("the roster is malformed")
    hosts, sealing = body["hosts"], body.get("sealing", {})
    for host, key in hosts.items():
        check_host_name(host)
        if not isinstance(key, str):
            raise IdentityError("the roster is malformed")
        public_key(key)
    for host, key in sealing.items():
        if host not in hosts or not isinstance(key, str):
            raise IdentityError("the roster is malformed")
        sealing_public_key(key)
    return Roster(
        body["swarm"],
        body["version"],
        dict(hosts),
        dict(sealing),
        _epoch_of(body.get("data_key"), current=True),
        _epoch_of(body.get("previous_data_key"), current=False),
    )


def _epoch_of(body, current: bool) -> Epoch | None:
    """A data key epoch of a roster: the current one has no `until`, the previous one has."""
    if body is None:
        return None
    if not (
        isinstance(body, dict)
        and _is_int(body.get("epoch"))
        and body["epoch"] > 0
        and _is_number(body.get("made"))
        and isinstance(body.get("copies"), dict)
        and all(isinstance(n, str) and isinstance(c, str) for n, c in body["copies"].items())
    ):
        raise IdentityError("the roster's data keys are malformed")
    until = body.get("until")
    if current != (until is None) or not (until is None or _is_number(until)):
        raise IdentityError("the roster's data keys are malformed")
    return Epoch(body["epoch"], body["made"], dict(body["copies"]), until)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_host_name(host: str) -> None:
    """IdentityError for a name no host may have (empty, too long, or the coordinator's)."""
    if not isinstance(host, str) or not 0 < len(host) <= MAX_HOST_NAME:
        raise IdentityError(f"a host name has 1 to {MAX_HOST_NAME} characters")
    if host == COORDINATOR:
        raise IdentityError(f"{COORDINATOR!r} is the coordinator's name, not a host's")


# The newest roster each process has believed, per swarm and coordinator key: an older one that
# a Redis plays back (one that still lists a revoked host) is not believed again.
_newest: dict[tuple[str, bytes], Roster] = {}
_newest_lock = threading.Lock()


def read_roster(
    client: redis.Redis, swarm: str, coordinator: Ed25519PublicKey
) -> tuple[Roster, bool]:
    """The swarm's roster from the registry, and whether what the registry holds was believed:
    one the pinned coordinator key signed, not older than the newest seen here. When the
    registry holds none, or one that is not believed, the newest seen here (or an empty one)."""
    value = stored_roster(client, swarm)
    pinned = (swarm, coordinator.public_bytes_raw())
    with _newest_lock:
        newest = _newest.get(pinned)
        if value is None:
            return newest or Roster.empty(swarm), False
        try:
            roster = Roster.verified(value, swarm, coordinator)
        except IdentityError:
            return newest or Roster.empty(swarm), False
        if newest is not None and roster.version < newest.version:
            return newest, False
        _newest[pinned] = roster
        return roster, True


def stored_roster(client: redis.Redis, swarm: str) -> bytes | None:
    """What the registry holds under the roster's key; None for nothing, or for a key of
    another type put there (host 0 deletes it and publishes the roster again)."""
    try:
        return client.get(roster_key(swarm))
    except redis.ResponseError:
        return None


def publish_roster(client: redis.Redis, roster: Roster, coordinator: Signer) -> None:
    """Put `roster`, signed by the coordinator, on the registry."""
    client.set(roster_key(roster.swarm), roster.signed(coordinator))


def load_roster_file(path: Path, swarm: str, coordinator: Signer) -> Roster:
    """The roster host 0 keeps in `path` (its instance folder's copy); empty when none."""
    if not path.exists():
        return Roster.empty(swarm)
    return Roster.verified(path.read_text().strip(), swarm, coordinator.key.public_key())


def save_roster_file(path: Path, roster: Roster, coordinator: Signer) -> None:
    from specpipe.settings import write_private

    write_private(path, roster.signed(coordinator) + "\n")
