"""A stage's counters and running timings, and their hash in Redis (`streams.stats_key`),
where `specpipe nodes`, the benchmarks and the tests read them."""

from __future__ import annotations

import logging
import threading

import redis

from specpipe.swarm import streams

log = logging.getLogger("specpipe.stage")

TIMING_WEIGHT = 0.1  # of the latest round in the running means of round timings
# `processed` counts rounds, `forwards` the forwards they ran in (a batch of rounds is one), so
# processed / forwards over an interval is its mean batch size; `misrouted` counts rounds refused
# for being routed here for layers or a model this stage does not serve (`stage.routing`), and
# `trees` the rounds a tail verified as draft trees, `prefix_hits` and `prefix_misses` the
# sessions started from a kept prefix and those whose prefix was not held here
# (`stage.prefixes`).
COUNTERS = (
    "processed",
    "forwards",
    "dropped",
    "replayed",
    "gaps",
    "errors",
    "misrouted",
    "trees",
    "prefix_hits",
    "prefix_misses",
)
# What the stage holds now rather than counts: its kept prefixes and their positions.
GAUGES = ("kept_prefixes", "kept_tokens")


class StageStats:
    """What one stage has done: counts of rounds and of what it dropped, running means of its
    round timings. Safe to use from the serving loop and the heartbeat and link threads."""

    def __init__(self, client: redis.Redis, swarm: str, host: str) -> None:
        self.client = client
        self.host = host
        self.key = streams.stats_key(swarm, host)
        self.counters = dict.fromkeys(COUNTERS, 0)
        # Running means over processed rounds: the forward, and everything else in handling a
        # round here (checking, decoding, encoding, sending on): what this hop adds.
        self.timings = {"forward_ms": 0.0, "hop_ms": 0.0, "batch_size": 0.0}
        self.gauges = dict.fromkeys(GAUGES, 0)
        # One writer at a time, so that the hash never goes back to an older count.
        self._lock = threading.Lock()

    def count(self, event: str) -> None:
        """One more `event`, written at once: drops, replays, gaps, errors and refused rounds are
        rare and worth seeing at once (the processed count waits for the next `flush`)."""
        with self._lock:
            self.counters[event] += 1
            self._write({event: self.counters[event]})

    def drop(self, reason: str) -> None:
        """A message dropped for `reason`: logged and counted."""
        log.warning("%s: dropped %s", self.host, reason)
        self.count("dropped")

    def set_gauges(self, values: dict[str, int]) -> None:
        """What the stage holds now, written at once."""
        with self._lock:
            self.gauges.update(values)
            self._write(values)

    def note_batch(self, size: int) -> None:
        """A forward of `size` rounds ran."""
        self.counters["processed"] += size
        self.counters["forwards"] += 1
        mean = self.timings["batch_size"]
        first = self.counters["processed"] == size
        self.timings["batch_size"] = size if first else mean + TIMING_WEIGHT * (size - mean)

    def time_round(self, total_s: float, forward_s: float) -> None:
        """A round took `total_s` here, `forward_s` of it in the forward."""
        first = self.counters["processed"] == 1
        latest = {"forward_ms": forward_s * 1000, "hop_ms": (total_s - forward_s) * 1000}
        for name, ms in latest.items():
            mean = self.timings[name]
            self.timings[name] = ms if first else mean + TIMING_WEIGHT * (ms - mean)

    def flush(self) -> None:
        """Write every counter and timing now."""
        with self._lock:
            self._write(self._snapshot())

    def _snapshot(self) -> dict[str, float]:
        timings = {name: round(value, 3) for name, value in self.timings.items()}
        return {**self.counters, **timings, **self.gauges}

    def _write(self, mapping: dict) -> None:
        try:
            self.client.hset(self.key, mapping=mapping)
        except redis.ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            # Another writer put something else under our key: ours again, with every counter.
            log.warning("%s: %s was not a hash; rewritten", self.host, self.key)
            rewrite = self.client.pipeline().delete(self.key)
            rewrite.hset(self.key, mapping=self._snapshot()).execute()
