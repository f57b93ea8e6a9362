"""Redis Streams transport for the swarm's data plane.

Each stage host reads its input stream `specpipe:{swarm}:stage:{host}` from its own Redis with a
consumer group; senders XADD straight into the receiving host's Redis, so a hop crosses the
network once. Streams are bounded (approximate MAXLEN), entries are acked and deleted after
processing (a stream holds only what is in flight), a restarted consumer (same name) re-reads
its own pending entries first, and entries a dead consumer left pending are claimed with
XAUTOCLAIM. The coordinator waits on its reply stream
`specpipe:{swarm}:reply:{session}` with plain XREAD.

The commands on a round's path (the XADD of each hop, a stage's ack-and-read, the coordinator's
read of its reply) go through a `Link`: one connection of the client's pool kept for the purpose,
packed by hiredis and written and read directly. redis-py's per-call machinery (pool checkout,
retry wrapper, response callbacks, its packer's Python loop) costs about twice the CPU per
command, and a process woken once per round runs it with cold caches, on every hop.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import redis
from hiredis import pack_command

FIELD = b"m"  # the one field of every entry: the wire message
GROUP = "stage"
DEFAULT_MAXLEN = 1000
REPLY_TTL_S = 3600  # reply streams of abandoned sessions expire
# No read on the data plane blocks longer than this; a longer wait is several reads. Every
# client's socket timeout exceeds it, so a socket never gives up on a read Redis still holds.
MAX_BLOCK_MS = 10_000
SOCKET_TIMEOUT_S = MAX_BLOCK_MS / 1000 + 5.0


def stage_key(swarm: str, host: str) -> str:
    """The input stream of one stage host."""
    return f"specpipe:{swarm}:stage:{host}"


def reply_key(swarm: str, session: str) -> str:
    """The coordinator's reply stream for one session."""
    return f"specpipe:{swarm}:reply:{session}"


def stats_key(swarm: str, host: str) -> str:
    """A hash a stage worker keeps on its own Redis: counters (processed, dropped, gaps,
    duplicates, errors) and running means of its rounds' forward_ms and hop_ms."""
    return f"specpipe:{swarm}:stats:{host}"


def read_stats(client: redis.Redis, swarm: str, host: str) -> dict[str, float]:
    """A stage's counters and round timings (see `stats_key`), as numbers."""
    raw = client.hgetall(stats_key(swarm, host))
    return {k.decode(): float(v) for k, v in raw.items()}


