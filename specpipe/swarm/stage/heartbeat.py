"""A stage's heartbeat: every `heartbeat_s`, from a thread of its own, the node's signed
inventory record (with the round trip to the hop its rounds go on to), the stage's counters,
and a fresh read of the other hosts' addresses (`stage.directory`).

Its own thread, whatever the serving loop is doing: a coordinator with a spare takes a record
that stops coming for a dead stage, so a long forward must not hold a beat up. Nor may the
round trip to the next hop: a host cut off mid-round answers no PING until the socket times out,
seconds in which this stage's own record would lapse and take the stage out of its routes. So
the next hop is timed on a second thread, and each beat publishes the latest timing it has.
The record is published from here only, dated in swarm time (the stage's `SwarmClock`: the
registry's clock, whatever this host's says) and carrying how far this host's clock is off it."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import redis

from specpipe.swarm import inventory, streams
from specpipe.swarm.clock import SwarmClock
from specpipe.swarm.dialing import Dialer
from specpipe.swarm.stage.counters import StageStats
from specpipe.swarm.stage.directory import Directory
from specpipe.swarm.stage.keys import StageKeys

log = logging.getLogger("specpipe.stage")


class Heartbeat:
    """Publishes `node` (none: counters only) to the registry and flushes `stats`."""

    def __init__(
        self,
        node: inventory.NodeInfo | None,
        host: str,
        swarm: str,
        registry_url: str,
        heartbeat_s: float,
        keys: StageKeys,
        stats: StageStats,
        next_hop: Callable[[], tuple[str, str] | None],
        dialer: Dialer,
        directory: Directory,
        clock: SwarmClock,
    ) -> None:
        self.node = node
        self.host = host
        self.swarm = swarm
        self.registry_url = registry_url
        self.heartbeat_s = heartbeat_s
        self.keys = keys
        self.stats = stats
        self.next_hop = next_hop  # (host, Redis address) the stage's rounds went on to last
        self.dialer = dialer
        self.directory = directory
        self.clock = clock

    @contextlib.contextmanager
    def beating(self) -> Iterator[None]:
        """Beat from a thread while the block runs."""
        stop = threading.Event()
        threads = [
            threading.Thread(target=self._beat, args=(stop,), daemon=True),
            threading.Thread(target=self._probe, args=(stop,), daemon=True),
        ]
        for thread in threads:
            thread.start()
        try:
            yield
        finally:
            stop.set()
            for thread in threads:
                thread.join()

    def _beat(self, stop: threading.Event) -> None:
        registry = None
        if self.node is not None:  # its own client: not the serving loop's
            registry = redis.Redis.from_url(
                self.dialer.url(self.registry_url), socket_timeout=5, socket_connect_timeout=5
            )
        try:
            while not stop.is_set():
                if registry is not None:
                    self.publish(registry)
                    self.directory.refresh(registry)
                self.flush_stats()
                stop.wait(self.heartbeat_s)
        finally:
            if registry is not None:
                registry.close()

    def _probe(self, stop: threading.Event) -> None:
        """Time the next hop every `heartbeat_s` until `stop` (see the module's docstring)."""
        if self.node is None:
            return
        probes = streams.Connections(self.dialer)
        try:
            while not stop.is_set():
                self.measure_next_hop(probes)
                stop.wait(self.heartbeat_s)
        finally:
            probes.close()

    def measure_next_hop(self, probes: streams.Connections) -> float | None:
        """Time a PING to the Redis of the hop this stage's rounds go on to and put it in the
        node's record; None (nothing recorded) before the first round or when it fails."""
        next_hop = self.next_hop()
        if next_hop is None or self.node is None:
            return None
        host, url = next_hop
        try:
            client = probes.get(url)
            client.ping()  # the connection is made: the timing below is one round trip
            started = time.perf_counter()
            client.ping()
            rtt_ms = (time.perf_counter() - started) * 1000
        except redis.RedisError as exc:
            log.warning("%s: cannot reach %s's Redis: %s", self.host, host, exc)
            return None
        self.node = replace(self.node, next_hop=host, next_hop_rtt_ms=round(rtt_ms, 3))
        return rtt_ms

    def publish(self, registry: redis.Redis) -> None:
        """Publish this node's signed record now."""
        node = replace(self.node, clock_offset_s=round(self.clock.offset_s, 3))
        try:
            inventory.publish(registry, self.swarm, node, self.keys.ring, now=self.clock.now())
        except redis.RedisError as exc:
            log.warning("%s: heartbeat failed: %s", self.host, exc)

    def flush_stats(self) -> None:
        """Write the counters now, where `specpipe nodes` and the tests read them."""
        try:
            self.stats.flush()
        except redis.RedisError as exc:
            log.warning("%s: heartbeat failed: %s", self.host, exc)
