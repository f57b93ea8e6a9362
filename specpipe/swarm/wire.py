"""The swarm's wire format: an encrypted msgpack header plus raw little-endian tensor bytes.

A message on the wire is

    MAGIC (4 bytes) | key id (4 bytes) | nonce (12 bytes) | ciphertext | tag (16 bytes)

where the ciphertext is `header length (u32 LE) | header (msgpack) | payload | signature (64
bytes)`, sealed with AES-256-GCM-SIV under the key the key id names, MAGIC, key id and nonce
being the associated data. That key is, on a swarm whose roster carries data keys
(`specpipe.swarm.datakeys`), the current epoch's data key, which the coordinator seals to each
admitted host and rotates when it revokes one (the previous epoch's is accepted until the
deadline the roster gives); else the swarm key's data key. Either way the AEAD key is derived
from it with HKDF-SHA256 under a fixed label. The signature is the sender's own
(`specpipe.swarm.identity`): Ed25519 over the swarm's name, the header and the payload's
SHA-256, by the coordinator's key or the sending stage host's. A keyring that pins the
coordinator's key (`Keyring.coordinator`) believes a message only when the key its sender's
name has there, the coordinator's or the roster's for that host, made that signature: holding
the data key, a host can still seal a message, but not one as the coordinator or another
host. Without such a pin (every holder of the swarm key trusted alike) the field is zeros and
not read. A `Keyring` holds the key that seals and the older ones still accepted while a new
key spreads. A Redis (its streams, its append-only file) holds no such key, so all it shows
of a message is its size, its stream and the id of its key.

Why AES-GCM-SIV: the nonce is 96 random bits per message, and every host of a swarm seals
under the same key for as long as the key lives. AES-GCM with a repeated nonce gives away the
XOR of two plaintexts and the key that forges tags; AES-GCM-SIV gives away only that the same
message was sent twice. Measured here (cryptography 50, OpenSSL 4, one core), sealing plus
opening a one-row message (3 KB) takes about 10 us with GCM-SIV against 2 us with GCM and
4.5 us with ChaCha20-Poly1305, well within 0.1 ms a hop; a 512-row prefill (1.2 MB) takes
about 3.2 ms against 0.2 ms and 0.6 ms (the HMAC-SHA256 it replaces took 1.2 ms), which a
prefill's compute dwarfs. The decode rounds that make up a generation pay the small figure.

The header names the swarm, where the message goes and what it is (the destination stream, the
direction, the sender), the session with its sequence number and round id, positions, the token
ids (with their log-probabilities on a tail's result, when the session asked for them), the
route (each hop as `[host, first layer, end layer, model]`: what the coordinator routed it
for, which the hop checks against what it serves; never an address or a credential: each
stage finds its next hop in the signed inventory, and replies go to its own registry) and the
payload's dtype and shape;
the payload is the tensor's bytes, nothing else. `decode` checks the size limits, and opens
the message (which checks its tag) before it parses anything of the header; then the dtype
whitelist and the shape-versus-byte-count before it reads the payload. A receiver passes
its own stream, so a message copied into another stream is refused; freshness (the sequence
number's date against the wait the message carries, both in swarm time, `is_fresh`) is the
receiver's to check.
No pickle, no code from the wire.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache

import msgpack
import numpy as np
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCMSIV
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from specpipe.core.tree import TreeShape, ancestor_paths
from specpipe.swarm import datakeys, identity

# SPW2 carried each hop's Redis URL, password included, and the reply's; SPW3 named each hop
# by host only, so a hop could not tell it was routed for layers it does not serve; SPW4 was
# signed but not encrypted: every Redis on the way could read prompts and hidden states; SPW5
# carried no signature of its sender's own, so any holder of the swarm key could speak as any.
MAGIC = b"SPW6"
OLD_MAGICS = frozenset({b"SPW2", b"SPW3", b"SPW4", b"SPW5"})
TAG_BYTES = 16  # the AEAD tag
KEY_ID_BYTES = 4
NONCE_BYTES = 12
PREFIX = struct.Struct("<4s4s12s")  # magic, key id, nonce: in clear, and authenticated
HEAD_LEN = struct.Struct("<I")  # the first field of the ciphertext
SIGNATURE_BYTES = identity.SIGNATURE_BYTES  # the last field of the ciphertext
NO_SIGNATURE = bytes(SIGNATURE_BYTES)
SIGNED_CONTEXT = b"specpipe wire message v6\x00"
DATA_KEY_INFO = b"specpipe swarm wire data key v1"
MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # a long prefill's hidden states fit; Redis allows 512 MiB
MAX_HEADER_BYTES = 1024 * 1024
MAX_DIMS = 4
MAX_DIM = 2**31  # of each tensor dimension
TOKEN_LIMIT = 2**31  # token ids (and the result vector's -1) fit in 32 bits
POSITION_LIMIT = 2**40
MAX_ALTERNATIVES = 5  # top log-probabilities per committed token on a result
MAX_HEAD_DRAFTS = 64  # drafts a round may ask of the tail's draft head for the next round
MAX_TREE_ROWS = MAX_HEAD_DRAFTS + 1  # a draft tree's rows: its root and its drafts
MAX_BATCH = 4096  # rounds a result may say its tail ran together
MAX_TAPS = 8  # layers a round may ask the stages to tap for the tail's drafter
LAYER_LIMIT = 4096  # a tapped layer's number is below this
MAX_LAYER = 2**16  # of a route entry's layer range
MAX_NAME = 256  # characters of a route entry's host or model, or of a prefix's name

# Kinds of message, by direction: what a stage's input stream carries (a round travelling
# through the stages and the per-session controls) and what a coordinator's reply stream does
# (the tail's result, and the replies a stage sends when it cannot go on: `misrouted` when the
# route has it for other layers or another model than it serves, `unreachable` when it could
# not pass the round on to its next hop).
STAGE_KINDS = frozenset({"round", "reset", "reseed", "keep", "drop"})
REPLY_KINDS = frozenset({"result", "gap", "error", "misrouted", "unreachable"})
KINDS = STAGE_KINDS | REPLY_KINDS
COORDINATOR = identity.COORDINATOR  # the sender of what a coordinator sends; a stage: its host
# A sequence number is swarm time in microseconds (`specpipe.swarm.clock`: the registry's clock
# as the sender estimates it; bumped to stay strictly increasing), so it also dates the message.
# Each message carries how long its sender waits for it (`wait_ms`: a round's share of work, its
# tries); a receiver refuses one read later than that after its date, or dated in the future,
# give or take CLOCK_SLACK_S for the error of the two ends' estimates and the link's jitter.
CLOCK_SLACK_S = 5.0
MAX_WAIT_MS = 6 * 3600 * 1000

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# numpy views of the payload's bytes; bfloat16 has no numpy type and travels as raw 16-bit words.
BYTE_VIEWS = {
    torch.float32: np.float32,
    torch.bfloat16: np.uint16,
    torch.float16: np.float16,
    torch.int64: np.int64,
}

if sys.byteorder != "little":  # the payload is the tensor's memory, sent as is
    raise ImportError("specpipe's wire format needs a little-endian machine")


class WireError(ValueError):
    """A message that must be dropped: malformed, oversized, unsealed or of the wrong shape."""


class UnknownKeyError(WireError):
    """A message sealed under a key the keyring does not hold (perhaps not yet)."""


class UnknownSenderError(WireError):
    """A message whose sender the keyring's roster does not admit (perhaps not yet)."""


