"""What a stage sends, and how: the messages a batch queues (`Outbox`), sent when the batch
ends in one write per destination Redis (`Sender`), so that the next stage reads them as one
batch too (`streams.send_all`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import redis

from specpipe.swarm import streams, wire
from specpipe.swarm.stage.counters import StageStats
from specpipe.swarm.stage.keys import StageKeys

log = logging.getLogger("specpipe.stage")


@dataclass(frozen=True)
class Outgoing:
    """One message a stage sends: queued while its batch runs, sent with the batch's others."""

    url: str  # the destination Redis: a host's address, or the stage's registry URL
    stream: str
    data: bytes
    message: wire.Message | None  # the round passed on; None for a reply to a coordinator
    what: str  # for the log, when it cannot be sent


class Link(Protocol):
    """Where a batch's messages go when it ends."""

    def send(self, outgoing: list[Outgoing]) -> None: ...


class Replies:
    """Encodes a stage's replies to the coordinators of the rounds it was sent. They go to this
    host's reply stream for the session on the stage's own registry (`url`, as configured),
    whatever a message says."""

    def __init__(self, swarm: str, host: str, keys: StageKeys, url: str) -> None:
        self.swarm, self.host, self.keys, self.url = swarm, host, keys, url

    def to(self, message: wire.Message, kind: str, **fields) -> Outgoing:
        """The `kind` reply to `message`'s coordinator, encoded, to be sent."""
        stream = streams.reply_key(self.swarm, message.session, self.host)
        reply = wire.Message(
            kind=kind,
            session=message.session,
            round_id=message.round_id,
            seq=message.seq,
            to=stream,
            sender=self.host,
            **fields,
        )
        data = wire.encode(reply, self.swarm, self.keys.ring)
        return Outgoing(self.url, stream, data, None, f"reply to {message.session}")


def by_destination(outgoing: list[Outgoing]) -> dict[str, list[Outgoing]]:
    """`outgoing` by destination Redis, each in its order."""
    grouped: dict[str, list[Outgoing]] = {}
    for item in outgoing:
        grouped.setdefault(item.url, []).append(item)
    return grouped


class Sender:
    """Writes messages to their Redis, one write per destination. A round that cannot be
    passed on is an error reply to its coordinator; a reply that cannot be sent is the
    coordinator's to time out on."""

    def __init__(
        self,
        host: str,
        connections: streams.Connections,
        maxlen: int,
        replies: Replies,
        stats: StageStats,
    ) -> None:
        self.host = host
        self.connections = connections
        self.maxlen = maxlen
        self.replies = replies
        self.stats = stats

    def send(self, outgoing: list[Outgoing]) -> None:
        for url, items in by_destination(outgoing).items():
            self.send(self.write(url, items))

    def write(self, url: str, items: list[Outgoing]) -> list[Outgoing]:
        """Send `items` to `url` in one write; the error replies owed if it fails."""
        entries = [(item.stream, item.data, item.message is None) for item in items]
        try:
            streams.send_all(self.connections.link(url), entries, self.maxlen)
        except redis.RedisError as exc:
            replies = []
            for item in items:
                reason = f"{self.host}: cannot {item.what}: {exc}"
                log.warning("%s", reason)
                if item.message is not None:
                    self.stats.count("errors")
                    replies.append(self.replies.to(item.message, "unreachable", reason=reason))
            return replies
        return []


class Outbox:
    """What the batch being handled sends, queued until the batch ends, then sent by `link`."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self._queued: list[Outgoing] = []

    def put(self, item: Outgoing) -> None:
        self._queued.append(item)

    def flush(self) -> None:
        """Send what the batch queued."""
        queued, self._queued = self._queued, []
        self.link.send(queued)

    def clear(self) -> None:
        """Forget what was queued (the rounds it was for are read again)."""
        self._queued.clear()
