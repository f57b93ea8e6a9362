"""Redis Streams transport for the swarm's data plane.

Each stage host reads its input stream `specpipe:{swarm}:stage:{host}` from its own Redis with a
consumer group; senders XADD straight into the receiving host's Redis, so a hop crosses the
network once. Streams are bounded (approximate MAXLEN), entries are acked and deleted after
processing (a stream holds only what is in flight), a restarted consumer (same name) re-reads
its own pending entries first, and entries a dead consumer left pending are claimed with
XAUTOCLAIM. The coordinator waits on its reply stream
`specpipe:{swarm}:reply:{session}` with plain XREAD.

A stage reads its stream through a Lua script (`READ_SCRIPT`), so Redis checks each entry
before it crosses to the stage: one over the size limit, without a message, or delivered too
often (it took a stage down each time) is acked, deleted and recorded in a capped dead-letter
stream, and only what passes is read into the stage's memory. A script cannot block, so a
sender also pushes the stream's *bell*, a one-element list the stage waits on with BLPOP.

The commands on a round's path (the XADD of each hop, a stage's ack-and-read, the coordinator's
read of its reply) go through a `Link`: one connection of the client's pool kept for the purpose,
packed by hiredis and written and read directly. redis-py's per-call machinery (pool checkout,
retry wrapper, response callbacks, its packer's Python loop) costs about twice the CPU per
command, and a process woken once per round runs it with cold caches, on every hop.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable

import redis
from hiredis import pack_command

from specpipe.swarm.dialing import Dialer
from specpipe.swarm.identity import Roster
from specpipe.swarm.values import text

FIELD = b"m"  # the one field of every entry: the wire message
GROUP = "stage"
DEFAULT_MAXLEN = 1000
DEAD_MAXLEN = 100  # entries a dead-letter stream keeps for inspection
DEAD_HEAD_BYTES = 4096  # of a dead entry's message, kept in the dead-letter stream
MAX_DELIVERIES = 3  # an entry read this often without being acked is dead
REPLY_TTL_S = 3600  # reply streams of abandoned sessions expire
# No read on the data plane blocks longer than this; a longer wait is several reads. Every
# client's socket timeout exceeds it, so a socket never gives up on a read Redis still holds.
MAX_BLOCK_MS = 10_000
SOCKET_TIMEOUT_S = MAX_BLOCK_MS / 1000 + 5.0


def stage_key(swarm: str, host: str) -> str:
    """The input stream of one stage host."""
    return f"specpipe:{swarm}:stage:{host}"


def bell_key(stream: str) -> str:
    """The list a stream's senders push to wake its reader."""
    return f"{stream}:bell"


def dead_key(swarm: str, host: str) -> str:
    """The dead-letter stream of one stage host: what it dropped unread, and why."""
    return f"specpipe:{swarm}:dead:{host}"


def reply_key(swarm: str, session: str, host: str) -> str:
    """Where stage host `host` replies to the coordinator of one session: a stream of each
    host's own, which only that host's registry user may append to (`swarm.credentials`)."""
    return f"specpipe:{swarm}:reply:{session}@{host}"


def stats_key(swarm: str, host: str) -> str:
    """A hash a stage worker keeps on its own Redis: counters (processed, dropped, gaps,
    replayed, errors) and running means of its rounds' forward_ms and hop_ms."""
    return f"specpipe:{swarm}:stats:{host}"


def read_stats(client: redis.Redis, swarm: str, host: str) -> dict[str, float]:
    """A stage's counters and round timings (see `stats_key`), as numbers."""
    raw = client.hgetall(stats_key(swarm, host))
    return {k.decode(): float(v) for k, v in raw.items()}