@dataclass(frozen=True)
class Hop:
    """One stage on a route as a coordinator knows it: its host name, the address of the Redis
    that holds its input stream, and what it is routed for (layers `layer_start:layer_end` of
    `model`), with the tokens of KV cache it holds (0: no budget known). Its host, layers and
    model go on the wire, as a `RouteEntry`; the address and the budget stay with the
    coordinator."""

    host: str
    redis_url: str
    layer_start: int
    layer_end: int
    model: str
    kv_budget_tokens: int = 0


@dataclass(frozen=True)
class RouteEntry:
    """One hop of a round's route: the host, and the layers of the model it is routed for."""

    host: str
    layer_start: int
    layer_end: int
    model: str

    @classmethod
    def of(cls, hop) -> RouteEntry:
        """The entry of a hop (a `Hop` or an inventory record: anything with these fields)."""
        return cls(hop.host, hop.layer_start, hop.layer_end, hop.model)


@dataclass(frozen=True)
class Message:
    """One decoded message. `tensor` is the payload (hidden states), None when there is none.

    `seq` is the session's sequence number: the coordinator stamps each message it sends for a
    session with a larger one than the last (`next_seq`), a stage passes a round on with its
    number, and a reply carries the number of the round it answers."""

    kind: str
    session: str
    round_id: str = ""
    seq: int = 0
    to: str = ""  # the stream this message is for
    sender: str = ""  # COORDINATOR, or the host of the stage that sent it
    start_pos: int = 0
    n_draft: int = 0
    tokens: tuple[int, ...] = ()
    tensor: torch.Tensor | None = None
    hop: int = 0  # index into `route` of the stage this message is addressed to
    route: tuple[RouteEntry, ...] = ()  # the stages a round passes, in order
    params: dict[str, float | int] = field(default_factory=dict)  # reset/reseed: temp, ...
    reason: str = ""  # gap / error: what went wrong
    # result, when asked: per committed token, its log-probability and the most likely
    # alternatives as (id, log-probability)
    logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] = ()
    # round: how many drafts the tail's draft head proposes for the next round (0: none);
    # result: those drafts
    head_k: int = 0
    drafts: tuple[int, ...] = ()
    # round: a draft tree's parent row of each draft (None: a chain, `core.ring.Branches`), the
    # rows of the session's last tree to keep, and the tree the head proposes for the next round
    # as (parent, rank) per draft; result: the rows the tail walked, the parents of `drafts`
    # when they are a tree, and the ranks the head's candidates gave the committed tokens
    parents: tuple[int, ...] | None = None
    keep: tuple[int, ...] = ()
    head_shape: tuple[tuple[int, int], ...] = ()
    path: tuple[int, ...] = ()
    draft_parents: tuple[int, ...] = ()
    ranks: tuple[int, ...] = ()
    # result: the rounds of all sessions the tail's forward ran this one with (0: not said)
    batch: int = 0
    # round: the layers whose incoming hidden states the tail's drafter reads (an EAGLE-3
    # head's taps, in order); the tensor a stage passes on holds the round's hidden states,
    # then the states entering each of these layers before the next stage's first, side by side
    taps: tuple[int, ...] = ()
    # how long after `seq`'s date the sender still waits for this message to be served
    wait_ms: int = 0
    # reset: the kept prefix whose first `start_pos` positions the session starts from; keep,
    # drop: the name to keep the session's first `start_pos` positions under ("": none)
    prefix: str = ""

    @property
    def direction(self) -> str:
        """ "stage" for what goes to a stage's input stream, "reply" for a coordinator's."""
        return "reply" if self.kind in REPLY_KINDS else "stage"


