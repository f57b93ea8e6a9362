"""The stage worker's loop: read rounds from this host's stream, run the stage, pass them on.

Generic over the `Stage` protocol: it reads `specpipe:{swarm}:stage:{host}` on its own Redis as
a member of the stage consumer group, verifies each message, runs `stage.forward`, and sends the
hidden states to the next hop's stream on that hop's Redis, or, on the tail, samples the
doctored result vector with the session's parameters and sends it to the coordinator's reply
stream. A stage that has lost a session's cache answers `gap`. Per-session `reset` (the tail
keeps temp, top_p, top_k and seed, and whether to send the committed tokens' log-probabilities
with each result), `reseed` (new parameters, caches kept) and `drop` arrive as
signed messages on the same stream, so they are ordered with the rounds. Rounds of several
sessions read together run as one forward; before it, the stage waits briefly for the rounds of
other sessions due with them (`specpipe.swarm.gathering`), and what a batch sends leaves in one
write per destination, so the next stage reads it as one batch too.

What is accepted: a message signed with a key of the swarm's keyring, addressed to this stage's
stream, from the sender its place on the route names (the coordinator for the first hop and the
controls, else the previous hop), with a fresh sequence number larger than any this stage has
seen for the session. Anything else (malformed, oversized, unsigned, redirected, replayed or
stale) is dropped and counted, and the session goes on undisturbed; a re-sent round carries a
new number, so a coordinator may re-send safely. Whatever an entry holds, handling it ends in
an ack: nothing can make the stage crash or read it again.

A session that sees no message for `session_idle_s` (its coordinator died, or went away without
a drop) is forgotten at the next heartbeat: its caches are freed, and if its job comes back the
coordinator gets a gap and replays. A stage whose caches hold more than its KV budget (its
inventory record's `kv_budget_tokens`, `kv_budget`) forgets, at a heartbeat, the sessions idle
longest among those idle for `OVER_BUDGET_IDLE_S`. One process per stage: nothing is forked.
"""

from __future__ import annotations

import gc
import logging
import queue
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import redis
import torch

from specpipe.core.coupling import sampler_for
from specpipe.core.ring import GapError, Request, Stage
from specpipe.core.sampling import Sampler, SamplingParams
from specpipe.model import heap
from specpipe.settings import (
    DEFAULT_HEARTBEAT_S,
    TEST_LOSSY_TAIL_VAR,
    kv_budget_tokens,
    test_lossy_tail,
)
from specpipe.swarm import gathering, inventory, kvbudget, streams, wire

if TYPE_CHECKING:
    from specpipe.drafting.head import TailHead

log = logging.getLogger("specpipe.stage")

TIMING_WEIGHT = 0.1  # of the latest round in the running means of round timings
MAX_SESSIONS = 4096  # sessions whose sampling parameters are kept
MAX_SEQUENCES = 65536  # sessions whose last sequence number is remembered, dropped ones too
KEY_RELOAD_S = 1.0  # an unknown key id reloads the keyring at most this often
OVER_BUDGET_IDLE_S = 30.0  # over the KV budget, a session idle this long is forgotten
# `processed` counts rounds, `forwards` the forwards they ran in (a batch of rounds is one), so
# processed / forwards over an interval is its mean batch size.
MAX_BATCH = 16  # rounds in one forward: what one read of the stream takes at most
COUNTERS = ("processed", "forwards", "dropped", "replayed", "gaps", "errors")


@dataclass(frozen=True)
class Outgoing:
    """One message a stage sends: queued while its batch runs, sent with the batch's others."""

    url: str  # the destination Redis
    stream: str
    data: bytes
    message: wire.Message | None  # the round passed on; None for a reply to a coordinator
    what: str  # for the log, when it cannot be sent


