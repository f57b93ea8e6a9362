"""The data keys that seal the swarm's messages, each sealed to the hosts that may read it.

Each host has, beside its signing key, an X25519 *sealing* key (`settings.sealing_key_path`,
mode 0600, made on first use); host 0 has one for the coordinator. The roster carries each
admitted host's sealing public key, and the data key of the current *epoch*: 32 random bytes
that the coordinator makes and seals to the coordinator and to every admitted host's sealing
key, one copy each (`Epoch`). The roster is signed by the coordinator and never goes back to an
older version, so a host believes only the coordinator's data keys, and only the newest.

Every process opens its own copy (`open_epochs`) and seals with the current epoch's key; the
previous epoch's stays accepted until the time the roster gives (`until`), so the rounds in
flight when a rotation spreads are not lost. `specpipe host revoke` rotates: the new epoch is
sealed to the remaining hosts only, and the revoked host's copies of the previous one are gone
from the roster. So a revoked host can open nothing sealed once the senders have taken the new
roster (a stage at its next heartbeat, a coordinator at its next roster read); what it held
before, it keeps. Host 0's beat rotates once the current epoch is `SPECPIPE_DATA_KEY_EPOCH_S`
old (`due`), `specpipe host rotate` at once.

A copy is sealed as ECIES: an ephemeral X25519 key, its shared secret with the host's key
through HKDF-SHA256 (salted with both public keys), and ChaCha20-Poly1305 with the swarm, the
host's name and the epoch as associated data, so a copy moved to another host, swarm or epoch
does not open. Each copy's key is used once, so its nonce is fixed.

The data key shared by the admitted hosts is inherent to a ring where every hop opens what the
hop before sealed: every admitted host can read what crosses any Redis during an epoch. What
the epochs give is that a host no longer admitted does not get the next one.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from specpipe.swarm.identity import COORDINATOR, Epoch, IdentityError, Roster, sealing_public_key

DATA_KEY_BYTES = 32
COPY_INFO = b"specpipe data key copy v1"
COPY_CONTEXT = b"specpipe data key v1\x00"
COPY_BYTES = 32 + DATA_KEY_BYTES + 16  # the ephemeral public key, the sealed key, its tag
ZERO_NONCE = bytes(12)  # each copy's key seals one thing only
DEFAULT_GRACE_S = 300.0  # how long the epoch before a rotation stays accepted


def _raw(key: X25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _associated(swarm: str, name: str, epoch: int) -> bytes:
    parts = [swarm.encode(), name.encode()]
    sized = b"".join(len(p).to_bytes(4, "big") + p for p in parts)
    return COPY_CONTEXT + sized + epoch.to_bytes(8, "big")


def _cipher(shared: bytes, ephemeral: bytes, recipient: bytes, info: bytes) -> ChaCha20Poly1305:
    hkdf = HKDF(hashes.SHA256(), length=32, salt=ephemeral + recipient, info=info)
    return ChaCha20Poly1305(hkdf.derive(shared))


def seal(data: bytes, recipient: X25519PublicKey, info: bytes, associated: bytes) -> bytes:
    """`data` sealed to `recipient` alone (ECIES: an ephemeral X25519 key, HKDF-SHA256 with
    `info`, ChaCha20-Poly1305 over `associated`): the ephemeral public key, then the
    ciphertext. Each seal's key is used once, so its nonce is fixed."""
    ephemeral = X25519PrivateKey.generate()
    mine, theirs = _raw(ephemeral.public_key()), _raw(recipient)
    cipher = _cipher(ephemeral.exchange(recipient), mine, theirs, info)
    return mine + cipher.encrypt(ZERO_NONCE, data, associated)


def open_sealed(blob: bytes, key: X25519PrivateKey, info: bytes, associated: bytes) -> bytes:
    """What `seal` sealed to `key`'s public half; ValueError when it does not open."""
    if len(blob) < 32 + 16:
        raise ValueError("too short to be sealed")
    ephemeral = blob[:32]
    try:
        shared = key.exchange(X25519PublicKey.from_public_bytes(ephemeral))
        cipher = _cipher(shared, ephemeral, _raw(key.public_key()), info)
        return cipher.decrypt(ZERO_NONCE, blob[32:], associated)
    except InvalidTag:
        raise ValueError("it was not sealed to this key, or was altered") from None


def seal_copy(
    data_key: bytes, recipient: X25519PublicKey, swarm: str, name: str, epoch: int
) -> str:
    """`data_key` sealed to `recipient` (the sealing key of host `name`, or the coordinator's)
    for `swarm`'s epoch `epoch`, as hex."""
    return seal(data_key, recipient, COPY_INFO, _associated(swarm, name, epoch)).hex()