def next_seq(last: int, now: float | None = None) -> int:
    """A sequence number after `last`: `now` (swarm time; None: this host's clock) in
    microseconds, or `last + 1` if that is not larger (two messages in one microsecond, or a
    clock stepped back)."""
    clock = int((time.time() if now is None else now) * 1_000_000)
    return max(last + 1, clock)


def is_fresh(message: Message, now: float | None = None) -> bool:
    """Whether `message` is read while its sender still waits for it: no later than its
    `wait_ms` after the date its sequence number carries, and not dated in the future, at `now`
    (swarm time; None: this host's clock), each give or take `CLOCK_SLACK_S`."""
    age_s = (time.time() if now is None else now) - message.seq / 1_000_000
    return -CLOCK_SLACK_S <= age_s <= message.wait_ms / 1000 + CLOCK_SLACK_S


def key_id(key: bytes) -> bytes:
    """The id a message carries of the key that sealed it: a hash, so it tells nothing of it."""
    return hashlib.sha256(b"specpipe swarm key id\0" + key).digest()[:KEY_ID_BYTES]


class Keyring:
    """What one process seals, signs and believes with.

    The swarm keys: the first seals, every one is accepted (while a new key spreads through a
    swarm, `specpipe key rotate`, hosts seal with it and still accept the old one until its
    grace period ends). With identities (`specpipe.swarm.identity`): `signer`, the key this
    process signs as (its host, or the coordinator), `coordinator`, the coordinator's public key
    it pins, and `roster`, the admitted hosts' keys as last read from the registry. A roster
    with data keys (`specpipe.swarm.datakeys`) replaces the swarm keys for messages: the signer
    opens its own copies, seals with the current epoch's key and accepts the previous one
    until its deadline; a signer without a copy seals nothing and opens nothing."""

    def __init__(
        self,
        keys: Iterable[bytes | str],
        *,
        signer: identity.Signer | None = None,
        coordinator: Ed25519PublicKey | None = None,
        roster: identity.Roster | None = None,
    ) -> None:
        encoded = [k.encode() if isinstance(k, str) else bytes(k) for k in keys]
        # With identities a host needs no swarm key: data keys seal, host keys sign.
        if (not encoded and coordinator is None) or not all(encoded):
            raise WireError("no swarm key: set SPECPIPE_SWARM_KEY")
        self.current = encoded[0] if encoded else None  # signs records without identities
        self.accepted = tuple(encoded)  # the sealing key first, then the old ones
        self.signer = signer
        self.coordinator = coordinator
        self.roster = roster
        # What seals and opens messages: (key, deadline or None), the sealing one first.
        sealing: tuple[tuple[bytes, float | None], ...] = tuple((k, None) for k in encoded)
        self.epoch = 0  # the data key epoch that seals (0: the swarm key does)
        if coordinator is not None and datakeys.uses_data_keys(roster):
            self.epoch = roster.epoch.number
            sealing = _opened(roster, signer)
        # Only the current epoch's key (or the swarm key) seals, never a previous one.
        self.sealing_key = next((k for k, until in sealing if until is None), None)
        self.sealing_id = key_id(self.sealing_key) if self.sealing_key is not None else b""
        self._by_id = {key_id(k): (k, until) for k, until in reversed(sealing)}

    def with_roster(self, roster: identity.Roster | None) -> Keyring:
        """This keyring with `roster` as the admitted hosts."""
        return Keyring(
            self.accepted, signer=self.signer, coordinator=self.coordinator, roster=roster
        )

    def sender_key(self, sender: str) -> Ed25519PublicKey | None:
        """The public key a message from `sender` must be signed with: the pinned coordinator's,
        or the roster's for a host; None when the sender is not admitted."""
        if sender == COORDINATOR:
            return self.coordinator
        return self.roster.key_of(sender) if self.roster is not None else None

    def get(self, kid: bytes, now: float | None = None) -> bytes | None:
        """The key with id `kid`, None if this keyring does not hold it or its deadline passed."""
        key, until = self._by_id.get(bytes(kid), (None, None))
        if until is not None and until <= (time.time() if now is None else now):
            return None
        return key

    def __len__(self) -> int:
        return len(self._by_id)


