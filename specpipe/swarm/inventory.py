"""The node inventory: who serves which layers, where its Redis is, and whether it is alive.

A record gives its host's Redis as an address without user or password: whoever dials it adds
credentials of its own (`specpipe.swarm.dialing`), so no record carries a secret, and one that
does is neither published nor believed.

Every stage worker publishes a `NodeInfo` as JSON into its own key `specpipe:{swarm}:node:{host}`
on the swarm's registry Redis (the only key its registry user may write,
`specpipe.swarm.credentials`) and refreshes it (its heartbeat) while it runs. A node is
*online* when its last heartbeat is at most 30 s old, *stale* up to 120 s, *offline* after
that. `route` builds a ring from the online nodes: stages that cover every layer exactly
once, in order.
Several hosts may serve the same range (spares): the route takes one whose heartbeat has not
*lapsed* (missed `LAPSE_BEATS` of the beats it promised, `heartbeat_s`), the first of those by
host name; a coordinator whose route has a lapsed hop re-routes around it. How fresh a record
says it is never decides between live replicas: that is the one thing a host writes about
itself, and a spare that dated its record ahead would win every route through its range.

A record's date is its host's word, which can only count against it: `read` believes a
heartbeat no later than it first read the record as stored now, so a record dated ahead is no
fresher than its reading, and one that stopped changing ages on the reader's clock.

Every heartbeat is dated, and every age judged, in swarm time: the registry Redis's clock as
each process estimates it (`specpipe.swarm.clock`), never a host's own, so a stage whose clock
is off by any amount is neither taken for dead nor kept alive past its death. A record stamped
on the registry's clock also says how far its host's own is off it (`clock_offset_s`).

Records are signed. With host identities (a keyring that pins the coordinator's key,
`specpipe.swarm.identity`) each value is `ed25519:<signature hex> <record JSON>`, signed by the
host's own key over the swarm's name and the record's exact bytes, and a reader believes it only
when the roster (which `read` fetches with the records) admits that host under that key: no
host can write another's record, and a revoked host's record is ignored from the next read on.
Without them each value is `<HMAC-SHA256 hex> <record JSON>`, the tag computed with the swarm
key. `read` checks the signature (the tag in constant time) before it parses anything, and
ignores, and counts, every record that is unsigned, forged, of a host not admitted, filed under
another host's name, malformed, or dated more than `MAX_AHEAD_S` ahead of swarm time (such a
record would stay alive past its host's death). Routing never raises on a bad record.
Public IP and geo label come from configuration; nothing here asks the internet.
A record says how its stage's tail samples (`sampler`): `EXACT_SAMPLER` for the product's
lossless samplers, which records from before the field read as; any other (a test double that
a test installed) shows wherever the inventory does, as output that is NOT lossless.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import platform
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

import redis

from specpipe import __version__
from specpipe.swarm import identity, latency
from specpipe.swarm.clock import SwarmClock
from specpipe.swarm.redact import has_credentials, redact_url
from specpipe.swarm.values import text
from specpipe.swarm.wire import Keyring

# How a stage whose tail samples with the product's lossless samplers says so in its record.
EXACT_SAMPLER = "exact"
ONLINE_S = 30.0
STALE_S = 120.0
# A heartbeat dated further ahead of swarm time is not believed: more than the error of the
# writer's estimate of the registry's clock and the reader's together.
MAX_AHEAD_S = 2.0
# A node that missed this many of its beats (and at least LAPSE_MIN_S) is taken for dead by a
# coordinator with a spare at hand; its stage heartbeats from a thread of its own, so a long
# forward does not hold a beat up.
LAPSE_BEATS = 3
LAPSE_MIN_S = 1.0
_MAC_CONTEXT = b"specpipe inventory record v1\x00"
_SIGNED_CONTEXT = b"specpipe inventory record v2\x00"
_SIGNED_TAG = b"ed25519:"
# One swarm key, those a rotation accepts, or a keyring (with host identities when it pins the
# coordinator's key).
Keys = bytes | str | Sequence[bytes | str] | Keyring


def heartbeat_status(age_s: float) -> str:
    """online (heard from within ONLINE_S), stale (within STALE_S) or offline."""
    if age_s <= ONLINE_S:
        return "online"
    return "stale" if age_s <= STALE_S else "offline"


def node_key(swarm: str, host: str) -> str:
    """The key holding host `host`'s record (`host` "*": the pattern of every host's)."""
    return f"specpipe:{swarm}:node:{host}"


def record_keys(client: redis.Redis, swarm: str, roster: identity.Roster | None) -> list[str]:
    """The keys of the records to read: every one on the registry where this process may list
    keys (host 0's), else those of the hosts `roster` admits (a stage host's registry user reads
    records by name only)."""
    try:
        return sorted(text(k) for k in client.scan_iter(match=node_key(swarm, "*"), count=1000))
    except redis.exceptions.NoPermissionError:
        if roster is None:
            raise
        return [node_key(swarm, host) for host in sorted(roster.hosts)]


class RouteError(RuntimeError):
    """The online stages cannot form a ring over every layer; `start:end` is the first range
    no online stage serves (where the ring cannot go on)."""

    def __init__(self, message: str, start: int = 0, end: int = 0) -> None:
        super().__init__(message)
        self.start, self.end = start, end


@dataclass(frozen=True)
class NodeInfo:
    """One stage host as the inventory records it. Layers are the half-open range start:end."""

    host: str
    layer_start: int
    layer_end: int
    redis_url: str  # the address of the host's Redis, without user or password
    role: str = ""  # stage0, stage1, …, tail
    model: str = ""
    public_ip: str = ""
    geo: str = ""
    gpu_name: str = "cpu"
    gpu_uuid: str = "cpu"
    cpu_model: str = ""
    memory_bytes: int = 0
    software_version: str = __version__
    last_heartbeat: float = 0.0
    heartbeat_s: float = 10.0  # the beat the node promises; older records beat every 10 s
    # The ring's latency as this stage sees it: the host its rounds go on to (or "coordinator"
    # from the tail), and the round trip of a PING to that hop's Redis, measured at a heartbeat.
    next_hop: str = ""
    next_hop_rtt_ms: float = 0.0
    kv_budget_tokens: int = (
        0  # tokens of KV cache across sessions (specpipe/swarm/kvbudget.py); 0: none
    )
    # The registry's clock less the host's own, as the host measured it (`SwarmClock.offset_s`):
    # its heartbeat is dated on the registry's clock whatever this is.
    clock_offset_s: float = 0.0
    # Drawn afresh each time the stage process starts: a record with another one than a route
    # holds is a process that restarted since, with none of the route's sessions in its caches.
    incarnation: str = ""
    # A tail's: the layers whose incoming hidden states its drafter reads, as "2,18,33" (an
    # EAGLE-3 head's taps; "": none). Every round through this tail asks the stages for them.
    draft_taps: str = ""
    # How its tail samples (`TailSampling.name`): any but EXACT_SAMPLER is NOT lossless.
    sampler: str = EXACT_SAMPLER

    @property
    def layers(self) -> str:
        """The layer range as `start:end`."""
        return f"{self.layer_start}:{self.layer_end}"

    def status(self, now: float | None = None) -> str:
        """online / stale / offline by the age of the last heartbeat at `now` (swarm time)."""
        return heartbeat_status((time.time() if now is None else now) - self.last_heartbeat)

    def lapse_s(self) -> float:
        """How long after its last heartbeat the node counts as lapsed."""
        return max(LAPSE_BEATS * self.heartbeat_s, LAPSE_MIN_S)

    def lapsed(self, now: float | None = None) -> bool:
        """Whether the node has missed LAPSE_BEATS of its promised heartbeats at `now` (swarm
        time)."""
        return (time.time() if now is None else now) - self.last_heartbeat > self.lapse_s()

    def tap_layers(self) -> tuple[int, ...]:
        """`draft_taps` as layer numbers; () when it holds none, or anything but increasing
        layer numbers."""
        try:
            taps = tuple(int(k) for k in self.draft_taps.split(",")) if self.draft_taps else ()
        except ValueError:
            return ()
        return taps if list(taps) == sorted(set(taps)) and all(k >= 0 for k in taps) else ()

    def to_json(self) -> str:
        """The record as JSON, in the one canonical encoding that is signed."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeInfo:
        """Parse a stored record, ignoring fields this version does not know; ValueError when
        it is not a record, or a field has the wrong type."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("a node record is a JSON object")
        values = {}
        for f in fields(cls):
            if f.name not in data:
                if f.default is MISSING:
                    raise ValueError(f"a node record needs {f.name!r}")
                continue
            values[f.name] = _checked(f.name, data[f.name], _FIELD_TYPES[f.name])
        return cls(**values)


_FIELD_TYPES = {
    f.name: {"int": int, "float": float, "bool": bool}.get(f.type, str) for f in fields(NodeInfo)
}


def _checked(name: str, value: object, kind: type) -> object:
    """`value` as a field of type `kind`; ValueError when it is something else."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok or (kind is float and not math.isfinite(value)):
        raise ValueError(f"node field {name!r} is not a valid {kind.__name__}")
    return value