class Link:
    """One dedicated connection of a client's pool, for the commands on a round's path."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._connection = None

    def call(self, *commands: tuple, resend: bool = False) -> list:
        """Send the commands in one write and return their raw (RESP) replies, in order.

        Raises what redis-py raises: ConnectionError, TimeoutError, or ResponseError for an
        error reply. After any of them the connection is dropped (a reply may be left unread)
        and the next call opens a new one. With `resend`, for commands that may safely run
        twice, a connection kept from before (its Redis may have restarted since) that fails
        is replaced at once and the commands sent again."""
        packed = b"".join(pack_command(command) for command in commands)
        if resend and self._connection is not None:
            try:
                return self._send(packed, len(commands))
            except redis.ConnectionError:
                pass  # the old connection is dropped: go on with a new one
        return self._send(packed, len(commands))

    def _send(self, packed: bytes, replies: int) -> list:
        connection = self._connection or self._connect()
        try:
            connection.send_packed_command([packed], check_health=False)
            return [connection.read_response() for _ in range(replies)]
        except BaseException:
            connection.disconnect()
            raise

    def _connect(self):
        self._connection = self.client.connection_pool.get_connection()
        return self._connection

    def close(self) -> None:
        """Hand the connection back to the pool."""
        if self._connection is not None:
            self.client.connection_pool.release(self._connection)
            self._connection = None


def xadd_command(key: str, data: bytes, maxlen: int) -> tuple:
    """XADD of one message to a bounded stream (approximate trimming), as a raw command."""
    return ("XADD", key, "MAXLEN", "~", maxlen, "*", FIELD, data)


def stream_entries(reply) -> list[tuple[bytes, bytes | None]]:
    """(entry id, message) from a raw XREAD / XREADGROUP reply (RESP2 or RESP3); the message is
    None for an entry without one (trimmed while pending)."""
    if not reply:
        return []
    streams = reply.values() if isinstance(reply, dict) else (items for _, items in reply)
    out = []
    for items in streams:
        for entry_id, fields in items:
            fields = fields or {}
            if isinstance(fields, list):  # [field, value, field, value, …]
                fields = dict(zip(fields[::2], fields[1::2], strict=True))
            out.append((entry_id, fields.get(FIELD)))
    return out


class Connections:
    """One client (and one `Link`) per Redis URL, reused for every send to that host."""

    def __init__(self) -> None:
        self._clients: dict[str, redis.Redis] = {}
        self._links: dict[str, Link] = {}

    def get(self, url: str) -> redis.Redis:
        """The client for `url`, created on first use."""
        client = self._clients.get(url)
        if client is None:
            tcp = not url.startswith("unix:")  # keepalive is a TCP option
            client = redis.Redis.from_url(
                url,
                socket_timeout=SOCKET_TIMEOUT_S,
                socket_connect_timeout=5.0,
                **({"socket_keepalive": True} if tcp else {}),
            )
            self._clients[url] = client
        return client

    def link(self, url: str) -> Link:
        """The `Link` for `url`, created on first use."""
        link = self._links.get(url)
        if link is None:
            link = self._links[url] = Link(self.get(url))
        return link

    def close(self) -> None:
        """Close every link and client."""
        for link in self._links.values():
            link.close()
        self._links.clear()
        for client in self._clients.values():
            client.close()
        self._clients.clear()


def send(target: redis.Redis | Link, key: str, data: bytes,
         maxlen: int = DEFAULT_MAXLEN) -> bytes:  # fmt: skip
    """XADD one message to a bounded stream; return its entry id."""
    if isinstance(target, Link):
        # Sent twice, a message is read twice: stages drop a round id they have seen, and the
        # coordinator takes the first reply to a round.
        return target.call(xadd_command(key, data, maxlen), resend=True)[0]
    return target.xadd(key, {FIELD: data}, maxlen=maxlen, approximate=True)


def send_reply(link: Link, key: str, data: bytes, maxlen: int = DEFAULT_MAXLEN) -> None:
    """XADD to a reply stream and keep it from outliving an abandoned session."""
    link.call(xadd_command(key, data, maxlen), ("EXPIRE", key, REPLY_TTL_S), resend=True)


class StreamConsumer:
    """Reads one stage's input stream as a named member of the stage's consumer group."""

    def __init__(
        self,
        client: redis.Redis,
        key: str,
        consumer: str,
        group: str = GROUP,
        claim_idle_ms: int = 30_000,
        claim_every_s: float = 5.0,
    ) -> None:
        self.client = client
        self.link = Link(client)
        self.key = key
        self.consumer = consumer
        self.group = group
        self.claim_idle_ms = claim_idle_ms
        self._backlog: str | None = "0-0"  # cursor over our own pending entries, read first
        self._claim_from = "0-0"
        self._claim_every_s = claim_every_s
        self._next_claim = 0.0
        self._unacked: list[bytes] = []
        self.ensure_group()

    def ensure_group(self) -> None:
        """Create the stream and the group if they do not exist yet."""
        try:
            self.client.xgroup_create(self.key, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, count: int = 16, block_ms: int = 1000) -> list[tuple[bytes, bytes | None]]:
        """Next entries as (id, message bytes); message is None for an entry without one."""
        if self._backlog is not None:
            # Acks still held back go out first in the same pipeline, so what we already
            # processed is no longer pending when the backlog is read.
            entries = self._xreadgroup(self._backlog, count, None)
            if entries:
                last = entries[-1][0]
                self._backlog = last.decode() if isinstance(last, bytes) else str(last)
                return entries
            self._backlog = None
        if time.monotonic() >= self._next_claim:
            claimed = self._autoclaim(count)
            if claimed:
                return claimed
            self._next_claim = time.monotonic() + self._claim_every_s
        return self._xreadgroup(">", count, block_ms)

    def rewind(self) -> None:
        """Re-read our own pending entries before new ones (after losing the connection)."""
        self._backlog = "0-0"

    def ack(self, entry_ids: Iterable[bytes]) -> None:
        """Acknowledge processed entries: sent with the next read, or by `flush`."""
        self._unacked.extend(entry_ids)

    def flush(self) -> None:
        """Send the acknowledgements still held back."""
        if self._unacked:
            self.client.pipeline(transaction=False).execute_command(
                *self._ack_command()
            ).execute_command(*self._delete_command()).execute()
            self._unacked.clear()

    def _xreadgroup(self, start: str, count: int, block_ms: int | None):
        # The acks ride in the same round trip as the next read: one less hop of latency per
        # message. An entry processed just before a crash stays pending and is read again.
        read = ("XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", count)
        read += ("BLOCK", min(block_ms, MAX_BLOCK_MS)) if block_ms is not None else ()
        read += ("STREAMS", self.key, start)
        acks = [self._ack_command(), self._delete_command()] if self._unacked else []
        try:
            reply = self.link.call(*acks, read)[-1]
            self._unacked.clear()
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._unacked.clear()  # the stream was deleted under us, its pending list with it
            self.ensure_group()
            return []
        return stream_entries(reply)

    def _ack_command(self) -> tuple:
        return ("XACK", self.key, self.group, *self._unacked)

    def _delete_command(self) -> tuple:
        # A processed entry is of no more use: the stream keeps only what is still in flight.
        return ("XDEL", self.key, *self._unacked)

    def _autoclaim(self, count: int) -> list[tuple[bytes, bytes | None]]:
        self.flush()  # what we processed must not look idle and come back to us
        # XAUTOCLAIM walks the pending list from a cursor; entries another consumer left idle
        # longer than claim_idle_ms become ours.
        reply = self.client.xautoclaim(
            self.key,
            self.group,
            self.consumer,
            self.claim_idle_ms,
            start_id=self._claim_from,
            count=count,
        )
        cursor = reply[0]
        self._claim_from = cursor.decode() if isinstance(cursor, bytes) else str(cursor)
        claimed = []
        for entry in reply[1]:
            eid, fields = entry if entry else (None, None)
            if eid is None:
                continue
            if not fields:  # trimmed while pending (Redis 6.2 still lists it)
                self._unacked.append(eid)
                continue
            claimed.append((eid, fields.get(FIELD)))
        return claimed