def _opened(roster: identity.Roster, signer: identity.Signer | None):
    """The data keys `signer` opens from `roster`, none when it has no copy (or no signer)."""
    if signer is None:
        return ()
    return datakeys.open_epochs(roster, signer.name, signer.sealing)


def keyring(keys: Keyring | bytes | str) -> Keyring:
    """`keys` as a Keyring: a single key is a ring of one."""
    return keys if isinstance(keys, Keyring) else Keyring([keys])


@lru_cache(maxsize=16)
def _cipher(key: bytes) -> AESGCMSIV:
    """The AEAD under the data key of swarm key `key`, derived once per key."""
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=DATA_KEY_INFO)
    return AESGCMSIV(hkdf.derive(key))


def seal(plaintext: bytes, keys: Keyring | bytes | str) -> bytes:
    """`plaintext` (header length, header, payload) as a message sealed under the keyring's
    sealing key (the current data key epoch's, else the swarm key), with a fresh random nonce."""
    keys = keyring(keys)
    if keys.sealing_key is None:
        raise WireError(f"no copy of data key epoch {keys.epoch} for this process's sealing key")
    prefix = PREFIX.pack(MAGIC, keys.sealing_id, os.urandom(NONCE_BYTES))
    return prefix + _cipher(keys.sealing_key).encrypt(prefix[-NONCE_BYTES:], plaintext, prefix)


def encode(message: Message, swarm: str, keys: Keyring | bytes | str) -> bytes:
    """Serialise `message` for `swarm` and seal it under the keyring's current key."""
    keys = keyring(keys)
    if message.kind not in KINDS:
        raise WireError(f"unknown message kind {message.kind!r}")
    header = _header(message, swarm)
    tensor_fields, payload = _payload(message.tensor)
    header.update(tensor_fields)
    head = msgpack.packb(header, use_bin_type=True)
    if len(head) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(head)} bytes is over the {MAX_HEADER_BYTES} limit")
    size = PREFIX.size + HEAD_LEN.size + len(head) + len(payload) + SIGNATURE_BYTES + TAG_BYTES
    if size > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {size} bytes is over the {MAX_MESSAGE_BYTES} limit")
    signature = _signature(keys, message.sender, swarm, head, payload)
    return seal(HEAD_LEN.pack(len(head)) + head + payload + signature, keys)


