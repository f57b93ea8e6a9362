"""The wire format: round trips, and every way a message must be refused."""

import hashlib
import hmac
import struct
from dataclasses import replace

import msgpack
import pytest
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCMSIV
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from specpipe.swarm import wire

KEY = b"k" * 32
SWARM = "test"
ROUTE = (wire.RouteEntry("a", 0, 2, "toy"), wire.RouteEntry("b", 2, 4, "toy"))


def message(tensor=None, **fields):
    base = dict(
        kind="round",
        session="s1",
        round_id="r1",
        start_pos=7,
        n_draft=2,
        tokens=(5, 6, 7),
        hop=1,
        route=ROUTE,
    )
    base.update(fields)
    return wire.Message(tensor=tensor, **base)


def sign(plaintext: bytes, key: bytes = KEY) -> bytes:
    """`plaintext` sealed as any key holder could: whatever it says."""
    return wire.seal(plaintext, key)


def raw(header: dict, payload: bytes = b"") -> bytes:
    """The plaintext of a message: header length, header, payload, no sender's signature."""
    head = msgpack.packb({"dir": "stage", **header})
    return wire.HEAD_LEN.pack(len(head)) + head + payload + wire.NO_SIGNATURE


def opened(data: bytes, key: bytes = KEY) -> bytes:
    """The plaintext of a sealed message, opened under the data key derived here."""
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=wire.DATA_KEY_INFO)
    n = wire.PREFIX.size
    return AESGCMSIV(hkdf.derive(key)).decrypt(data[n - wire.NONCE_BYTES : n], data[n:], data[:n])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_round_trip_keeps_every_field_and_the_exact_tensor(dtype):
    tensor = (torch.randn(3, 5) * 100).to(dtype)
    sent = message(tensor)
    got = wire.decode(wire.encode(sent, SWARM, KEY), SWARM, KEY)
    assert got.tensor.dtype == dtype
    assert torch.equal(got.tensor, tensor)
    assert (got.kind, got.session, got.round_id) == ("round", "s1", "r1")
    assert (got.start_pos, got.n_draft, got.tokens, got.hop) == (7, 2, (5, 6, 7), 1)
    assert got.route == sent.route == ROUTE


def test_where_a_message_goes_and_its_sequence_travel_signed():
    sent = message(seq=123456789, to="specpipe:test:stage:b", sender="a")
    got = wire.decode(wire.encode(sent, SWARM, KEY), SWARM, KEY, to="specpipe:test:stage:b")
    assert (got.seq, got.to, got.sender, got.direction) == (123456789, sent.to, "a", "stage")
    reply = wire.Message(kind="result", session="s1", to="specpipe:test:reply:s1")
    assert wire.decode(wire.encode(reply, SWARM, KEY), SWARM, KEY).direction == "reply"


def test_a_message_copied_into_another_stream_is_refused():
    data = wire.encode(message(to="specpipe:test:stage:b"), SWARM, KEY)
    with pytest.raises(wire.WireError, match="not 'specpipe:test:reply:s1'"):
        wire.decode(data, SWARM, KEY, to="specpipe:test:reply:s1")


def test_a_kind_that_claims_the_other_direction_is_refused():
    data = sign(raw({"swarm": SWARM, "kind": "result", "dir": "stage"}))
    with pytest.raises(wire.WireError, match="must travel as 'reply'"):
        wire.decode(data, SWARM, KEY)


def test_a_keyring_signs_with_its_first_key_and_accepts_every_one():
    old, new = b"o" * 32, b"n" * 32
    from_old_host = wire.encode(message(), SWARM, old)
    ring = wire.Keyring([new, old])
    signed = wire.encode(message(), SWARM, ring)
    assert wire.decode(from_old_host, SWARM, ring).session == "s1"
    assert wire.decode(signed, SWARM, new).session == "s1"
    with pytest.raises(wire.UnknownKeyError):
        wire.decode(signed, SWARM, old)  # a host that has not got the new key yet