@dataclass(frozen=True)
class WorkerConfig:
    """Where a stage worker reads, where it registers, and how it signs."""

    host: str
    swarm: str
    keys: wire.Keyring | bytes | str  # the swarm's keyring (a single key is a ring of one)
    redis_url: str  # this host's Redis: its input stream lives here
    registry_url: str | None = None  # the inventory's Redis; default: redis_url
    consumer: str | None = None  # consumer name in the group; default: host
    maxlen: int = streams.DEFAULT_MAXLEN
    block_ms: int = 1000
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    claim_idle_ms: int = 30_000
    max_message_bytes: int = wire.MAX_MESSAGE_BYTES
    link_delay_s: float = 0.0  # simulated latency of this host's outgoing link (benchmarks)
    session_idle_s: float = 600.0  # a session untouched this long is dropped
    # Where a new keyring comes from after `specpipe key rotate`: asked at each heartbeat and
    # when a message names a key this stage does not hold.
    reload_keys: Callable[[], wire.Keyring] | None = None


class StageWorker:
    """Serves one stage from its Redis stream until stopped."""

    def __init__(
        self,
        stage: Stage,
        config: WorkerConfig,
        node: inventory.NodeInfo | None = None,
        head: TailHead | None = None,
    ) -> None:
        self.stage = stage
        self.config = config
        self.head = head  # the tail's draft head (`drafthead.load_with_head`), if it has one
        # The record says what this process does, whatever the caller built it with.
        self.kv_budget_tokens = kv_budget(stage)
        self.node = None
        if node is not None:
            self.node = replace(
                node,
                test_lossy_tail=test_lossy_tail(),
                kv_budget_tokens=self.kv_budget_tokens,
                heartbeat_s=config.heartbeat_s,
                link_delay_ms=config.link_delay_s * 1000,
            )
        # Where this stage's rounds went on to last (host, Redis URL): the link it measures.
        self.next_hop: tuple[str, str] | None = None
        self.keys = wire.keyring(config.keys)
        self.stream = streams.stage_key(config.swarm, config.host)
        self.connections = streams.Connections()
        self.client = self.connections.get(config.redis_url)
        self.consumer = streams.StreamConsumer(
            self.client,
            self.stream,
            config.consumer or config.host,
            claim_idle_ms=config.claim_idle_ms,
            max_bytes=config.max_message_bytes,
            dead=streams.dead_key(config.swarm, config.host),
        )
        self.counters = dict.fromkeys(COUNTERS, 0)
        # Running means over processed rounds: the forward, and everything else in handling a
        # round here (checking, decoding, encoding, sending on): what this hop adds.
        self.timings = {"forward_ms": 0.0, "hop_ms": 0.0, "batch_size": 0.0}
        self._samplers: OrderedDict[str, Sampler] = OrderedDict()  # the tail's, per session
        self._last_seq: OrderedDict[str, int] = OrderedDict()  # kept after a session ends
        self._last_used: dict[str, float] = {}  # session -> monotonic time of its last message
        self._next_heartbeat = 0.0
        self._next_key_reload = 0.0
        # On a slow link, one outbox and sending thread per destination Redis, (due, send) in
        # order: a next host gone silent holds up only what goes to it.
        self._outboxes: dict[str, queue.SimpleQueue] = {}
        self._outbox_lock = threading.Lock()  # a failed send's error reply comes from a sender
        self._outgoing: list[Outgoing] = []  # what the batch being handled sends
        self.arrivals = gathering.Arrivals()  # when each session's next round is due here

    def serve(self, stop: threading.Event | None = None) -> None:
        """Process messages until `stop` is set."""
        stop = stop or threading.Event()
        beating = threading.Event()
        beat = threading.Thread(target=self._beat, args=(beating,), daemon=True)
        if self.node is not None:
            beat.start()
        try:
            self._serve(stop)
        finally:
            beating.set()
            if beat.is_alive():
                beat.join()

    def _beat(self, stop: threading.Event) -> None:
        """Publish the node's record every `heartbeat_s` until `stop`, whatever the serving
        loop is doing: a coordinator with a spare takes a record that stops coming for a dead
        stage, so a long forward must not hold a beat up. Its own client: not the loop's."""
        registry = redis.Redis.from_url(
            self.config.registry_url or self.config.redis_url,
            socket_timeout=5,
            socket_connect_timeout=5,
        )
        probes = streams.Connections()
        try:
            while not stop.is_set():
                self.measure_next_hop(probes)
                self.publish(registry)
                stop.wait(self.config.heartbeat_s)
        finally:
            registry.close()
            probes.close()

    def measure_next_hop(self, probes: streams.Connections) -> float | None:
        """Time a PING to the Redis of the hop this stage's rounds go on to and put it in the
        node's record; None (nothing recorded) before the first round or when it fails."""
        if self.next_hop is None or self.node is None:
            return None
        host, url = self.next_hop
        try:
            client = probes.get(url)
            client.ping()  # the connection is made: the timing below is one round trip
            started = time.perf_counter()
            client.ping()
            rtt_ms = (time.perf_counter() - started) * 1000
        except redis.RedisError as exc:
            log.warning("%s: cannot reach %s's Redis: %s", self.config.host, host, exc)
            return None
        self.node = replace(self.node, next_hop=host, next_hop_rtt_ms=round(rtt_ms, 3))
        return rtt_ms

    def publish(self, registry: redis.Redis) -> None:
        """Publish this node's signed record now (its heartbeat)."""
        try:
            inventory.publish(registry, self.config.swarm, self.node, self.keys.current)
        except redis.RedisError as exc:
            log.warning("%s: heartbeat failed: %s", self.config.host, exc)

    def _serve(self, stop: threading.Event) -> None:
        wait_s = 0.0
        while not stop.is_set():
            try:
                self.heartbeat()
                self.serve_once()
                wait_s = 0.0
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # Our own Redis is away: keep the caches and wait for it to come back, then
                # re-read what we had taken but not acknowledged.
                wait_s = min(max(2 * wait_s, 0.1), 5.0)
                log.warning(
                    "%s: Redis unavailable (%s); retrying in %.1f s", self.config.host, exc, wait_s
                )
                self.consumer.rewind()
                self._outgoing.clear()  # the rounds they were for are read again
                stop.wait(wait_s)
        try:
            self.consumer.flush()
            self.flush_counters()
        except redis.RedisError as exc:
            log.warning("%s: could not flush acks and counters: %s", self.config.host, exc)

    def serve_once(self) -> None:
        """Read what waits in the stream (waiting up to `block_ms`), gather the rounds due with
        it, act on all of it and acknowledge it."""
        entries = self.consumer.read(MAX_BATCH, block_ms=self.config.block_ms)
        messages = self._admit_all([data for _, data in entries])
        size = self._batch_size()
        entries += self._gather(messages, size)
        self._count_dead_letters()
        self.process(messages, size)
        self.consumer.ack(entry_id for entry_id, _ in entries)

    def heartbeat(self, force: bool = False) -> None:
        """Refresh this node's inventory record and counters, and forget idle sessions, when
        a beat is due (the record is also refreshed by `serve`'s own beat)."""
        now = time.monotonic()
        if not force and now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.config.heartbeat_s
        self.forget_idle_sessions(now)
        self.keep_within_budget(now)
        self.reload_keys()
        try:
            if self.node is not None:
                registry = self.connections.get(self.config.registry_url or self.config.redis_url)
                inventory.publish(registry, self.config.swarm, self.node, self.keys.current)
            self.flush_counters()
        except redis.RedisError as exc:
            log.warning("%s: heartbeat failed: %s", self.config.host, exc)

    def reload_keys(self) -> None:
        """Take the keyring `reload_keys` gives now (a rotation may have changed it)."""
        if self.config.reload_keys is None:
            return
        self._next_key_reload = time.monotonic() + KEY_RELOAD_S
        try:
            self.keys = self.config.reload_keys()
        except (OSError, ValueError) as exc:  # keep the keys we have
            log.warning("%s: cannot reload the swarm keys: %s", self.config.host, exc)

    def forget_idle_sessions(self, now: float | None = None) -> list[str]:
        """Drop every session without a message for `session_idle_s`; return their names."""
        cutoff = (time.monotonic() if now is None else now) - self.config.session_idle_s
        idle = [s for s, used in self._last_used.items() if used < cutoff]
        for session in idle:
            self._forget(session)
        if idle:
            log.info("%s: dropped %d idle session(s)", self.config.host, len(idle))
        return idle

    def keep_within_budget(self, now: float | None = None) -> list[str]:
        """While the caches hold more tokens than the budget, forget the session idle longest,
        if it has been idle for `OVER_BUDGET_IDLE_S`: the room coordinators reserve ends with
        their jobs (or their locks), but a cache lives on here until its drop, or until
        `session_idle_s`. A session forgotten too early costs only a replay (a gap)."""
        held_tokens = getattr(self.stage, "held_tokens", None)
        if not self.kv_budget_tokens or held_tokens is None:
            return []
        held = held_tokens()
        total = sum(held.values())
        cutoff = (time.monotonic() if now is None else now) - OVER_BUDGET_IDLE_S
        forgotten = []
        for session in sorted(held, key=lambda s: self._last_used.get(s, 0.0)):
            if total <= self.kv_budget_tokens or self._last_used.get(session, 0.0) > cutoff:
                break
            self._forget(session)
            total -= held[session]
            forgotten.append(session)
        if forgotten:
            log.info(
                "%s: over the KV budget; dropped %d idle session(s)",
                self.config.host,
                len(forgotten),
            )
        return forgotten

    def _forget(self, session: str) -> None:
        self.stage.drop(session)
        self.arrivals.forget(session)
        self._samplers.pop(session, None)
        self._last_used.pop(session, None)

    def flush_counters(self) -> None:
        """Write the counters where `specpipe nodes` and the tests can read them."""
        self._write_stats(self._stats())

    def _stats(self) -> dict[str, float]:
        timings = {name: round(value, 3) for name, value in self.timings.items()}
        return {**self.counters, **timings}

    def _write_stats(self, mapping: dict) -> None:
        key = streams.stats_key(self.config.swarm, self.config.host)
        try:
            self.client.hset(key, mapping=mapping)
        except redis.ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            # Another writer put something else under our key: ours again, with every counter.
            log.warning("%s: %s was not a hash; rewritten", self.config.host, key)
            self.client.pipeline().delete(key).hset(key, mapping=self._stats()).execute()

    def handle_many(self, entries: list[bytes | None]) -> None:
        """Process a read's entries in order; never raises for an entry."""
        self.process(self._admit_all(entries))

    def _admit_all(self, entries: list[bytes | None]) -> list[wire.Message]:
        admitted = (self._safely(self._admit, data) for data in entries)
        return [message for message in admitted if message is not None]

    def _batch_size(self) -> int:
        """The most rounds one forward takes now (see `gathering.Arrivals.group_size`)."""
        return min(self.arrivals.group_size(time.monotonic()), MAX_BATCH)

    def process(self, messages: list[wire.Message], size: int | None = None) -> None:
        """Act on admitted messages in order. Rounds of different sessions that come one after
        another run as one forward (`Stage.forward_many`, where the stage has it), at most
        `size` of them (by default `_batch_size`); a control message, or a second round of a
        session, ends such a batch. What a batch sends goes out when it ends, one write per
        destination."""
        batch: list[wire.Message] = []
        size = size or self._batch_size()
        for message in messages:
            if message.kind == "round" and self._batching:
                if len(batch) >= size or any(m.session == message.session for m in batch):
                    self._run(batch)
                    batch = []
                batch.append(message)
                continue
            self._run(batch)
            batch = []
            self._run([message])
        self._run(batch)

    def _run(self, batch: list[wire.Message]) -> None:
        if batch:
            self._safely(self._run_batch, batch)
            self._safely(self._flush_sends)

    def _gather(self, messages: list[wire.Message], size: int) -> list[tuple[bytes, bytes]]:
        """Before a forward, wait briefly for the rounds of other sessions due here now (see
        `specpipe.swarm.gathering`), until the forward has `size`, appending them to `messages`; the
        entries read meanwhile."""
        read: list[tuple[bytes, bytes]] = []
        if not self._batching or not any(m.kind == "round" for m in messages):
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
            for message in self._admit_all([data for _, data in entries]):
                messages.append(message)
                awaited.discard(message.session)
                present.add(message.session)
            now = time.monotonic()
        return read

    def _safely(self, step, *args):
        """`step(*args)`, with anything it raises counted and logged: an entry never stops the
        stage (it is acked either way; a Redis outage is the serve loop's to wait out)."""
        try:
            return step(*args)
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except Exception:
            log.exception("%s: an entry could not be handled; dropped", self.config.host)
            try:
                self._count("errors")
            except redis.RedisError:
                pass
            return None

    def _count_dead_letters(self) -> None:
        for reason in self.consumer.dropped:
            self._drop(f"in Redis, {reason}")
        self.consumer.dropped.clear()

    def handle(self, data: bytes | None) -> None:
        """Process one stream entry; never raises for a bad message."""
        self.handle_many([data])

    def _admit(self, data: bytes | None) -> wire.Message | None:
        """The entry's message if it is one to act on; else it is counted and dropped."""
        message = self._decode(data)
        if message is None or not self._accept(message):
            return None
        if message.kind in ("round", "reset", "reseed"):
            self._last_used[message.session] = time.monotonic()
        if message.kind == "round":
            steady = len(message.tokens) == message.n_draft + 1  # one committed token: a step
            self.arrivals.note(message.session, self._last_used[message.session], steady)
        return message

    @property
    def _batching(self) -> bool:
        return hasattr(self.stage, "forward_many")

    def _run_batch(self, messages: list[wire.Message]) -> None:
        """Rounds of different sessions as one forward; one round alone as `_round` runs it."""
        if len(messages) == 1:
            self._dispatch(messages[0])
        elif messages:
            self._rounds(messages)

    def _dispatch(self, message: wire.Message) -> None:
        started = time.perf_counter()
        if message.kind == "round":
            forward_s = self._round(message)
            if forward_s is not None:
                self._time_round(time.perf_counter() - started, forward_s)
        elif message.kind in ("reset", "reseed"):
            self._set_params(message)
        elif message.kind == "drop":
            self._forget(message.session)
        else:
            self._drop(f"a {message.kind!r} message does not belong on a stage stream")

    def _decode(self, data: bytes | None) -> wire.Message | None:
        def decode() -> wire.Message:
            return wire.decode(
                data, self.config.swarm, self.keys, self.config.max_message_bytes, to=self.stream
            )

        try:
            return decode()
        except wire.UnknownKeyError as exc:
            reason = exc
            if time.monotonic() >= self._next_key_reload:
                self.reload_keys()  # the key may be a rotation's new one
                try:
                    return decode()
                except wire.WireError as again:
                    reason = again
        except wire.WireError as exc:
            reason = exc
        self._drop(f"undecodable message: {reason}")
        return None

    def _accept(self, message: wire.Message) -> bool:
        """Whether `message` comes from whom its place says and is the session's next fresh one;
        what is not is counted and dropped, and the session goes on as if it never came."""
        if message.kind == "round" and message.hop > 0 and message.route:
            expected = message.route[message.hop - 1].host
        else:
            expected = wire.COORDINATOR
        if message.sender != expected:
            self._drop(f"a {message.kind!r} from {message.sender!r}, expected {expected!r}")
            return False
        last = self._last_seq.get(message.session, 0)
        if message.seq <= last or not wire.is_fresh(message.seq):
            self._count("replayed")
            log.warning(
                "%s: dropped a replayed or stale %r of session %s",
                self.config.host,
                message.kind,
                message.session,
            )
            return False
        self._remember(self._last_seq, message.session, message.seq, MAX_SEQUENCES)
        return True

    def _time_round(self, total_s: float, forward_s: float) -> None:
        first = self.counters["processed"] == 1
        latest = {"forward_ms": forward_s * 1000, "hop_ms": (total_s - forward_s) * 1000}
        for name, ms in latest.items():
            mean = self.timings[name]
            self.timings[name] = ms if first else mean + TIMING_WEIGHT * (ms - mean)

    def _drop(self, reason: str) -> None:
        log.warning("%s: dropped %s", self.config.host, reason)
        self._count("dropped")

    def _count(self, event: str) -> None:
        # Drops, replays, gaps and errors are rare and worth seeing at once; the processed
        # count waits for the next heartbeat.
        self.counters[event] += 1
        self._write_stats({event: self.counters[event]})

    def _set_params(self, message: wire.Message) -> None:
        if message.kind == "reset":  # a reseed keeps the caches (many draws from one context)
            self.stage.drop(message.session)
        try:
            sampler = _sampler_for(SamplingParams.from_fields(message.params))
        except (KeyError, IndexError, ValueError, TypeError, OverflowError) as exc:
            self._drop(f"reset with bad sampling parameters: {exc}")
            return
        self._remember(self._samplers, message.session, sampler)

    def _round(self, message: wire.Message) -> float | None:
        """Run one round and pass it on; the forward's seconds, or None if it did not run."""
        inputs = self._inputs(message)
        if inputs is None:
            return None
        try:
            forward_started = time.perf_counter()
            out = self.stage.forward(
                message.session, inputs, message.start_pos, last_rows=self._last_rows(message)
            )
            forward_s = time.perf_counter() - forward_started
        except Exception as exc:  # a bad round must not take the stage down
            self._failed(message, exc)
            return None
        self._note_batch(1)
        self._pass_on(message, out)
        return forward_s

    def _rounds(self, messages: list[wire.Message]) -> None:
        """Rounds of different sessions as one forward, each then passed on as it would alone."""
        started = time.perf_counter()
        ready = [(m, x) for m in messages if (x := self._inputs(m)) is not None]
        if not ready:
            return
        requests = [Request(m.session, x, m.start_pos, self._last_rows(m)) for m, x in ready]
        try:
            outs = self.stage.forward_many(requests)
        except Exception:  # the batch as a whole: each round alone, with its own error
            log.exception(
                "%s: a batch of %d rounds failed; running them one by one",
                self.config.host,
                len(ready),
            )
            for message, _ in ready:
                self._round(message)
            return
        forward_s = time.perf_counter() - started
        self._note_batch(len(ready))
        for (message, _), out in zip(ready, outs, strict=True):
            if isinstance(out, BaseException):
                self._failed(message, out)
            else:
                self._pass_on(message, out)
                self._time_round(time.perf_counter() - started, forward_s)

    def _inputs(self, message: wire.Message) -> torch.Tensor | None:
        """A round's input rows, or None when the round is not one to run (dropped, counted)."""
        route, hop = message.route, message.hop
        if not route or route[hop].host != self.config.host or not message.reply:
            self._drop(f"round {message.round_id!r} is not addressed to {self.config.host}")
            return None
        if not message.tokens or message.n_draft >= len(message.tokens):
            self._drop(f"round {message.round_id!r} has {len(message.tokens)} tokens")
            return None
        if self.stage.first:
            return torch.tensor(message.tokens, dtype=torch.int64)
        if message.tensor is None or message.tensor.dim() != 2:
            self._drop(f"round {message.round_id!r} carries no hidden states")
            return None
        return message.tensor

    def _last_rows(self, message: wire.Message) -> int | None:
        return message.n_draft + 1 if self.stage.last else None

    def _failed(self, message: wire.Message, exc: BaseException) -> None:
        if isinstance(exc, GapError):
            self._count("gaps")
            self._reply(message, "gap", reason=f"{self.config.host}: {exc}")
            return
        self._count("errors")
        log.error("%s: round %s failed: %s", self.config.host, message.round_id, exc)
        self._reply(message, "error", reason=f"{self.config.host}: {exc}")

    def _note_batch(self, size: int) -> None:
        self.counters["processed"] += size
        self.counters["forwards"] += 1
        mean = self.timings["batch_size"]
        first = self.counters["processed"] == size
        self.timings["batch_size"] = size if first else mean + TIMING_WEIGHT * (size - mean)

    def _pass_on(self, message: wire.Message, out: torch.Tensor) -> None:
        """The tail samples and replies; any other stage sends the hidden states to the next."""
        route, hop = message.route, message.hop
        if self.stage.last:
            self._sample(message, out)
        elif hop + 1 >= len(route):
            self._reply(message, "error", reason=f"route ends at {self.config.host}, not a tail")
        else:
            nxt = route[hop + 1]
            stream = streams.stage_key(self.config.swarm, nxt.host)
            passed_on = replace(
                message, tensor=out, hop=hop + 1, to=stream, sender=self.config.host
            )
            try:
                data = wire.encode(passed_on, self.config.swarm, self.keys)
            except wire.WireError as exc:
                self._failed(message, exc)
                return
            self.next_hop = (nxt.host, nxt.redis_url)
            self._send(nxt.redis_url, stream, data, message, f"pass the round to {nxt.host}")

    def _sample(self, message: wire.Message, logits: torch.Tensor) -> None:
        sampler = self._samplers.get(message.session)
        if sampler is None:
            # The tail restarted and lost the reset; the coordinator re-sends it on a gap.
            self._count("gaps")
            self._reply(message, "gap", reason=f"{self.config.host}: no sampling parameters")
            return
        k = message.n_draft
        drafts = list(message.tokens[len(message.tokens) - k :]) if k else []
        first_sampled = message.start_pos + len(message.tokens) - k
        try:
            rows = logits[-(k + 1) :]
            result = sampler.accept(rows, drafts, first_sampled)
            logprobs = tuple((lp.logprob, lp.top) for lp in sampler.result_logprobs(rows, result))
        except ValueError as exc:  # e.g. a draft id outside the vocabulary, NaN logits
            self._count("errors")
            self._reply(message, "error", reason=f"{self.config.host}: {exc}")
            return
        proposal = ()
        if self.head is not None and message.head_k:
            features = self.stage.features[message.session]
            proposal = tuple(
                self.head.drafts_after(
                    features, result, first_sampled, message.head_k, sampler.params
                )
            )
        self._reply(
            message,
            "result",
            tokens=tuple(int(t) for t in result),
            logprobs=logprobs,
            drafts=proposal,
        )

    def _reply(self, message: wire.Message, kind: str, **fields) -> None:
        item = self._reply_for(message, kind, **fields)
        if kind == "result":
            self.next_hop = (wire.COORDINATOR, message.reply)
        self._outgoing.append(item)

    def _reply_for(self, message: wire.Message, kind: str, **fields) -> Outgoing:
        """The reply to `message`'s coordinator, encoded, to be sent."""
        stream = streams.reply_key(self.config.swarm, message.session)
        reply = wire.Message(
            kind=kind,
            session=message.session,
            round_id=message.round_id,
            seq=message.seq,
            to=stream,
            sender=self.config.host,
            **fields,
        )
        data = wire.encode(reply, self.config.swarm, self.keys)
        return Outgoing(message.reply, stream, data, None, f"reply to {message.session}")

    def _send(
        self, url: str, stream: str, data: bytes, message: wire.Message | None, what: str
    ) -> None:
        """Queue an XADD of `data` to `stream` on `url`, sent by `_flush_sends` with the rest of
        its batch. `message` is the round passed on, None for a reply: a failed pass-on is an
        error reply for it, a failed reply the coordinator's to time out on."""
        self._outgoing.append(Outgoing(url, stream, data, message, what))

    def _flush_sends(self) -> None:
        """Send what the last batch queued: one write per destination Redis, at once or after
        the simulated link delay without holding the stage up (a link's latency delays what
        crosses it, not the next forward)."""
        outgoing, self._outgoing = self._outgoing, []
        self._route(outgoing)

    def _route(self, outgoing: list[Outgoing]) -> None:
        by_url: dict[str, list[Outgoing]] = {}
        for item in outgoing:
            by_url.setdefault(item.url, []).append(item)
        for url, items in by_url.items():
            if self.config.link_delay_s <= 0:
                self._deliver(url, items)
                continue
            with self._outbox_lock:
                outbox = self._outboxes.get(url)
                if outbox is None:
                    outbox = self._outboxes[url] = queue.SimpleQueue()
                    threading.Thread(
                        target=self._send_delayed, args=(url, outbox), daemon=True
                    ).start()
            outbox.put((time.monotonic() + self.config.link_delay_s, items))

    def _deliver(self, url: str, items: list[Outgoing]) -> None:
        entries = [(item.stream, item.data, item.message is None) for item in items]
        try:
            streams.send_all(self.connections.link(url), entries, self.config.maxlen)
        except redis.RedisError as exc:
            replies = []
            for item in items:
                reason = f"{self.config.host}: cannot {item.what}: {exc}"
                log.warning("%s", reason)
                if item.message is not None:
                    self._count("errors")
                    replies.append(self._reply_for(item.message, "error", reason=reason))
            self._route(replies)

    def _send_delayed(self, url: str, outbox: queue.SimpleQueue) -> None:
        """The link's far end: sends each batch of `outbox` once its delay has passed, in
        order; one thread per destination, the only user of that destination's link."""
        while True:
            due, items = outbox.get()
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                self._deliver(url, items)
            except Exception:  # a bad send must not end the link
                log.exception("%s: a delayed send failed", self.config.host)

    @staticmethod
    def _remember(table: OrderedDict, session: str, value, limit: int = MAX_SESSIONS) -> None:
        table[session] = value
        table.move_to_end(session)
        while len(table) > limit:
            table.popitem(last=False)