def _header(message: Message, swarm: str) -> dict:
    """The header's fields in their order on the wire: those every message carries, then the
    optional ones, each only where it is set."""
    header: dict = {
        "swarm": swarm,
        "to": message.to,
        "dir": message.direction,
        "from": message.sender,
        "kind": message.kind,
        "session": message.session,
        "seq": message.seq,
        "round": message.round_id,
        "start_pos": message.start_pos,
        "n_draft": message.n_draft,
        "tokens": list(message.tokens),
        "hop": message.hop,
        "route": [[e.host, e.layer_start, e.layer_end, e.model] for e in message.route],
        "params": dict(message.params),
        "reason": message.reason,
        "wait_ms": message.wait_ms,
    }
    if message.logprobs:  # only on the results of sessions that asked: others pay nothing
        header["logprobs"] = [
            [float(lp), [[int(i), float(a)] for i, a in top]] for lp, top in message.logprobs
        ]
    if message.head_k:  # like log-probabilities, only where asked
        header["head_k"] = message.head_k
    if message.drafts:
        header["drafts"] = list(message.drafts)
    header.update(_tree_header(message))
    if message.batch:
        header["batch"] = message.batch
    if message.taps:  # only where a drafter reads them: other rounds pay nothing
        header["taps"] = list(message.taps)
    if message.prefix:
        header["prefix"] = message.prefix
    return header


def _tree_header(message: Message) -> dict:
    """The draft-tree fields of a round or a result, only where there is a tree."""
    fields: dict = {}
    if message.parents is not None:
        fields["parents"] = list(message.parents)
    for name in ("keep", "path", "draft_parents", "ranks"):
        if getattr(message, name):
            fields[name] = list(getattr(message, name))
    if message.head_shape:
        fields["head_shape"] = [list(slot) for slot in message.head_shape]
    return fields


def _payload(tensor: torch.Tensor | None) -> tuple[dict, bytes | memoryview]:
    """The header's fields of a tensor (its dtype and shape) and its bytes; none without one."""
    if tensor is None:
        return {}, b""
    tensor = tensor.detach()
    if tensor.dtype not in DTYPE_NAMES:
        raise WireError(f"dtype {tensor.dtype} cannot be sent")
    if tensor.dim() > MAX_DIMS:
        raise WireError(f"a tensor of {tensor.dim()} dims cannot be sent")
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        tensor = tensor.cpu().contiguous()
    fields = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape)}
    return fields, _as_bytes(tensor)


def _signature(
    keys: Keyring, sender: str, swarm: str, head: bytes, payload: bytes | memoryview
) -> bytes:
    """The keyring's signer's signature of the message (zeros where it has no signer); it signs
    only as itself."""
    if keys.signer is None:
        return NO_SIGNATURE
    if keys.signer.name != sender:
        raise WireError(f"{keys.signer.name!r} cannot sign as {sender!r}")
    return keys.signer.sign(_signed(swarm, head, payload))


def _signed(swarm: str, head: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    """What a sender's signature covers: the swarm, the header and the payload's digest."""
    name = swarm.encode()
    digest = hashlib.sha256(payload).digest()
    return SIGNED_CONTEXT + len(name).to_bytes(4, "big") + name + bytes(head) + digest


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory, as a byte view (no copy: the plaintext is one)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)  # numpy has no bfloat16; the bits are what travel
    return memoryview(tensor.numpy().reshape(-1).view(np.uint8))