def test_sequence_numbers_increase_and_date_the_message():
    assert wire.next_seq(0, now=100.0) == 100_000_000
    assert wire.next_seq(100_000_000, now=100.0) == 100_000_001  # same microsecond
    assert wire.next_seq(200_000_000, now=100.0) == 200_000_001  # clock stepped back


def test_a_message_is_fresh_while_its_sender_waits_for_it():
    slack = wire.CLOCK_SLACK_S
    quick = wire.Message(kind="round", session="s", seq=100_000_000)  # stamped at t = 100 s
    assert wire.is_fresh(quick, now=100.0 + slack)
    assert not wire.is_fresh(quick, now=101.0 + slack)
    assert not wire.is_fresh(quick, now=99.0 - slack)  # from the future
    # A long round (a prefill's share of work, its tries) stays fresh for as long as its
    # sender waits, which may be far beyond any one constant: 1,000 s here.
    long = replace(quick, wait_ms=1_000_000)
    assert wire.is_fresh(long, now=100.0 + 1000 + slack)
    assert not wire.is_fresh(long, now=101.0 + 1000 + slack)
    assert not wire.is_fresh(long, now=99.0 - slack)  # its wait does not excuse the future


def test_the_wait_travels_signed_and_is_bounded():
    sent = wire.Message(kind="round", session="s", seq=1, wait_ms=330_000)
    assert wire.decode(wire.encode(sent, SWARM, KEY), SWARM, KEY).wait_ms == 330_000
    for bad in (-1, wire.MAX_WAIT_MS + 1):
        data = wire.encode(replace(sent, wait_ms=bad), SWARM, KEY)
        with pytest.raises(wire.WireError, match="wait_ms"):
            wire.decode(data, SWARM, KEY)


def test_round_trip_from_a_bytearray_and_a_memoryview():
    data = wire.encode(message(torch.arange(6, dtype=torch.int64).view(2, 3)), SWARM, KEY)
    for view in (bytearray(data), memoryview(data)):
        assert wire.decode(view, SWARM, KEY).tensor.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_message_without_tensor_and_with_params():
    sent = wire.Message(kind="reset", session="s", params={"temp": 0.7, "top_k": 40})
    got = wire.decode(wire.encode(sent, SWARM, KEY), SWARM, KEY)
    assert got.tensor is None and got.params == {"temp": 0.7, "top_k": 40}


def test_a_reset_or_drop_names_its_prefix_only_where_it_has_one():
    sent = wire.Message(kind="drop", session="s", prefix="prefix-1", start_pos=48)
    got = wire.decode(wire.encode(sent, SWARM, KEY), SWARM, KEY)
    assert (got.prefix, got.start_pos) == ("prefix-1", 48)
    plain = wire.Message(kind="drop", session="s")
    assert wire.decode(wire.encode(plain, SWARM, KEY), SWARM, KEY).prefix == ""
    assert len(wire.encode(plain, SWARM, KEY)) < len(wire.encode(sent, SWARM, KEY))


def test_payload_is_raw_little_endian_bytes_inside_the_ciphertext():
    tensor = torch.tensor([[1.0, -2.0]], dtype=torch.float32)
    data = wire.encode(message(tensor), SWARM, KEY)
    assert opened(data)[-wire.SIGNATURE_BYTES - 8 : -wire.SIGNATURE_BYTES] == struct.pack(
        "<2f", 1.0, -2.0
    )
    assert len(data) == wire.PREFIX.size + len(opened(data)) + wire.TAG_BYTES
    assert data[:4] == wire.MAGIC and data[4:8] == wire.key_id(KEY)