def read_stages_stats(
    stages: Iterable[tuple[str, str]],
    swarm: str,
    timeout_s: float = 2.0,
    dialer: Dialer | None = None,
    roster: Roster | None = None,
) -> dict[str, dict[str, float] | None]:
    """Each stage's stats by host, read from its own Redis, for `(host, address)` pairs; None
    for a stage whose Redis does not answer within `timeout_s`. One client per Redis: the
    stages of a one-machine swarm share one. The addresses are dialled with `dialer`, by default
    with the credentials this process's environment configures, as each host's own user there
    where `roster` gives its key."""
    dialer = dialer or Dialer.from_env()
    dialer.learn(roster)
    clients: dict[str, redis.Redis] = {}
    found: dict[str, dict[str, float] | None] = {}
    try:
        for host, url in stages:
            if url not in clients:
                clients[url] = redis.Redis.from_url(
                    dialer.url(url, host),
                    socket_connect_timeout=timeout_s / 2,
                    socket_timeout=timeout_s,
                )
            try:
                found[host] = read_stats(clients[url], swarm, host)
            except (redis.RedisError, ValueError):
                found[host] = None
    finally:
        for client in clients.values():
            client.close()
    return found


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
        twice, a connection kept from before that fails or times out (its Redis restarted since,
        or a long cut left its socket dead with a full send buffer) is replaced at once and the
        commands sent again."""
        packed = b"".join(pack_command(command) for command in commands)
        if resend and self._connection is not None:
            try:
                return self._send(packed, len(commands))
            except (redis.ConnectionError, redis.TimeoutError):
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


def bell_commands(key: str) -> tuple[tuple, ...]:
    """The commands that wake the reader of a stage's stream (its bell holds one ring)."""
    bell = bell_key(key)
    return ("LPUSH", bell, 1), ("LTRIM", bell, 0, 0)


def stage_send_commands(key: str, data: bytes, maxlen: int) -> tuple[tuple, ...]:
    """The commands that put one message on a stage's stream and wake its reader."""
    return xadd_command(key, data, maxlen), *bell_commands(key)


def stream_entries(reply) -> list[tuple[bytes, bytes | None]]:
    """(entry id, message) from a raw XREAD / XREADGROUP reply (RESP2 or RESP3); the message is
    None for an entry without one (trimmed while pending)."""
    return [(entry_id, data) for _, entry_id, data in keyed_entries(reply)]


def keyed_entries(reply) -> list[tuple[str, bytes, bytes | None]]:
    """(stream, entry id, message) from a raw XREAD reply over several streams, as
    `stream_entries`."""
    if not reply:
        return []
    streams = reply.items() if isinstance(reply, dict) else reply
    out = []
    for key, items in streams:
        for entry_id, fields in items:
            fields = fields or {}
            if isinstance(fields, list):  # [field, value, field, value, …]
                fields = dict(zip(fields[::2], fields[1::2], strict=True))
            out.append((text(key), entry_id, fields.get(FIELD)))
    return out