def decode(
    data: bytes,
    swarm: str,
    keys: Keyring | bytes | str,
    max_bytes: int = MAX_MESSAGE_BYTES,
    *,
    to: str | None = None,
) -> Message:
    """Open and parse one message for `swarm`; raise WireError with the reason to drop it.

    With `to`, the message must be addressed to that stream: a sealed message copied into
    another stream is refused."""
    keys = keyring(keys)
    plaintext = _unseal(_sized(data, max_bytes), keys)
    # Sealed by a key holder from here on; still parse defensively.
    (head_len,) = HEAD_LEN.unpack_from(plaintext)
    body_end = len(plaintext) - SIGNATURE_BYTES
    if head_len > MAX_HEADER_BYTES or HEAD_LEN.size + head_len > body_end:
        raise WireError("header length is out of bounds")
    head = plaintext[HEAD_LEN.size : HEAD_LEN.size + head_len]
    payload = memoryview(plaintext)[HEAD_LEN.size + head_len : body_end]
    signature = plaintext[body_end:]
    header = _parse_header(head)
    if header.get("swarm") != swarm:
        raise WireError(f"message for swarm {header.get('swarm')!r}, not {swarm!r}")
    if to is not None and header.get("to") != to:
        raise WireError(f"message for stream {header.get('to')!r}, not {to!r}")
    if keys.coordinator is not None:
        _check_signature(keys, header.get("from"), signature, _signed(swarm, head, payload))
    return _message(header, _tensor(header, payload))


def _sized(data: bytes, max_bytes: int) -> memoryview:
    """`data` as bytes, checked to be no larger than `max_bytes` and long enough for a prefix."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError("message is not bytes")
    view = memoryview(data).cast("B")
    if len(view) > max_bytes:
        raise WireError(f"message of {len(view)} bytes is over the {max_bytes} limit")
    if len(view) < PREFIX.size:
        raise WireError(f"message of {len(view)} bytes is too short")
    return view


def _unseal(view: memoryview, keys: Keyring) -> bytes:
    """The plaintext of a sealed message: its magic and its length checked, its key found by
    its id, its tag checked as it is opened."""
    magic, kid, nonce = PREFIX.unpack_from(view)
    if magic in OLD_MAGICS:
        raise WireError(f"wire format {magic.decode()} of an older version: upgrade the sender")
    if magic != MAGIC:
        raise WireError("not a specpipe message (bad magic)")
    if len(view) < PREFIX.size + HEAD_LEN.size + SIGNATURE_BYTES + TAG_BYTES:
        raise WireError(f"message of {len(view)} bytes is too short")
    key = keys.get(kid)
    if key is None:
        raise UnknownKeyError(f"sealed under an unknown key (id {kid.hex()})")
    try:
        return _cipher(key).decrypt(nonce, view[PREFIX.size :], view[: PREFIX.size])
    except InvalidTag:
        raise WireError("bad tag: altered, or not sealed under the key its id names") from None


def _parse_header(head: bytes) -> dict:
    """The header's msgpack map."""
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"header is not msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("header is not a map")
    return header


def _check_signature(keys: Keyring, sender, signature: bytes, signed: bytes) -> None:
    """WireError unless the key `sender` has in `keys` (the coordinator's, or the roster's for a
    host) made `signature`."""
    if not isinstance(sender, str):
        raise WireError("header field 'from' has the wrong type")
    key = keys.sender_key(sender)
    if key is None:
        raise UnknownSenderError(f"from {sender!r}, which the roster does not admit")
    if not identity.verifies(key, signature, signed):
        raise WireError(f"not signed by {sender!r}'s own key")


def _field(header: dict, name: str, kind: type, default):
    value = header.get(name, default)
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise WireError(f"header field {name!r} has the wrong type")
    return value


def _message(header: dict, tensor: torch.Tensor | None) -> Message:
    """The message a header (and its payload's tensor) describes, every field checked in turn."""
    kind = _kind(header)
    tokens = _token_ids(header)
    route = _route(_field(header, "route", list, []))
    params = _params(header)
    place = _place(header, len(route))
    head_k, drafts = _head_drafts(header)
    tree = _tree_fields(header, len(tokens), place["n_draft"], len(drafts))
    batch = _field(header, "batch", int, 0)
    if not 0 <= batch <= MAX_BATCH:
        raise WireError(f"batch is out of range (0 to {MAX_BATCH})")
    taps = _taps(header)
    prefix = _field(header, "prefix", str, "")
    if len(prefix) > MAX_NAME:
        raise WireError(f"a prefix's name has at most {MAX_NAME} characters")
    return Message(
        kind=kind,
        session=_field(header, "session", str, ""),
        round_id=_field(header, "round", str, ""),
        to=_field(header, "to", str, ""),
        sender=_field(header, "from", str, ""),
        tokens=tuple(tokens),
        tensor=tensor,
        route=route,
        params=params,
        reason=_field(header, "reason", str, ""),
        logprobs=_logprobs(_field(header, "logprobs", list, []), len(tokens)),
        head_k=head_k,
        drafts=tuple(drafts),
        batch=batch,
        taps=tuple(taps),
        prefix=prefix,
        **place,
        **tree,
    )