def test_nothing_of_the_header_or_the_payload_is_in_clear():
    tokens = (101, 202, 303, 404, 50_505, 606, 7, 8)
    tensor = torch.arange(1, 257, dtype=torch.float32).view(2, 128) * 3.25
    sent = message(tensor, tokens=tokens, session="a-distinctive-session-name")
    data = wire.encode(sent, SWARM, KEY)
    assert wire.decode(data, SWARM, KEY).tokens == tokens
    secrets = [
        msgpack.packb(list(tokens)),
        b"".join(msgpack.packb(t) for t in tokens[:4]),  # a run inside the list
        b"a-distinctive-session-name",
        msgpack.packb("a-distinctive-session-name"),
        tensor.numpy().tobytes(),
        tensor.numpy().tobytes()[:16],  # any four floats of it
        struct.pack("<4i", *tokens[:4]),
        struct.pack("<4q", *tokens[:4]),
        msgpack.packb(SWARM),
        b"round",
    ]
    for secret in secrets:
        assert secret not in data
    # A fresh nonce each time: the same message never reads the same twice.
    again = wire.encode(sent, SWARM, KEY)
    assert again != data and again[wire.PREFIX.size :] != data[wire.PREFIX.size :]
    assert again[:8] == data[:8] and again[8:20] != data[8:20]
    assert opened(again) == opened(data)


def test_the_data_key_is_derived_from_the_swarm_key_not_the_key_itself():
    data = wire.encode(message(), SWARM, KEY)
    n = wire.PREFIX.size
    with pytest.raises(InvalidTag):
        AESGCMSIV(KEY).decrypt(data[n - wire.NONCE_BYTES : n], data[n:], data[:n])
    plaintext = opened(data)[wire.HEAD_LEN.size : -wire.SIGNATURE_BYTES]
    assert msgpack.unpackb(plaintext)["session"] == "s1"


def test_a_flipped_bit_anywhere_is_refused():
    data = wire.encode(message(torch.ones(1, 2)), SWARM, KEY)
    for i in range(len(data)):
        for bit in range(8):
            changed = bytearray(data)
            changed[i] ^= 1 << bit
            with pytest.raises(wire.WireError):
                wire.decode(bytes(changed), SWARM, KEY)


@pytest.mark.parametrize(
    ("where", "reason"),
    [
        (0, "bad magic"),  # the magic
        (5, "unknown key"),  # the key id
        (9, "bad tag"),  # the nonce
        (wire.PREFIX.size, "bad tag"),  # the header length
        (wire.PREFIX.size + 8, "bad tag"),  # the header
        (-wire.TAG_BYTES - 1, "bad tag"),  # the payload
        (-1, "bad tag"),  # the tag
    ],
)
def test_tampering_with_each_part_is_refused_before_anything_is_parsed(where, reason):
    data = bytearray(wire.encode(message(torch.ones(2, 2)), SWARM, KEY))
    data[where] ^= 1
    with pytest.raises(wire.WireError, match=reason):
        wire.decode(bytes(data), SWARM, KEY)


def test_wrong_key_is_refused():
    data = wire.encode(message(torch.ones(1, 1)), SWARM, b"other key")
    with pytest.raises(wire.UnknownKeyError, match="unknown key"):
        wire.decode(data, SWARM, KEY)
    # The id of our key on a message sealed under another: the tag gives it away.
    forged = data[:4] + wire.key_id(KEY) + data[8:]
    with pytest.raises(wire.WireError, match="bad tag"):
        wire.decode(forged, SWARM, KEY)


def test_a_message_in_clear_is_refused():
    prefix = wire.PREFIX.pack(wire.MAGIC, wire.key_id(KEY), bytes(wire.NONCE_BYTES))
    body = prefix + raw({"swarm": SWARM, "kind": "round", "session": "s"})
    with pytest.raises(wire.WireError):
        wire.decode(body, SWARM, KEY)
    with pytest.raises(wire.WireError, match="bad tag"):
        wire.decode(body + b"\0" * wire.TAG_BYTES, SWARM, KEY)


def test_pickle_is_not_a_message():
    import pickle

    data = pickle.dumps({"kind": "round"})
    with pytest.raises(wire.WireError):
        wire.decode(data + b"\0" * 40, SWARM, KEY)


@pytest.mark.parametrize("cut", [1, wire.TAG_BYTES, 50])
def test_truncated_message_is_refused(cut):
    data = wire.encode(message(torch.ones(4, 4)), SWARM, KEY)
    with pytest.raises(wire.WireError):
        wire.decode(data[:-cut], SWARM, KEY)


