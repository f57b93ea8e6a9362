"""Which admitted messages run together: rounds of different sessions as one forward, after a
brief wait for the rounds of other sessions due with them (`specpipe.swarm.gathering`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import redis

from specpipe.swarm import gathering, streams, wire

MAX_BATCH = 16  # rounds in one forward: what one read of the stream takes at most


class Batcher:
    """Learns when each session's rounds arrive, waits for those due, and cuts the messages
    into batches. `admit` turns entries read while waiting into admitted messages; `batching`
    is whether the stage runs several sessions in one forward at all (`forward_many`)."""

    def __init__(
        self,
        consumer: streams.StreamConsumer,
        admit: Callable[[list[bytes | None]], list[wire.Message]],
        batching: bool,
    ) -> None:
        self.consumer = consumer
        self.admit = admit
        self.batching = batching
        self.arrivals = gathering.Arrivals()  # when each session's next round is due here

    def note(self, messages: list[wire.Message]) -> None:
        """The rounds among `messages` arrived now."""
        now = time.monotonic()
        for message in messages:
            if message.kind == "round":
                steady = len(message.tokens) == message.n_draft + 1  # one committed token
                self.arrivals.note(message.session, now, steady)

    def forget(self, session: str) -> None:
        self.arrivals.forget(session)

    def size(self) -> int:
        """The most rounds one forward takes now (see `gathering.Arrivals.group_size`)."""
        return min(self.arrivals.group_size(time.monotonic()), MAX_BATCH)

    def gather(self, messages: list[wire.Message], size: int) -> list[tuple[bytes, bytes]]:
        """Before a forward, wait briefly for the rounds of other sessions due here now, until
        the forward has `size`, appending them to `messages`; the entries read meanwhile."""
        read: list[tuple[bytes, bytes]] = []
        if not self.batching or not any(m.kind == "round" for m in messages):
            return read
        now = time.monotonic()
        present = {m.session for m in messages}
        awaited, until = self.arrivals.due(present, now)
        while awaited and now < until and len(present) < size:
            time.sleep(gathering.POLL_S)
            try:
                entries = self.consumer.read(size - len(present), block_ms=0)
            except (redis.ConnectionError, redis.TimeoutError):
                break  # run what was read; the serve loop waits for Redis at its next read
            read += entries
            for message in self.admit([data for _, data in entries]):
                messages.append(message)
                awaited.discard(message.session)
                present.add(message.session)
            now = time.monotonic()
        return read

    def batches(self, messages: list[wire.Message], size: int) -> Iterator[list[wire.Message]]:
        """`messages` in order, cut into what runs together: rounds of different sessions that
        come one after another, at most `size` of them; a control message, or a second round of
        a session, ends such a batch and runs alone."""
        batch: list[wire.Message] = []
        for message in messages:
            if message.kind == "round" and self.batching:
                if len(batch) >= size or any(m.session == message.session for m in batch):
                    yield batch
                    batch = []
                batch.append(message)
                continue
            if batch:
                yield batch
            batch = []
            yield [message]
        if batch:
            yield batch