def kv_budget(stage: Stage) -> int:
    """The tokens of KV cache this stage holds across its sessions, as its record advertises:
    `SPECPIPE_KV_BUDGET_TOKENS`, else a share of the memory available now (the GPU's free
    memory on a GPU) over what one token of the stage's layers takes; 0 when neither is known."""
    configured = kv_budget_tokens()
    if configured is not None:
        return configured
    try:  # a model's stage (StageModel); another kind of stage has no budget unless configured
        cfg, layers = stage.cfg, stage.end - stage.start
        element = torch.empty((), dtype=stage.dtype).element_size()
        per_token = kvbudget.bytes_per_token(layers, cfg.n_kv_heads, cfg.head_dim, element)
        device = torch.device(stage.device)
    except AttributeError:
        return 0
    if device.type == "cuda":
        available = torch.cuda.mem_get_info(device)[0]
    else:
        available = kvbudget.available_memory_bytes()
    return kvbudget.default_budget_tokens(per_token, available)


def _sampler_for(params: SamplingParams) -> Sampler:
    """The tail's sampler for `params`: the one they name, unless a test switched on the lossy
    one."""
    if test_lossy_tail():
        from specpipe.proofs.lossy import LossySampler

        return LossySampler.from_params(params)
    return sampler_for(params)


def release_load_memory() -> None:
    """Once a stage is loaded: collect, freeze the survivors (the collector's full passes then
    skip the model's objects), and give the heap that loading freed back to the system, which
    glibc keeps otherwise (tens of MB per stage)."""
    gc.collect()
    gc.freeze()
    heap.trim()


def run(
    stage: Stage,
    config: WorkerConfig,
    node: inventory.NodeInfo | None = None,
    head: TailHead | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM, then leave the inventory cleanly."""
    release_load_memory()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    worker = StageWorker(stage, config, node, head)
    if test_lossy_tail():
        log.warning(
            "%s: %s=1 is set: test-only lossy sampling, the output is NOT lossless "
            "(never set it in production)",
            config.host,
            TEST_LOSSY_TAIL_VAR,
        )
    log.info("%s: serving %s", config.host, streams.stage_key(config.swarm, config.host))
    try:
        worker.serve(stop)
    finally:
        if node is not None:
            try:
                registry = worker.connections.get(config.registry_url or config.redis_url)
                inventory.remove(registry, config.swarm, node.host)
            except redis.RedisError:
                pass
        worker.connections.close()
