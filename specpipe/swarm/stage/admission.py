"""Which entries of a stage's stream it acts on.

A message is accepted when it is sealed with a key of the swarm's keyring (and, with host
identities, signed by its sender's own key), addressed to this stage's stream, from the sender
its place on the route names (the coordinator for the first hop
and the controls, else the previous hop), with a fresh sequence number larger than any this
stage has seen for the session (its date judged in swarm time, the stage's estimate of the
registry's clock, `specpipe.swarm.clock`). Anything else (malformed, oversized, unsigned,
redirected, replayed or stale) is dropped and counted, and the session goes on as if it never
came; a re-sent round carries a new number, so a coordinator may re-send safely.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from specpipe.swarm import streams, wire
from specpipe.swarm.clock import SwarmClock
from specpipe.swarm.stage.activity import Activity, remember
from specpipe.swarm.stage.counters import StageStats
from specpipe.swarm.stage.keys import StageKeys

log = logging.getLogger("specpipe.stage")

MAX_SEQUENCES = 65536  # sessions whose last sequence number is remembered, dropped ones too


class Admission:
    """Decodes and checks each entry; what passes is noted as its session's activity."""

    def __init__(
        self,
        swarm: str,
        host: str,
        keys: StageKeys,
        max_message_bytes: int,
        stats: StageStats,
        activity: Activity,
        clock: SwarmClock,
    ) -> None:
        self.swarm, self.host = swarm, host
        self.stream = streams.stage_key(swarm, host)
        self.keys = keys
        self.max_message_bytes = max_message_bytes
        self.stats = stats
        self.activity = activity
        self.clock = clock
        self.last_seq: OrderedDict[str, int] = OrderedDict()  # kept after a session ends
        # Reads the inventory and its roster again (the stage's directory), when set.
        self.refresh_roster: Callable[[], None] | None = None

    def admit(self, data: bytes | None) -> wire.Message | None:
        """The entry's message if it is one to act on; else it is counted and dropped."""
        message = self._decode(data)
        if message is None or not self._accept(message):
            return None
        if message.kind in ("round", "reset", "reseed"):
            self.activity.touch(message.session)
        return message

    def count_dead_letters(self, consumer: streams.StreamConsumer) -> None:
        """Count what the read script dropped in Redis (oversized, delivered too often)."""
        for reason in consumer.dropped:
            self.stats.drop(f"in Redis, {reason}")
        consumer.dropped.clear()

    def _decode(self, data: bytes | None) -> wire.Message | None:
        def decode() -> wire.Message:
            return wire.decode(
                data, self.swarm, self.keys.ring, self.max_message_bytes, to=self.stream
            )

        try:
            return decode()
        except (wire.UnknownKeyError, wire.UnknownSenderError) as exc:
            reason = exc
            if self.keys.reload_due():
                # The key may be a rotation's new one (a data key's comes with the roster), the
                # sender a host admitted since.
                self.keys.reload()
                if self.refresh_roster is not None:
                    self.refresh_roster()
                try:
                    return decode()
                except wire.WireError as again:
                    reason = again
        except wire.WireError as exc:
            reason = exc
        self.stats.drop(f"undecodable message: {reason}")
        return None

    def _accept(self, message: wire.Message) -> bool:
        """Whether `message` comes from whom its place says and is the session's next fresh one;
        what is not is counted and dropped."""
        if message.kind == "round" and message.hop > 0 and message.route:
            expected = message.route[message.hop - 1].host
        else:
            expected = wire.COORDINATOR
        if message.sender != expected:
            self.stats.drop(f"a {message.kind!r} from {message.sender!r}, expected {expected!r}")
            return False
        last = self.last_seq.get(message.session, 0)
        if message.seq <= last:
            why = f"not after the session's last ({message.seq} <= {last})"
        elif not wire.is_fresh(message, now := self.clock.now()):
            age_s = now - message.seq / 1_000_000
            why = f"dated {age_s:+.3f} s ago, waited for {message.wait_ms} ms"
        else:
            remember(self.last_seq, message.session, message.seq, MAX_SEQUENCES)
            return True
        self.stats.count("replayed")
        log.warning(
            "%s: dropped a replayed or stale %r of session %s: %s",
            self.host,
            message.kind,
            message.session,
            why,
        )
        return False