def open_copy(copy: str, key: X25519PrivateKey, swarm: str, name: str, epoch: int) -> bytes:
    """The data key a copy sealed to `name` for `swarm`'s epoch `epoch` holds; IdentityError
    when it is malformed or was not sealed to `key` for that name, swarm and epoch."""
    try:
        blob = bytes.fromhex(copy)
    except ValueError:
        raise IdentityError("a data key copy is not hex") from None
    if len(blob) != COPY_BYTES:
        raise IdentityError("a data key copy has the wrong length")
    try:
        return open_sealed(blob, key, COPY_INFO, _associated(swarm, name, epoch))
    except ValueError:
        raise IdentityError(
            f"the data key copy of epoch {epoch} does not open for {name!r}"
        ) from None


def open_epochs(roster: Roster, name: str, key: X25519PrivateKey | None, now: float | None = None):
    """The data keys `name` (a host, or the coordinator) opens with its sealing key `key`, as
    (data key, until) pairs: the current epoch's (until None), then the previous one's while it
    is accepted; each only where the roster has a copy for `name` that opens with `key`."""
    now = time.time() if now is None else now
    opened = []
    for epoch in (roster.epoch, roster.previous):
        if epoch is None or key is None or name not in epoch.copies:
            continue
        if epoch.until is not None and epoch.until <= now:
            continue
        try:
            data_key = open_copy(epoch.copies[name], key, roster.swarm, name, epoch.number)
        except IdentityError:  # sealed to a key it no longer has: as good as none
            continue
        opened.append((data_key, epoch.until))
    return tuple(opened)


def uses_data_keys(roster: Roster | None) -> bool:
    """Whether the swarm's messages are sealed with the roster's data keys (else: the swarm
    key, as before every admitted host had a sealing key)."""
    return roster is not None and roster.epoch is not None


def _sealed_to_all(
    roster: Roster, data_key: bytes, number: int, coordinator: X25519PrivateKey
) -> dict[str, str]:
    recipients = {COORDINATOR: coordinator.public_key()}
    recipients.update({h: sealing_public_key(k) for h, k in roster.sealing.items()})
    return {n: seal_copy(data_key, k, roster.swarm, n, number) for n, k in recipients.items()}


def rotated(roster: Roster, coordinator: X25519PrivateKey, grace_s: float) -> Roster:
    """`roster` with a new epoch (a new random data key) sealed to the coordinator and every
    admitted host's sealing key; the current one becomes the previous one, accepted for
    `grace_s` more seconds (its copies only for hosts still admitted), and an older one is
    dropped. IdentityError when an admitted host has no sealing key: it could not read."""
    missing = sorted(set(roster.hosts) - set(roster.sealing))
    if missing:
        raise IdentityError(
            f"no sealing key for {', '.join(missing)}: admit them again with the two keys "
            "`specpipe host key` prints there"
        )
    number = roster.epoch.number + 1 if roster.epoch is not None else 1
    copies = _sealed_to_all(roster, os.urandom(DATA_KEY_BYTES), number, coordinator)
    previous = None
    if roster.epoch is not None and grace_s > 0:
        kept = {n: c for n, c in roster.epoch.copies.items() if n == COORDINATOR or n in copies}
        previous = replace(roster.epoch, copies=kept, until=time.time() + grace_s)
    return replace(roster, epoch=Epoch(number, time.time(), copies), previous=previous)


def due(roster: Roster, every_s: float, now: float | None = None) -> bool:
    """Whether the current epoch is `every_s` old or older (0: never due)."""
    now = time.time() if now is None else now
    return every_s > 0 and roster.epoch is not None and now - roster.epoch.made >= every_s


def sealed_for_new_hosts(roster: Roster, coordinator: X25519PrivateKey) -> Roster:
    """`roster` with copies of its current (and previous) data key for each admitted host that
    has a sealing key but no copy yet (a host just admitted): the coordinator opens its own
    copy and seals it again; where it cannot (its sealing key made again), a new epoch. The
    first epoch is made once every admitted host has a sealing key; until then the roster
    stays as it is (the swarm key seals)."""
    if roster.epoch is None:
        if roster.hosts and set(roster.hosts) <= set(roster.sealing):
            return rotated(roster, coordinator, grace_s=0)
        return roster
    epochs = []
    for epoch in (roster.epoch, roster.previous):
        if epoch is None or (epoch.until is not None and epoch.until <= time.time()):
            epochs.append(None)
            continue
        try:
            data_key = open_copy(
                epoch.copies.get(COORDINATOR, ""),
                coordinator,
                roster.swarm,
                COORDINATOR,
                epoch.number,
            )
        except IdentityError:
            if epoch is roster.epoch:
                return rotated(roster, coordinator, DEFAULT_GRACE_S)
            epochs.append(None)  # the previous one is dropped, with its rounds in flight
            continue
        copies = dict(epoch.copies)
        for host, sealing in roster.sealing.items():
            if host not in copies:
                copies[host] = seal_copy(
                    data_key, sealing_public_key(sealing), roster.swarm, host, epoch.number
                )
        epochs.append(replace(epoch, copies=copies))
    return replace(roster, epoch=epochs[0], previous=epochs[1])