def test_oversized_message_is_refused_before_anything_else():
    data = wire.encode(message(torch.ones(64, 64)), SWARM, KEY)
    with pytest.raises(wire.WireError, match="over the 1000 limit"):
        wire.decode(data, SWARM, KEY, max_bytes=1000)


def test_header_length_beyond_the_message_is_refused():
    data = sign(wire.HEAD_LEN.pack(10_000) + b"x" * 100)
    with pytest.raises(wire.WireError, match="header length"):
        wire.decode(data, SWARM, KEY)


def test_message_for_another_swarm_is_refused():
    data = wire.encode(message(), "other", KEY)
    with pytest.raises(wire.WireError, match="swarm"):
        wire.decode(data, SWARM, KEY)


@pytest.mark.parametrize("dtype", ["float64", "int32", "uint8", "object", None, 3])
def test_dtype_outside_the_whitelist_is_refused_even_when_signed(dtype):
    data = sign(raw({"swarm": SWARM, "kind": "round", "dtype": dtype, "shape": [2]}, b"\0" * 16))
    with pytest.raises(wire.WireError, match="dtype"):
        wire.decode(data, SWARM, KEY)


@pytest.mark.parametrize(
    "shape", [[3], [2, 3], [-1, 2], [], [1, 1, 1, 1, 4], "4", [1.5, 2], [True, 4], [0, 2**63]]
)
def test_shape_that_does_not_match_the_bytes_is_refused(shape):
    data = sign(
        raw({"swarm": SWARM, "kind": "round", "dtype": "float32", "shape": shape}, b"\0" * 16)
    )
    with pytest.raises(wire.WireError):
        wire.decode(data, SWARM, KEY)


def test_the_matching_shape_is_accepted():
    data = sign(
        raw({"swarm": SWARM, "kind": "round", "dtype": "float32", "shape": [2, 2]}, b"\0" * 16)
    )
    assert wire.decode(data, SWARM, KEY).tensor.shape == (2, 2)


@pytest.mark.parametrize(
    "header",
    [
        {"kind": "exec"},
        {"kind": "round", "tokens": ["a"]},
        {"kind": "round", "start_pos": -1},
        {"kind": "round", "start_pos": 2**63},
        {"kind": "round", "tokens": [2**40]},
        {"kind": "round", "start_pos": True},
        {"kind": "round", "route": [["a"]]},
        {"kind": "round", "route": [["a", "u"]], "hop": 1},
        {"kind": "reset", "params": {"temp": "hot"}},
        {"kind": "round", "session": 5},
        {"kind": "round", "seq": -1},
        {"kind": "round", "seq": "1"},
        {"kind": "round", "to": 5},
        {"kind": "drop", "prefix": 7},
        {"kind": "reset", "prefix": "p" * 257},
    ],
)
def test_malformed_header_fields_are_refused(header):
    data = sign(raw({"swarm": SWARM, **header}))
    with pytest.raises(wire.WireError):
        wire.decode(data, SWARM, KEY)


def test_signed_garbage_header_is_refused():
    data = sign(wire.HEAD_LEN.pack(3) + b"\xc1\xc1\xc1" + wire.NO_SIGNATURE)
    with pytest.raises(wire.WireError, match="msgpack"):
        wire.decode(data, SWARM, KEY)


def test_no_key_is_an_error_not_an_unsigned_message():
    with pytest.raises(wire.WireError, match="no swarm key"):
        wire.encode(message(), SWARM, b"")
    with pytest.raises(wire.WireError, match="no swarm key"):
        wire.decode(b"x" * 100, SWARM, b"")


def test_unsupported_tensor_dtype_cannot_be_sent():
    with pytest.raises(wire.WireError, match="dtype"):
        wire.encode(message(torch.ones(2, dtype=torch.float64)), SWARM, KEY)


