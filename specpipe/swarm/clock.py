"""Swarm time: the registry Redis's clock, as this process estimates it.

Liveness (how old a stage's last heartbeat is) and freshness (how old a message is) compare a
time one host wrote with another host's now. On each host's own wall clock a stage whose clock
runs slow would look dead, and one whose clock runs fast would hide its death; so both are
judged on one clock that no stage controls, the registry Redis's `TIME`. Each process estimates
its offset from it NTP-style and stamps and judges in swarm time, `time.time() + offset`: any
skew of a stage's clock, or of host 0's, cancels out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import redis

log = logging.getLogger("specpipe.clock")

REFRESH_S = 10.0  # an estimate older than this is taken again, at the next read of the clock
RETRY_S = 1.0  # after a failed sample, the next try waits this long
SAMPLES = 5  # the estimate is the sample with the smallest round trip among the last these
FAR_OFF_S = 1.0  # a host clock further than this off the registry's is logged
STEP_S = 0.1  # this host's clock moved this far against its monotonic one: it was stepped


@dataclass(frozen=True)
class Sample:
    """One exchange with the registry: its clock less ours, right within half the round trip."""

    offset_s: float
    rtt_s: float


def measure(client: redis.Redis) -> Sample:
    """One sample: our clock before (t0) and after (t1) the registry's `TIME`. The server read
    its clock somewhere in between; the midpoint is the best guess."""
    t0 = time.time()
    seconds, micros = client.time()
    t1 = time.time()
    server = seconds + micros / 1_000_000
    return Sample(offset_s=server - (t0 + t1) / 2, rtt_s=max(t1 - t0, 0.0))


class SwarmClock:
    """This process's estimate of the registry's clock, over `client` (a registry connection).

    Thread-safe: one thread samples at a time while the others go on with the estimate there
    is (the first estimate is waited for). On a Redis error the last estimate holds; with none
    yet, the offset is 0 (this host's own clock) and a warning is logged."""

    def __init__(self, client: redis.Redis, refresh_s: float = REFRESH_S) -> None:
        self.client = client
        self.refresh_s = refresh_s
        self._samples: deque[Sample] = deque(maxlen=SAMPLES)
        self._best: Sample | None = None
        self._due = 0.0  # time.monotonic() from which the estimate is taken again
        self._wall_less_monotonic = 0.0  # at the last sample: a change is a step of our clock
        self._sampling = threading.Lock()
        self._far_off = False
        self._failing = False  # the last try failed: said once, until one succeeds

    def now(self) -> float:
        """Swarm time, in seconds since the epoch."""
        offset = self.offset_s  # first: it may take a sample
        return time.time() + offset

    @property
    def offset_s(self) -> float:
        """The registry's clock less this host's (re-estimated first when due)."""
        if self._stale() and self._sampling.acquire(blocking=self._best is None):
            try:
                if self._stale():
                    self._sample()
            finally:
                self._sampling.release()
        best = self._best
        return best.offset_s if best is not None else 0.0

    @property
    def rtt_s(self) -> float | None:
        """The round trip of the sample the estimate comes from (twice its error at most)."""
        best = self._best
        return best.rtt_s if best is not None else None

    def _stale(self) -> bool:
        """Whether to sample again: the estimate is old, or this host's clock was stepped (by
        NTP, by hand) since, which the estimate would otherwise carry for `refresh_s`."""
        stepped = abs(time.time() - time.monotonic() - self._wall_less_monotonic) > STEP_S
        return stepped or time.monotonic() >= self._due

    def _sample(self) -> None:
        self._wall_less_monotonic = time.time() - time.monotonic()
        try:
            sample = measure(self.client)
        except redis.RedisError as exc:
            self._due = time.monotonic() + RETRY_S
            if not self._failing:
                if self._best is None:
                    kept = "judging time on this host's own"
                else:
                    kept = f"keeping the offset {self._best.offset_s:+.3f} s"
                log.warning("cannot read the registry's clock (%s): %s", exc, kept)
            self._failing = True
            return
        if self._failing:
            log.info("the registry's clock answers again")
        self._failing = False
        self._due = time.monotonic() + self.refresh_s
        # Each sample puts the offset within half its round trip. One whose range misses the new
        # sample's predates a step of either clock: only the samples since are kept.
        kept = [
            s
            for s in self._samples
            if abs(s.offset_s - sample.offset_s) <= (s.rtt_s + sample.rtt_s) / 2
        ]
        self._samples = deque([*kept, sample], maxlen=SAMPLES)
        self._best = min(reversed(self._samples), key=lambda s: s.rtt_s)  # the newest of equals
        offset = self._best.offset_s
        far_off = abs(offset) > FAR_OFF_S
        if far_off and not self._far_off:
            log.warning(
                "this host's clock is %.1f s %s the registry's: times are judged on the registry's",
                abs(offset),
                "behind" if offset > 0 else "ahead of",
            )
        self._far_off = far_off