def _well_formed(node: NodeInfo) -> bool:
    """Whether every field of `node` has its declared type (a NodeInfo built in code may not)."""
    try:
        for f in fields(NodeInfo):
            _checked(f.name, getattr(node, f.name), _FIELD_TYPES[f.name])
    except ValueError:
        return False
    return True


def taps_text(taps: Sequence[int]) -> str:
    """Layer numbers as a record's `draft_taps` holds them."""
    return ",".join(str(int(k)) for k in taps)


def inexact_nodes(nodes: Sequence[NodeInfo]) -> list[NodeInfo]:
    """The nodes among `nodes` that sample with anything but the exact samplers."""
    return [n for n in nodes if n.sampler != EXACT_SAMPLER]


def inexact_warning(nodes: Sequence[NodeInfo]) -> str:
    """One line naming the nodes that sample with anything but the exact samplers, and what
    that means; "" when none does."""
    if not (inexact := inexact_nodes(nodes)):
        return ""
    named = ", ".join(f"{n.host} ({n.sampler!r})" for n in inexact)
    return f"not the {EXACT_SAMPLER} sampler on {named}: the ring's output is NOT lossless"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or what platform knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def meminfo_bytes(field: str) -> int:
    """A field of /proc/meminfo (`MemTotal`, `MemAvailable`) in bytes, 0 when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def system_memory_bytes() -> int:
    """Total memory, 0 when unknown."""
    return meminfo_bytes("MemTotal")


def hardware() -> dict[str, str | int]:
    """GPU name, UUID and memory from torch when a GPU is present, else "cpu" and system memory."""
    info: dict[str, str | int] = {
        "gpu_name": "cpu",
        "gpu_uuid": "cpu",
        "cpu_model": cpu_model(),
        "memory_bytes": system_memory_bytes(),
    }
    try:
        import torch
    except ImportError:
        return info
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["gpu_name"] = props.name
        info["gpu_uuid"] = str(getattr(props, "uuid", "")) or "unknown"
        info["memory_bytes"] = int(props.total_memory)
    return info


def _key_bytes(key: bytes | str | None) -> bytes:
    if not key:
        raise ValueError("the inventory is signed: a swarm key is needed (SPECPIPE_SWARM_KEY)")
    return key.encode() if isinstance(key, str) else key


def _keys(keys: Keys | None) -> list[bytes]:
    """The keys a record may be signed with: one key, or those a rotation still accepts."""
    if isinstance(keys, Keyring):
        return list(keys.accepted)
    if isinstance(keys, bytes | str) or keys is None:
        return [_key_bytes(keys)]
    return [_key_bytes(key) for key in keys] or [_key_bytes(None)]


def _scoped(context: bytes, record: bytes, swarm: str) -> bytes:
    name = swarm.encode()
    return context + len(name).to_bytes(4, "big") + name + record


def _tag(record: bytes, swarm: str, key: bytes) -> str:
    return hmac.new(key, _scoped(_MAC_CONTEXT, record, swarm), hashlib.sha256).hexdigest()


def sign_record(record: str, swarm: str, key: bytes | str | Keyring) -> str:
    """The stored form of a record's JSON for `swarm`: its signature, a space, the JSON. A
    keyring with a signer signs with the host's own key; else the tag is under the swarm key."""
    if isinstance(key, Keyring) and key.signer is not None:
        signature = key.signer.sign(_scoped(_SIGNED_CONTEXT, record.encode(), swarm))
        return f"{_SIGNED_TAG.decode()}{signature.hex()} {record}"
    swarm_key = key.current if isinstance(key, Keyring) else _key_bytes(key)
    return f"{_tag(record.encode(), swarm, swarm_key)} {record}"


