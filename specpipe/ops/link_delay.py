"""The simulated link delay of the lab and the benchmarks, a test double for a WAN on one
machine: `DelayedLink`, a slow outgoing link that the stages they start
(`python -m specpipe.cli.delayed_stage --link-delay-ms`) put around their `Sender`, and
`DelayedRing`, a coordinator's ring whose link to stage 0 is as slow."""

from __future__ import annotations

import logging
import queue
import threading
import time

from specpipe.swarm import wire
from specpipe.swarm.redis_ring import RedisRing
from specpipe.swarm.stage.sending import Outgoing, Sender, by_destination

log = logging.getLogger("specpipe.stage")


class DelayedLink:
    """Sends each batch `delay_s` after it was handed over, without holding the stage up (a
    link's latency delays what crosses it, not the next forward). One queue and one sending
    thread per destination Redis, in order: a next host gone silent holds up only what goes to
    it. What cannot be sent comes back as error replies, which cross the link too."""

    def __init__(self, sender: Sender, delay_s: float) -> None:
        self.sender = sender
        self.delay_s = delay_s
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._lock = threading.Lock()  # a failed send's error reply comes from a sending thread

    def send(self, outgoing: list[Outgoing]) -> None:
        for url, items in by_destination(outgoing).items():
            with self._lock:
                waiting = self._queues.get(url)
                if waiting is None:
                    waiting = self._queues[url] = queue.SimpleQueue()
                    threading.Thread(target=self._far_end, args=(url, waiting), daemon=True).start()
            waiting.put((time.monotonic() + self.delay_s, items))

    def _far_end(self, url: str, waiting: queue.SimpleQueue) -> None:
        """The link's far end: writes each batch once its delay has passed, in order; the only
        user of that destination's connection."""
        while True:
            due, items = waiting.get()
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                self.send(self.sender.write(url, items))
            except Exception:  # a bad send must not end the link
                log.exception("%s: a delayed send failed", self.sender.host)


class DelayedRing(RedisRing):
    """A `RedisRing` whose link to stage 0 is `delay_s` slower: each round waits that long before
    it goes out (the stages delay their own links), and waits for its reply the longer by the
    delay of every link of the ring. Its twins are as slow."""

    def __init__(self, *args, delay_s: float = 0.0, **options) -> None:
        super().__init__(*args, **options)
        self.delay_s = delay_s

    def send_round(
        self, session: str, send: tuple, round_ids: set[str], wait_s: float
    ) -> wire.Message | None:
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        return super().send_round(session, send, round_ids, wait_s)

    def round_wait_s(self, n_tokens: int) -> float:
        hops = len(self.route) + 1
        return super().round_wait_s(n_tokens) + hops * self.delay_s

    def twin(self) -> DelayedRing:
        twin = super().twin()
        twin.delay_s = self.delay_s
        return twin