class Connections:
    """One client (and one `Link`) per Redis address, reused for every send to that host. The
    `dialer` adds this process's own credentials to an address (`specpipe.swarm.dialing`)."""

    def __init__(self, dialer: Dialer | None = None) -> None:
        self.dialer = dialer or Dialer()
        self._clients: dict[str, redis.Redis] = {}
        self._links: dict[str, Link] = {}

    def get(self, url: str) -> redis.Redis:
        """The client for `url` (an address, or a URL this process was configured with),
        created on first use."""
        client = self._clients.get(url)
        if client is None:
            tcp = not url.startswith("unix:")  # keepalive is a TCP option
            client = redis.Redis.from_url(
                self.dialer.url(url),
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


def send(target: redis.Redis | Link, key: str, data: bytes, maxlen: int = DEFAULT_MAXLEN) -> bytes:
    """XADD one message to a stage's bounded stream and ring its bell; return its entry id."""
    commands = stage_send_commands(key, data, maxlen)
    if isinstance(target, Link):
        # Sent twice, a message is read twice: a stage drops a sequence number it has seen.
        return target.call(*commands, resend=True)[0]
    pipe = target.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    return pipe.execute()[0]


def send_all(
    link: Link, entries: Iterable[tuple[str, bytes, bool]], maxlen: int = DEFAULT_MAXLEN
) -> None:
    """XADD each (stream, message, is_reply) in one write to one Redis: a reply stream is kept
    from outliving an abandoned session; a stage stream's bell rings once, after all its
    entries, so its reader wakes to the whole batch at once instead of to its first entry."""
    commands, woken = [], {}
    for key, data, is_reply in entries:
        commands.append(xadd_command(key, data, maxlen))
        if is_reply:
            commands.append(("EXPIRE", key, REPLY_TTL_S))
        else:
            woken[key] = None
    for key in woken:
        commands += bell_commands(key)
    # Sent twice, a message is read twice: a stage drops a sequence number it has seen.
    link.call(*commands, resend=True)


# Runs in Redis, so an entry is checked before it reaches the stage. KEYS: the stream, its bell,
# the dead-letter stream. ARGV: group, consumer, start ('>' for new entries, else an id: our own
# pending entries after it), the most entries to return, the most bytes of one message, the
# most deliveries of one entry, the most bytes in all, then the ids to ack first. Returns
# {flat [id, message, ...], [reason, ...] of the entries dropped, the cursor reached}.
READ_SCRIPT = """
local stream, bell, dead = KEYS[1], KEYS[2], KEYS[3]
local group, consumer, cursor = ARGV[1], ARGV[2], ARGV[3]
local count, max_bytes = tonumber(ARGV[4]), tonumber(ARGV[5])
local max_deliveries, budget = tonumber(ARGV[6]), tonumber(ARGV[7])
if #ARGV > 7 then
  local acks = {unpack(ARGV, 8)}
  redis.call('XACK', stream, group, unpack(acks))
  redis.call('XDEL', stream, unpack(acks))
end
redis.call('DEL', bell)
local out, dropped, total = {}, {}, 0
while #out < 2 * count and total < budget do
  local reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 1,
                           'STREAMS', stream, cursor)
  local entry = reply and reply[1] and reply[1][2][1]
  if not entry then break end
  local id, fields = entry[1], entry[2]
  if cursor ~= '>' then cursor = id end
  local data, reason = nil, nil
  if fields then
    for i = 1, #fields, 2 do
      if fields[i] == 'm' then data = fields[i + 1] end
    end
    if not data then
      reason = 'an entry without a message'
    elseif #data > max_bytes then
      reason = 'a message of ' .. #data .. ' bytes, over the ' .. max_bytes .. ' limit'
    elseif cursor ~= '>' then
      local pending = redis.call('XPENDING', stream, group, id, id, 1, consumer)[1]
      if pending and pending[4] > max_deliveries then
        reason = 'an entry delivered ' .. pending[4] .. ' times'
      end
    end
  end
  if reason then
    redis.call('XADD', dead, 'MAXLEN', '~', ARGV_DEAD_MAXLEN, '*', 'entry', id,
               'reason', reason, 'bytes', data and #data or 0,
               'head', data and string.sub(data, 1, ARGV_DEAD_HEAD) or '')
    dropped[#dropped + 1] = id .. ': ' .. reason
  end
  if reason or not fields then  -- not fields: trimmed while pending, nothing to do
    redis.call('XACK', stream, group, id)
    redis.call('XDEL', stream, id)
  else
    out[#out + 1] = id
    out[#out + 1] = data
    total = total + #data
  end
end
if #out > 0 then redis.call('LPUSH', bell, 1) end  -- the BLPOP sent after us returns at once
return {out, dropped, cursor}
""".replace("ARGV_DEAD_MAXLEN", str(DEAD_MAXLEN)).replace("ARGV_DEAD_HEAD", str(DEAD_HEAD_BYTES))
READ_SCRIPT_SHA = hashlib.sha1(READ_SCRIPT.encode()).hexdigest()


class StreamConsumer:
    """Reads one stage's input stream as a named member of the stage's consumer group.

    Entries come through `READ_SCRIPT`: none over `max_bytes` ever reaches this process, and
    what Redis drops for it waits in `dropped` for the caller to count."""

    def __init__(
        self,
        client: redis.Redis,
        key: str,
        consumer: str,
        group: str = GROUP,
        claim_idle_ms: int = 30_000,
        claim_every_s: float = 5.0,
        max_bytes: int = 256 * 1024 * 1024,
        dead: str | None = None,
    ) -> None:
        self.client = client
        self.link = Link(client)
        self.key = key
        self.bell = bell_key(key)
        self.dead = dead or f"{key}:dead"
        self.consumer = consumer
        self.group = group
        self.claim_idle_ms = claim_idle_ms
        self.max_bytes = max_bytes
        self.dropped: list[str] = []  # why Redis dropped entries, since the caller last looked
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

    def read(self, count: int = 16, block_ms: int = 1000) -> list[tuple[bytes, bytes]]:
        """Next entries as (id, message bytes), waiting up to `block_ms` when there are none."""
        if self._backlog is not None:
            entries, cursor = self._read(self._backlog, count, None)
            self._backlog = cursor if entries else None
            if entries:
                return entries
        if time.monotonic() >= self._next_claim:
            if self._autoclaim(count):
                self._backlog = "0-0"
                return self.read(count, block_ms)
            self._next_claim = time.monotonic() + self._claim_every_s
        return self._read(">", count, block_ms)[0]

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
                "XACK", self.key, self.group, *self._unacked
            ).execute_command("XDEL", self.key, *self._unacked).execute()
            self._unacked.clear()

    def _read(
        self, start: str, count: int, block_ms: int | None
    ) -> tuple[list[tuple[bytes, bytes]], str]:
        # One write: the read (with the acks held back), and when it may wait, the wait for the
        # bell and a second read for what rang it. Redis runs the second read as the bell rings,
        # so a waiting stage gets its entry in the round trip that waits for it. An entry
        # processed just before a crash stays pending and is read again.
        args = (
            self.group,
            self.consumer,
            start,
            count,
            self.max_bytes,
            MAX_DELIVERIES,
            READ_BUDGET_ENTRIES * self.max_bytes,
        )
        read = ("EVALSHA", READ_SCRIPT_SHA, 3, self.key, self.bell, self.dead, *args)
        commands = [(*read, *self._unacked)]
        if block_ms:
            commands += [("BLPOP", self.bell, min(block_ms, MAX_BLOCK_MS) / 1000), read]
        try:
            try:
                replies = self.link.call(*commands)[::2]  # the reads' replies
            except redis.exceptions.NoScriptError:
                # A Redis new to the script (or restarted since): EVAL loads it again.
                replies = self.link.call(("EVAL", READ_SCRIPT, *commands[0][2:]))
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._unacked.clear()  # the stream was deleted under us, its pending list with it
            self.ensure_group()
            return [], start
        self._unacked.clear()
        entries = []
        for flat, dropped, _ in replies:
            self.dropped.extend(text(reason) for reason in dropped)
            entries += zip(flat[::2], flat[1::2], strict=True)
        return entries, text(replies[0][2])

    def _autoclaim(self, count: int) -> bool:
        """Take over entries another consumer left idle; whether there were any."""
        self.flush()  # what we processed must not look idle and come back to us
        # XAUTOCLAIM walks the pending list from a cursor; entries another consumer left idle
        # longer than claim_idle_ms become ours, to be read (and checked) as our own backlog.
        claim = (
            "XAUTOCLAIM",
            self.key,
            self.group,
            self.consumer,
            self.claim_idle_ms,
            self._claim_from,
            "COUNT",
            count,
            "JUSTID",
        )
        reply = self.link.call(claim)[0]
        self._claim_from = text(reply[0])
        return bool(reply[1])


READ_BUDGET_ENTRIES = 2  # one read takes at most about this many largest messages' bytes
