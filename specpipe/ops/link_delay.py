"""The simulated link delay of the lab and the benchmarks, a test double for a WAN on one
machine: `DelayedLink`, a slow outgoing link that the stages they start
(`python -m specpipe.cli.delayed_stage --link-delay-ms`) put around their `Sender`."""

from __future__ import annotations

import logging
import queue
import threading
import time

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