def _kind(header: dict) -> str:
    """The message's kind, which must travel in its own direction."""
    kind = _field(header, "kind", str, "")
    if kind not in KINDS:
        raise WireError(f"unknown message kind {kind!r}")
    direction = "reply" if kind in REPLY_KINDS else "stage"
    if header.get("dir") != direction:
        raise WireError(f"a {kind!r} message must travel as {direction!r}")
    return kind


def _token_ids(header: dict) -> list:
    """The token ids, each a 32-bit integer (the result vector's -1 included)."""
    tokens = _field(header, "tokens", list, [])
    if not all(
        isinstance(t, int) and not isinstance(t, bool) and -TOKEN_LIMIT <= t < TOKEN_LIMIT
        for t in tokens
    ):
        raise WireError("token ids must be 32-bit integers")
    return tokens


def _params(header: dict) -> dict:
    """A reset's or reseed's parameters: names to numbers."""
    params = _field(header, "params", dict, {})
    if not all(
        isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
        for k, v in params.items()
    ):
        raise WireError("params must map names to numbers")
    return params


def _place(header: dict, route_length: int) -> dict[str, int]:
    """Where the message stands: its positions, its hop on a route of `route_length`, its
    sequence number and how long its sender waits for it."""
    start_pos = _field(header, "start_pos", int, 0)
    n_draft = _field(header, "n_draft", int, 0)
    hop = _field(header, "hop", int, 0)
    seq = _field(header, "seq", int, 0)
    if not (0 <= start_pos < POSITION_LIMIT and 0 <= n_draft < TOKEN_LIMIT and 0 <= hop < 256):
        raise WireError("start_pos, n_draft or hop is out of range")
    if not 0 <= seq < 2**63:
        raise WireError("seq is out of range")
    wait_ms = _field(header, "wait_ms", int, 0)
    if not 0 <= wait_ms <= MAX_WAIT_MS:
        raise WireError(f"wait_ms is out of range (0 to {MAX_WAIT_MS})")
    if route_length and hop >= route_length:
        raise WireError("hop is beyond the route")
    return {"start_pos": start_pos, "n_draft": n_draft, "hop": hop, "seq": seq, "wait_ms": wait_ms}


def _head_drafts(header: dict) -> tuple[int, list]:
    """How many drafts a round asks of the tail's draft head, and those a result proposes."""
    head_k = _field(header, "head_k", int, 0)
    drafts = _field(header, "drafts", list, [])
    if not 0 <= head_k <= MAX_HEAD_DRAFTS or len(drafts) > MAX_HEAD_DRAFTS:
        raise WireError(f"a round asks for at most {MAX_HEAD_DRAFTS} head drafts")
    if not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < TOKEN_LIMIT for t in drafts
    ):
        raise WireError("draft ids must be 32-bit non-negative integers")
    return head_k, drafts


def _taps(header: dict) -> list:
    """The layers a round taps for the tail's drafter, in increasing order."""
    taps = _field(header, "taps", list, [])
    if (
        len(taps) > MAX_TAPS
        or not all(isinstance(k, int) and not isinstance(k, bool) for k in taps)
        or any(not 0 <= k < LAYER_LIMIT for k in taps)
        or list(taps) != sorted(set(taps))
    ):
        raise WireError(f"taps must be at most {MAX_TAPS} layer numbers in increasing order")
    return taps


def _rows(header: dict, name: str, limit: int, low: int = 0) -> tuple[int, ...]:
    values = _field(header, name, list, [])
    if len(values) > limit or not all(
        isinstance(v, int) and not isinstance(v, bool) and low <= v < MAX_TREE_ROWS for v in values
    ):
        raise WireError(f"{name} must be at most {limit} row numbers below {MAX_TREE_ROWS}")
    return tuple(values)