def test_a_route_names_each_hops_host_layers_and_model_and_no_address():
    hops = (wire.RouteEntry("a", 0, 1, "toy"), wire.RouteEntry("c", 1, 4, ""))
    got = wire.decode(wire.encode(message(route=hops), SWARM, KEY), SWARM, KEY)
    assert got.route == hops and got.route[1].host == "c" and got.route[1].layer_start == 1
    plaintext = opened(wire.encode(message(), SWARM, KEY))[4 : -wire.SIGNATURE_BYTES]
    header = msgpack.unpackb(plaintext, raw=False)
    assert header["route"] == [["a", 0, 2, "toy"], ["b", 2, 4, "toy"]]  # sealed with the rest
    assert "reply" not in header  # replies go to the stage's own registry


@pytest.mark.parametrize(
    "route",
    [
        ["a", "b"],  # hosts only, as SPW3 had them
        [["a", "redis://specpipe:pw@h:1/0"]],
        [["a", 0, 2]],  # no model
        [["", 0, 2, "toy"]],
        [["a", 2, 2, "toy"]],  # an empty range
        [["a", 3, 2, "toy"]],
        [["a", -1, 2, "toy"]],
        [["a", 0, 2**17, "toy"]],
        [["a", True, 2, "toy"]],
        [["a", 0, 2, 5]],
        [["a", 0, 2, "toy", "extra"]],
        [["a" * 300, 0, 2, "toy"]],
    ],
)
def test_a_route_entry_that_is_not_host_layers_and_model_is_refused(route):
    data = sign(raw({"swarm": SWARM, "kind": "round", "route": route}))
    with pytest.raises(wire.WireError, match=r"route entries must be \[host, first layer"):
        wire.decode(data, SWARM, KEY)


def test_a_misrouted_reply_travels_to_the_coordinator():
    reply = wire.Message(kind="misrouted", session="s1", reason="b serves layers 1:4 of toy")
    got = wire.decode(wire.encode(reply, SWARM, KEY), SWARM, KEY)
    assert (got.kind, got.direction, got.reason) == ("misrouted", "reply", reply.reason)


def spw4(header: dict) -> bytes:
    """A message as SPW4 had it: signed with HMAC-SHA256, header and payload in clear."""
    head = msgpack.packb({"dir": "stage", **header})
    body = struct.pack("<4s4sI", b"SPW4", wire.key_id(KEY), len(head)) + head
    return body + hmac.new(KEY, body, hashlib.sha256).digest()


@pytest.mark.parametrize("magic", [b"SPW2", b"SPW3", b"SPW4", b"SPW5"])
def test_a_message_of_an_old_wire_format_is_refused_by_name(magic):
    # SPW2 carried each hop's Redis URL and the reply's, passwords included; SPW3 named hops
    # by host only, so a stage could not tell it was routed for layers it does not serve;
    # SPW4 was signed but in clear, for every Redis on the way to read; SPW5 carried no
    # signature of its sender's own.
    old = spw4({"swarm": SWARM, "kind": "round", "session": "s"})
    old = magic + old[4:]
    with pytest.raises(wire.WireError, match=f"wire format {magic.decode()} of an older version"):
        wire.decode(old, SWARM, KEY)


def test_an_empty_tensor_of_an_impossible_shape_is_refused():
    # Zero bytes match any shape with a zero in it; torch would raise on the other dimension.
    data = sign(raw({"swarm": SWARM, "kind": "round", "dtype": "float32", "shape": [0, 2**63]}))
    with pytest.raises(wire.WireError, match="bad shape"):
        wire.decode(data, SWARM, KEY)


def test_a_result_carries_log_probabilities_and_bad_ones_are_refused():
    reply = wire.Message(
        kind="result",
        session="s",
        to="r",
        tokens=(4, 7),
        logprobs=((-0.5, ((4, -0.5), (2, -1.25))), (-2.0, ())),
    )
    back = wire.decode(wire.encode(reply, "sw", b"k" * 32), "sw", b"k" * 32)
    assert back.logprobs == reply.logprobs
    plain = wire.decode(wire.encode(replace(reply, logprobs=()), "sw", b"k" * 32), "sw", b"k" * 32)
    assert plain.logprobs == ()
    too_many = replace(reply, tokens=(4,))
    with pytest.raises(wire.WireError, match="more log-probabilities"):
        wire.decode(wire.encode(too_many, "sw", b"k" * 32), "sw", b"k" * 32)


