"""Property tests: whatever comes in — from the wire, the inventory or an API client — gives a
clear error or a clean value, never an unhandled exception."""

from __future__ import annotations

import base64
import json
import math

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specpipe.settings import JobLimits
from specpipe.swarm import inventory, wire
from workers.broker import MalformedEntry, message_job_id
from workers.job_request import FIELDS, JobRequestError, parse_job_request
from workers.names import GENERATE_TASK

SWARM, KEY = "fuzz", b"k" * 32
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Values of every type msgpack and JSON carry, nested a little.
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what msgpack can carry
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
HEADER_KEYS = [
    "swarm",
    "kind",
    "session",
    "round_id",
    "start_pos",
    "n_draft",
    "tokens",
    "hop",
    "route",
    "reply",
    "reason",
    "params",
    "dtype",
    "shape",
]


def signed(header: dict, payload: bytes = b"") -> bytes:
    """A message any key holder could send: whatever header, properly framed and sealed."""
    head = msgpack.packb(header, use_bin_type=True)
    return wire.seal(wire.HEAD_LEN.pack(len(head)) + head + payload, KEY)


@FUZZ
@given(st.binary(max_size=512))
def test_any_bytes_decode_or_are_refused_with_a_wire_error(data):
    try:
        wire.decode(data, SWARM, KEY)
    except wire.WireError:
        pass


@FUZZ
@given(
    st.fixed_dictionaries(
        {"swarm": st.just(SWARM)}, optional={k: values for k in HEADER_KEYS if k != "swarm"}
    ),
    st.binary(max_size=64),
)
def test_any_signed_header_decodes_or_is_refused_with_a_wire_error(header, payload):
    try:
        message = wire.decode(signed(header, payload), SWARM, KEY)
    except wire.WireError:
        return
    assert message.kind in wire.KINDS
    assert all(isinstance(t, int) for t in message.tokens)


@FUZZ
@given(st.integers(min_value=0, max_value=200), st.integers(min_value=0, max_value=7))
def test_a_flipped_bit_in_a_real_message_is_refused(position, bit):
    message = wire.Message(
        kind="round", session="s", round_id="r", start_pos=3, n_draft=1, tokens=(1, 2)
    )
    data = bytearray(wire.encode(message, SWARM, KEY))
    data[position % len(data)] ^= 1 << bit
    try:
        wire.decode(bytes(data), SWARM, KEY)
    except wire.WireError:
        return
    raise AssertionError("a changed message was accepted")


node_fields = {
    "host": json_values,
    "layer_start": json_values,
    "layer_end": json_values,
    "redis_url": json_values,
    "model": json_values,
    "last_heartbeat": json_values,
    "role": json_values,
    "geo": json_values,
    "memory_bytes": json_values,
}


@FUZZ
@given(st.lists(st.fixed_dictionaries({}, optional=node_fields) | json_values, max_size=5))
def test_any_inventory_records_load_and_route_without_crashing(records):
    parsed = []
    for record in records:
        try:
            parsed.append(inventory.NodeInfo.from_json(json.dumps(record)))
        except ValueError:
            continue
    for node in parsed:
        assert isinstance(node.host, str) and isinstance(node.layer_start, int)
        assert math.isfinite(node.last_heartbeat)
        node.status()
        inventory.table([node])
    try:
        inventory.route(parsed, 4, model="m", now=0.0)
    except inventory.RouteError:
        pass


@FUZZ
@given(
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=len(FIELDS)),
    st.booleans(),
)
def test_any_job_request_is_clean_or_refused_field_by_field(raw, from_text):
    if from_text:  # a form sends text
        raw = {k: v if isinstance(v, str) else json.dumps(v) for k, v in raw.items()}
    try:
        clean = parse_job_request(raw, JobLimits(), from_text)
    except JobRequestError as exc:
        assert exc.errors and set(exc.errors) <= set(FIELDS)
        return
    assert set(clean) == set(FIELDS)
    assert 0 <= clean["temp"] <= 100 and 0 < clean["top_p"] <= 1
    assert 1 <= clean["max_new_tokens"] <= JobLimits().max_new_tokens


def generate_message(body) -> str:
    """A Celery message of the generate task whose body (base64 JSON) is `body`."""
    encoded = base64.b64encode(json.dumps(body).encode()).decode()
    return json.dumps({"headers": {"task": GENERATE_TASK}, "body": encoded})


broker_entries = (
    st.binary(max_size=256)
    | json_values.map(json.dumps)
    | json_values.map(generate_message)
    | json_values.map(lambda body: json.dumps([json.loads(generate_message(body)), "", "q"]))
)


@FUZZ
@given(broker_entries, st.booleans())
def test_any_broker_entry_gives_a_job_id_or_is_refused_as_malformed(raw, unacked):
    try:
        job_id = message_job_id(raw, unacked)
    except MalformedEntry:
        return
    assert job_id is None or type(job_id) is int