def _tree_fields(header: dict, n_tokens: int, n_draft: int, n_drafts: int) -> dict:
    """A round's or a result's draft-tree fields, checked: a tree's parents name earlier rows
    of a round that is its root and drafts alone, the head's shape is a tree of ranks."""
    fields: dict = {
        "keep": _rows(header, "keep", MAX_TREE_ROWS),
        "path": _rows(header, "path", MAX_TREE_ROWS),
        "draft_parents": _rows(header, "draft_parents", MAX_HEAD_DRAFTS),
        "ranks": _rows(header, "ranks", MAX_TREE_ROWS, low=-1),
        "parents": None,
    }
    if "parents" in header:
        parents = _rows(header, "parents", MAX_TREE_ROWS - 1)
        if n_tokens != n_draft + 1 or len(parents) != n_draft:
            raise WireError("a tree round carries its root, its drafts and a parent for each")
        fields["parents"] = parents
    if fields["draft_parents"] and len(fields["draft_parents"]) != n_drafts:
        raise WireError("a proposed tree needs a parent for each draft")
    shape = _field(header, "head_shape", list, [])
    if len(shape) > MAX_HEAD_DRAFTS or not all(
        isinstance(slot, list)
        and len(slot) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in slot)
        for slot in shape
    ):
        raise WireError(f"head_shape must be at most {MAX_HEAD_DRAFTS} [parent, rank] pairs")
    try:
        for name in ("parents", "draft_parents"):
            if fields[name]:
                ancestor_paths(fields[name])
        if shape:
            TreeShape(tuple(p for p, _ in shape), tuple(r for _, r in shape))
    except ValueError as exc:
        raise WireError(f"not a tree: {exc}") from None
    fields["head_shape"] = tuple((p, r) for p, r in shape)
    return fields


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _logprobs(entries: list, n_tokens: int) -> tuple:
    if len(entries) > n_tokens:
        raise WireError("more log-probabilities than tokens")
    out = []
    for entry in entries:
        if not (
            isinstance(entry, list)
            and len(entry) == 2
            and _is_number(entry[0])
            and isinstance(entry[1], list)
            and len(entry[1]) <= MAX_ALTERNATIVES
        ):
            raise WireError("log-probabilities must be [logprob, [[id, logprob], ...]]")
        top = []
        for pair in entry[1]:
            if not (
                isinstance(pair, list)
                and len(pair) == 2
                and isinstance(pair[0], int)
                and not isinstance(pair[0], bool)
                and 0 <= pair[0] < TOKEN_LIMIT
                and _is_number(pair[1])
            ):
                raise WireError("an alternative must be [id, logprob]")
            top.append((pair[0], float(pair[1])))
        out.append((float(entry[0]), tuple(top)))
    return tuple(out)


def _route(entries: list) -> tuple[RouteEntry, ...]:
    route = []
    for entry in entries:
        if not (
            isinstance(entry, list)
            and len(entry) == 4
            and _is_name(entry[0], empty=False)
            and isinstance(entry[1], int)
            and isinstance(entry[2], int)
            and not isinstance(entry[1], bool)
            and not isinstance(entry[2], bool)
            and 0 <= entry[1] < entry[2] <= MAX_LAYER
            and _is_name(entry[3], empty=True)
        ):
            raise WireError("route entries must be [host, first layer, end layer, model]")
        route.append(RouteEntry(*entry))
    return tuple(route)


def _is_name(value, empty: bool) -> bool:
    return isinstance(value, str) and (empty or value != "") and len(value) <= MAX_NAME


def _tensor(header: dict, payload: memoryview) -> torch.Tensor | None:
    if "dtype" not in header and "shape" not in header:
        if len(payload):
            raise WireError("payload without dtype and shape")
        return None
    name = header.get("dtype")
    if not isinstance(name, str) or name not in DTYPES:
        raise WireError(f"dtype {name!r} is not allowed")
    shape = header.get("shape")
    if (
        not isinstance(shape, list)
        or not 1 <= len(shape) <= MAX_DIMS
        or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < MAX_DIM for d in shape
        )
    ):
        raise WireError(f"bad shape {shape!r}")
    dtype = DTYPES[name]
    expected = math.prod(shape) * dtype.itemsize
    if expected != len(payload):
        raise WireError(f"shape {shape} of {name} needs {expected} bytes, got {len(payload)}")
    if not expected:
        return torch.empty(shape, dtype=dtype)
    # A writable copy of the bytes, wrapped without another copy (numpy's path is the shorter).
    words = torch.from_numpy(np.frombuffer(bytearray(payload), dtype=BYTE_VIEWS[dtype]))
    return (words if words.dtype == dtype else words.view(dtype)).reshape(shape)