def verify_record(
    host: str,
    value: bytes | str,
    swarm: str,
    keys: Keys,
    now: float,
    roster: identity.Roster | None = None,
) -> NodeInfo:
    """The node a stored value describes; ValueError when it is unsigned (by none of `keys`;
    with `roster`, by anything but the key the roster admits `host` under), forged, filed under
    another host, malformed, carries credentials, or dated more than MAX_AHEAD_S after `now`
    (swarm time)."""
    raw = value if isinstance(value, bytes) else value.encode()
    tag, _, record = raw.partition(b" ")
    if roster is not None:
        key = roster.key_of(host)
        if key is None:
            raise ValueError("node record of a host not admitted")
        try:
            signature = bytes.fromhex(tag.removeprefix(_SIGNED_TAG).decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise ValueError("unsigned node record") from None
        scoped = _scoped(_SIGNED_CONTEXT, record, swarm)
        if not tag.startswith(_SIGNED_TAG) or not identity.verifies(key, signature, scoped):
            raise ValueError("node record not signed by its host's own key")
    elif not any(
        hmac.compare_digest(tag, _tag(record, swarm, key).encode()) for key in _keys(keys)
    ):
        raise ValueError("unsigned or forged node record")
    node = NodeInfo.from_json(record)
    if has_credentials(node.redis_url):
        raise ValueError("node record carries credentials")
    if node.host != host:
        raise ValueError("node record filed under another host")
    if node.last_heartbeat > now + MAX_AHEAD_S:
        raise ValueError("node record dated in the future")
    return node


def publish(
    client: redis.Redis,
    swarm: str,
    node: NodeInfo,
    key: bytes | str | Keyring,
    now: float | None = None,
) -> NodeInfo:
    """Record (or refresh) a node, signed (`sign_record`), with `now` as its heartbeat: swarm
    time (None: the registry's clock, sampled now). ValueError for a record whose address
    carries credentials."""
    if has_credentials(node.redis_url):
        raise ValueError(f"{node.host}'s record would carry its Redis credentials")
    node = replace(node, last_heartbeat=SwarmClock(client).now() if now is None else now)
    client.set(node_key(swarm, node.host), sign_record(node.to_json(), swarm, key))
    return node


def remove(client: redis.Redis, swarm: str, host: str) -> None:
    """Take a node out of the inventory (a clean shutdown)."""
    client.delete(node_key(swarm, host))


@dataclass(frozen=True)
class Inventory:
    """The nodes whose records verified, in ring order, how many records were ignored, and
    the swarm time they were judged at (what their status and lapses are judged at too)."""

    nodes: list[NodeInfo]
    ignored: int  # unsigned, forged, not admitted, malformed or future-dated records
    roster: identity.Roster | None = None  # the admitted hosts, with host identities
    now: float = 0.0
    latency_ms: dict[str, float] = field(default_factory=dict)  # host 0's figures (`latency`)


def read(client: redis.Redis, swarm: str, keys: Keys | None, now: float | None = None) -> Inventory:
    """Every verified node, in ring order (by first layer), and the count of ignored records.
    `keys`: the swarm key, every key a rotation still accepts, or a keyring; one that pins the
    coordinator's key reads the roster too and believes only what admitted hosts signed. `now`
    is swarm time; None: the registry's clock, sampled once the records are read."""
    accepted = _keys(keys)
    coordinator = keys.coordinator if isinstance(keys, Keyring) else None
    roster = None
    if coordinator is not None:
        roster, _ = identity.read_roster(client, swarm, coordinator)
    stored = record_keys(client, swarm, roster)
    values = client.mget(stored) if stored else []
    now = SwarmClock(client).now() if now is None else now
    nodes, ignored = [], 0
    prefix = len(node_key(swarm, ""))
    for key, value in zip(stored, values, strict=True):
        if value is None:  # gone since the listing, or not a string (which no host can write)
            continue
        name = key[prefix:]
        try:
            node = verify_record(name, value, swarm, accepted, now, roster)
        except (ValueError, TypeError):
            ignored += 1
            continue
        nodes.append(replace(node, last_heartbeat=_observed(swarm, name, value, node, now)))
    ordered = sorted(nodes, key=lambda n: (n.layer_start, n.layer_end, n.host))
    return Inventory(ordered, ignored, roster, now, latency.read(client, swarm, now))


# What this process last saw of each host's record: a digest of the stored value, and when
# (swarm time) it first read that value.
_seen: dict[tuple[str, str], tuple[bytes, float]] = {}


def _observed(swarm: str, host: str, value: bytes, node: NodeInfo, now: float) -> float:
    """When `node`'s heartbeat is believed: its own date, but never later than the first read
    here of the record as it is stored now. A host's clock can only count against it: a
    record dated ahead is as fresh as when it was read, and one left unchanged ages on the
    reader's swarm time whatever date it bears."""
    digest = hashlib.sha256(value).digest()
    last = _seen.get((swarm, host))
    if last is None or last[0] != digest or last[1] > now:
        last = _seen[(swarm, host)] = (digest, now)
    return min(node.last_heartbeat, last[1])


def load(
    client: redis.Redis, swarm: str, keys: Keys | None, now: float | None = None
) -> list[NodeInfo]:
    """Every verified node, in ring order (by first layer); bad records are skipped."""
    return read(client, swarm, keys, now).nodes


def ignored_note(count: int) -> str:
    """One line saying how many inventory records were ignored, and why such records are."""
    noun = "record" if count == 1 else "records"
    return (
        f"{count} inventory {noun} ignored: unsigned, forged, of a host not admitted, "
        "malformed or dated in the future"
    )


def route(
    nodes: list[NodeInfo],
    n_layers: int,
    model: str | None = None,
    now: float | None = None,
    avoid: Collection[str] = (),
    prefer: Collection[str] = (),
    latency_ms: Mapping[str, float] | None = None,
) -> list[NodeInfo]:
    """The ring: online stages covering layers 0:n_layers exactly once, in order, none of the
    hosts in `avoid`.

    Where several hosts serve the same range, one whose heartbeat has not lapsed wins, then
    one of the hosts in `prefer` (those keeping a job's prefix), then the nearest as host 0
    measured them (`latency_ms`, `swarm.latency`), then the first by host name (never the
    freshest record: a host dates its own). Raises RouteError naming the first layers no online
    stage serves."""
    if n_layers <= 0:
        raise RouteError(f"a model needs at least one layer, got {n_layers}")
    now = time.time() if now is None else now
    usable = [
        n
        for n in nodes
        if _well_formed(n)
        and n.status(now) == "online"
        and 0 <= n.layer_start < n.layer_end <= n_layers
        and (model is None or not n.model or n.model == model)
        and n.host not in avoid
    ]
    by_start: dict[int, list[NodeInfo]] = {}
    near = latency_ms or {}

    def choice(n: NodeInfo) -> tuple:
        return n.lapsed(now), n.host not in prefer, latency.rank(near, n.host), n.host

    for node in sorted(usable, key=choice):
        by_start.setdefault(node.layer_start, []).append(node)

    # Depth-first over layer boundaries; `dead` remembers boundaries no route can finish from.
    dead: set[int] = set()

    def route_from(pos: int) -> list[NodeInfo] | None:
        if pos == n_layers:
            return []
        if pos in dead:
            return None
        for node in by_start.get(pos, []):
            rest = route_from(node.layer_end)
            if rest is not None:
                return [node, *rest]
        dead.add(pos)
        return None

    found = route_from(0)
    if found is not None:
        last = len(found) - 1
        return [replace(n, role="tail" if i == last else f"stage{i}") for i, n in enumerate(found)]
    # Every boundary visited is dead; the furthest one is where no online stage starts.
    pos = max(dead)
    end = min((n.layer_start for n in usable if n.layer_start > pos), default=n_layers)
    raise RouteError(f"no online stage serves layers {pos}:{end}", pos, end)


def with_roles(nodes: list[NodeInfo]) -> list[NodeInfo]:
    """Nodes in layer order with a role each: stage0, stage1, … by where their range starts,
    and tail for the ones ending at the last layer any node serves. A role a node published
    itself is kept."""
    ordered = sorted(nodes, key=lambda n: (n.layer_start, n.layer_end, n.host))
    if not ordered:
        return []
    starts = sorted({n.layer_start for n in ordered})
    last_layer = max(n.layer_end for n in ordered)

    def role(n: NodeInfo) -> str:
        return "tail" if n.layer_end == last_layer else f"stage{starts.index(n.layer_start)}"

    return [n if n.role else replace(n, role=role(n)) for n in ordered]


def _link(node: NodeInfo) -> str:
    """The link to the next hop: its PING round trip."""
    if not node.next_hop:
        return "-"
    return f"rtt {node.next_hop_rtt_ms:.2f} ms"


def _clock(node: NodeInfo) -> str:
    """How far the host's own clock is off the registry's, as the host measured it."""
    off = -node.clock_offset_s
    return f"{off:+.1f} s" if abs(off) >= 0.05 else "in step"


def table(nodes: list[NodeInfo], now: float | None = None) -> list[str]:
    """The inventory as aligned text lines, in ring order (what `specpipe nodes` prints), with
    ages at `now` (swarm time). CLOCK is the host's own clock less the registry's. When a node
    samples with anything but the exact samplers a last column, SAMPLER, names each one's."""
    now = time.time() if now is None else now
    ordered = with_roles(nodes)
    warn = bool(inexact_nodes(ordered))
    header = (
        "HOST",
        "ROLE",
        "LAYERS",
        "STATUS",
        "SEEN",
        "REDIS",
        "GEO",
        "PUBLIC IP",
        "GPU",
        "MEM",
        "NEXT HOP",
        "LINK",
        "CLOCK",
    )
    rows = [(*header, "SAMPLER") if warn else header]
    for n in ordered:
        gpu = n.cpu_model if n.gpu_name == "cpu" and n.cpu_model else n.gpu_name
        rows.append(
            (
                n.host,
                n.role or "-",
                n.layers,
                n.status(now),
                f"{max(0.0, now - n.last_heartbeat):.0f}s ago",
                redact_url(n.redis_url),
                n.geo or "-",
                n.public_ip or "-",
                gpu,
                f"{n.memory_bytes / 2**30:.1f} GiB",
                n.next_hop or "-",
                _link(n),
                _clock(n),
                *([n.sampler] if warn else []),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def lost_hops(
    hops: Sequence[NodeInfo], nodes: list[NodeInfo], now: float | None = None
) -> list[str]:
    """The hosts of a route (`hops`, as routed) that the inventory `nodes` no longer vouches
    for: gone from it (a clean shutdown), lapsed (killed, cut off, stopped), or serving other
    layers than the route has them for."""
    now = time.time() if now is None else now
    current = {n.host: n for n in nodes}
    lost = []
    for hop in hops:
        node = current.get(hop.host)
        if (
            node is None
            or node.lapsed(now)
            or (node.layer_start, node.layer_end) != (hop.layer_start, hop.layer_end)
        ):
            lost.append(hop.host)
    return lost


def restarted_hops(hops: Sequence[NodeInfo], nodes: list[NodeInfo]) -> list[str]:
    """The hosts of a route (`hops`, as routed) whose stage process the inventory `nodes` shows
    started again since the route was read: a round in flight there was lost with the old
    process, and no reply to it will come."""
    current = {n.host: n for n in nodes}
    restarted = []
    for hop in hops:
        node = current.get(hop.host)
        if node is not None and node.incarnation and node.incarnation != hop.incarnation:
            restarted.append(hop.host)
    return restarted


def choose_layers(
    nodes: list[NodeInfo],
    n_layers: int,
    model: str | None = None,
    load: dict[str, int] | None = None,
    now: float | None = None,
) -> tuple[int, int, str]:
    """The layer range a new host should serve, and why: the first range no online stage
    serves (from the first uncovered layer to where the next served range starts); when every
    layer is served, a spare for the busiest range of the route: the one with the fewest
    replicas, then the most rounds processed (`load`, per host), then the first."""
    now = time.time() if now is None else now
    online = [
        n
        for n in nodes
        if n.status(now) == "online"
        and not n.lapsed(now)
        and 0 <= n.layer_start < n.layer_end <= n_layers
        and (model is None or not n.model or n.model == model)
    ]
    try:
        ring = route(online, n_layers, model=model, now=now)
    except RouteError as exc:
        return exc.start, exc.end, "nobody serves it"
    load = load or {}

    def busy(hop: NodeInfo) -> tuple:
        same = [
            n for n in online if (n.layer_start, n.layer_end) == (hop.layer_start, hop.layer_end)
        ]
        return (len(same), -sum(load.get(n.host, 0) for n in same), hop.layer_start)

    hop = min(ring, key=busy)
    replicas = busy(hop)[0]
    return hop.layer_start, hop.layer_end, f"a spare: {replicas} host(s) serve it, the busiest"


@dataclass(frozen=True)
class HopLatency:
    """One hop of the ring: the stage's own time per round and its link onward."""

    host: str
    next_hop: str
    forward_ms: float  # the stage's forward (running mean)
    handling_ms: float  # checking, decoding, encoding, sending on (running mean)
    link_ms: float  # one way to the next hop: half the PING round trip

    @property
    def total_ms(self) -> float:
        return self.forward_ms + self.handling_ms + self.link_ms


@dataclass(frozen=True)
class RingLatency:
    """Where a round's time goes around the ring, and the tok/s that latency allows."""

    hops: list[HopLatency]

    @property
    def ring_ms(self) -> float:
        """One round's trip: every stage's time and every link's, the tail's back included."""
        return sum(hop.total_ms for hop in self.hops)

    def ceiling_tok_s(self, tokens_per_round: float = 1.0) -> float:
        """The latency ceiling: tokens committed per round over the ring's time (0: unknown)."""
        return tokens_per_round * 1000 / self.ring_ms if self.ring_ms > 0 else 0.0

    def as_dict(self, tokens_per_round: float = 1.0) -> dict:
        return {
            "hops": [{**asdict(hop), "total_ms": round(hop.total_ms, 3)} for hop in self.hops],
            "ring_ms": round(self.ring_ms, 3),
            "tokens_per_round": tokens_per_round,
            "ceiling_tok_s": round(self.ceiling_tok_s(tokens_per_round), 2),
        }


def measured_ring(
    nodes: list[NodeInfo], now: float | None = None, latency_ms: Mapping[str, float] | None = None
) -> list[NodeInfo] | None:
    """A ring routing can build (with host 0's figures, `latency_ms`) from the online `nodes`
    that have measured their link onward (from their first round on); None when they form none
    (a spare that has not carried a round yet is left out)."""
    online = [n for n in nodes if n.status(now) == "online"]
    measured = [n for n in online if n.next_hop]
    if not measured:
        return None
    try:
        ring = route(measured, max(n.layer_end for n in online), now=now, latency_ms=latency_ms)
    except RouteError:
        return None
    return ring


def ring_latency(ring: list[NodeInfo], stats: dict[str, dict | None]) -> RingLatency:
    """The latency of `ring` (a route, in order) from its records and each stage's running
    means (`stats`, by host, as `streams.read_stats` gives them; None where unknown)."""
    hops = []
    for node in ring:
        timings = stats.get(node.host) or {}
        hops.append(
            HopLatency(
                host=node.host,
                next_hop=node.next_hop or "?",
                forward_ms=float(timings.get("forward_ms", 0.0)),
                handling_ms=float(timings.get("hop_ms", 0.0)),
                link_ms=node.next_hop_rtt_ms / 2,
            )
        )
    return RingLatency(hops)


def latency_lines(latency: RingLatency) -> list[str]:
    """The ring's latency as text: a line per hop, the ring's time and the ceiling."""
    lines = ["RING LATENCY (per round)"]
    for hop in latency.hops:
        lines.append(
            f"  {hop.host} -> {hop.next_hop}: forward {hop.forward_ms:.1f} ms, "
            f"handling {hop.handling_ms:.1f} ms, link {hop.link_ms:.2f} ms"
        )
    ceiling = latency.ceiling_tok_s()
    lines.append(
        f"  ring time {latency.ring_ms:.1f} ms; latency ceiling "
        f"{ceiling:.1f} tok/s per token per round"
    )
    return lines