def test_a_tree_round_and_its_result_keep_their_tree_fields():
    sent = message(parents=(0, 0), keep=(0, 2, 3), head_shape=((0, 0), (0, 1), (1, 0)))
    got = wire.decode(wire.encode(sent, SWARM, KEY), SWARM, KEY)
    assert (got.parents, got.keep, got.head_shape) == ((0, 0), (0, 2, 3), sent.head_shape)
    plain = wire.decode(wire.encode(message(), SWARM, KEY), SWARM, KEY)
    assert (plain.parents, plain.keep, plain.head_shape) == (None, (), ())
    result = wire.Message(
        kind="result",
        session="s1",
        tokens=(4, 9, -1),
        drafts=(3, 5, 8),
        path=(0, 2),
        draft_parents=(0, 0, 1),
        ranks=(1, -1),
        batch=3,
    )
    back = wire.decode(wire.encode(result, SWARM, KEY), SWARM, KEY)
    assert (back.path, back.draft_parents, back.ranks) == ((0, 2), (0, 0, 1), (1, -1))
    assert back.batch == 3


def test_a_round_that_asks_for_taps_says_which_and_others_say_nothing():
    tapped = wire.decode(wire.encode(message(taps=(2, 18, 33)), SWARM, KEY), SWARM, KEY)
    assert tapped.taps == (2, 18, 33)
    plain = wire.encode(message(), SWARM, KEY)
    assert wire.decode(plain, SWARM, KEY).taps == ()
    assert b"taps" not in opened(plain)  # nothing extra where no drafter reads them


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"parents": [0, 2]}, "not a tree"),  # row 2 comes after draft 1
        ({"parents": [0]}, "a parent for each"),  # two drafts, one parent
        ({"parents": [0, 0], "tokens": [1, 5, 6, 7]}, "its root, its drafts"),
        ({"parents": [0, True]}, "row numbers"),
        ({"keep": [0, wire.MAX_TREE_ROWS]}, "row numbers"),
        ({"keep": [-1]}, "row numbers"),
        ({"keep": list(range(wire.MAX_TREE_ROWS + 1))}, "row numbers"),
        ({"head_shape": [[0, 0], [0, 0]]}, "not a tree"),  # two children of one rank
        ({"head_shape": [[0, 9]]}, "not a tree"),  # no such rank
        ({"head_shape": [[1, 0]]}, "not a tree"),  # a parent after its child
        ({"head_shape": [[0]]}, "pairs"),
        ({"head_shape": [[0, 0]] * (wire.MAX_HEAD_DRAFTS + 1)}, "pairs"),
        ({"draft_parents": [0, 0], "drafts": [3]}, "a parent for each draft"),
        ({"ranks": [-2]}, "row numbers"),
        ({"batch": -1}, "batch is out of range"),
        ({"batch": wire.MAX_BATCH + 1}, "batch is out of range"),
        ({"taps": [18, 2]}, "taps must be"),  # not in layer order
        ({"taps": [2, 2]}, "taps must be"),
        ({"taps": [-1]}, "taps must be"),
        ({"taps": [wire.LAYER_LIMIT]}, "taps must be"),
        ({"taps": [True]}, "taps must be"),
        ({"taps": list(range(wire.MAX_TAPS + 1))}, "taps must be"),
        ({"taps": "2,18"}, "wrong type"),
    ],
)
def test_a_malformed_tree_is_refused(fields, reason):
    header = {
        "swarm": SWARM,
        "kind": "round",
        "session": "s1",
        "start_pos": 7,
        "n_draft": 2,
        "tokens": [5, 6, 7],
        **fields,
    }
    with pytest.raises(wire.WireError, match=reason):
        wire.decode(sign(raw(header)), SWARM, KEY)
