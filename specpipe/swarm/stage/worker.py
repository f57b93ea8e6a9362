"""The stage worker's loop: read rounds from this host's stream, run the stage, pass them on.

Generic over the `Stage` protocol: it reads `specpipe:{swarm}:stage:{host}` on its own Redis as
a member of the stage consumer group, verifies each message (`stage.admission`), runs
`stage.forward` (once its route is seen to have this stage for the layers and model it serves,
`stage.routing`), and sends the hidden states to the next hop's stream on that hop's Redis (its
address from the signed inventory, `stage.directory`, dialled with this stage's own
credentials, `swarm.dialing`), or, on the tail, samples the doctored result vector with the
session's parameters and sends it to the coordinator's reply stream on the stage's registry
(`stage.onward`, `stage.samplers`). A stage that has lost a session's
cache answers `gap`. Per-session `reset` (the tail keeps temp, top_p, top_k and seed, and
whether to send the committed tokens' log-probabilities with each result), `reseed` (new
parameters, caches kept) and `drop` arrive as signed messages on the same stream, so they are
ordered with the rounds. Rounds of several sessions read together run as one forward; before
it, the stage waits briefly for the rounds of other sessions due with them (`stage.batching`),
and what a batch sends leaves in one write per destination (`stage.sending`), so the next stage
reads it as one batch too. Whatever an entry holds, handling it ends in an ack: nothing can
make the stage crash or read it again.

A session that sees no message for `session_idle_s` (its coordinator died, or went away without
a drop) is forgotten at the next heartbeat: its caches are freed, and if its job comes back the
coordinator gets a gap and replays. A stage whose caches hold more than its KV budget (its
inventory record's `kv_budget_tokens`, `stage.budget`) forgets, at a heartbeat, the sessions
idle longest among those idle for `OVER_BUDGET_IDLE_S`, once its kept prefixes (a `drop` may
keep the session's cache for a later one to start from: `stage.prefixes`) gave theirs. One
process per stage: nothing is forked.
"""

from __future__ import annotations

import gc
import logging
import secrets
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import redis

from specpipe.core.ring import BatchedStage, Stage
from specpipe.settings import DEFAULT_HEARTBEAT_S
from specpipe.swarm import inventory, streams, wire
from specpipe.swarm.clock import SwarmClock
from specpipe.swarm.dialing import Dialer
from specpipe.swarm.peering import Peering
from specpipe.swarm.redact import without_credentials
from specpipe.swarm.stage import budget
from specpipe.swarm.stage.activity import Activity
from specpipe.swarm.stage.admission import Admission
from specpipe.swarm.stage.batching import MAX_BATCH, Batcher
from specpipe.swarm.stage.counters import StageStats
from specpipe.swarm.stage.directory import Directory
from specpipe.swarm.stage.forward import Forward
from specpipe.swarm.stage.heartbeat import Heartbeat
from specpipe.swarm.stage.keys import StageKeys
from specpipe.swarm.stage.onward import Onward
from specpipe.swarm.stage.prefixes import KeptPrefixes
from specpipe.swarm.stage.routing import Serves
from specpipe.swarm.stage.samplers import TailSamplers, TailSampling
from specpipe.swarm.stage.sending import Link, Outbox, Replies, Sender
from specpipe.transformer import heap

if TYPE_CHECKING:
    from specpipe.drafting.sources import TailDrafter

log = logging.getLogger("specpipe.stage")
# What ended sessions' caches freed goes back to the system at most this often: glibc keeps it
# otherwise (a stage of the default model serving three users' jobs held about 35 MiB more), and
# a trim after much was freed holds the serving loop for tens of milliseconds.
HEAP_TRIM_S = 10.0
HOUSEKEEPING_S = 0.5  # between the serving loop's rounds of housekeeping (`housekeeping`)
# The registry's clock is read on a client of its own that gives up this soon: a registry slow
# to answer holds a sample (on whichever thread takes it) that long at most.
CLOCK_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class WorkerConfig:
    """Where a stage worker reads, where it registers, and how it signs."""

    host: str
    swarm: str
    keys: wire.Keyring | bytes | str  # the swarm's keyring (a single key is a ring of one)
    redis_url: str  # this host's Redis: its input stream lives here
    registry_url: str | None = None  # the inventory's and the replies' Redis; default: redis_url
    consumer: str | None = None  # consumer name in the group; default: host
    maxlen: int = streams.DEFAULT_MAXLEN
    block_ms: int = 1000
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    claim_idle_ms: int = 30_000
    max_message_bytes: int = wire.MAX_MESSAGE_BYTES
    # How a batch's messages leave, given the stage's `Sender`: through it at once, unless the
    # process wraps it in a link of its own.
    wrap_sender: Callable[[Sender], Link] | None = None
    session_idle_s: float = 600.0  # a session untouched this long is dropped
    prefix_keep_s: float = 1800.0  # a kept prefix unused this long is forgotten
    # Where a new keyring comes from after `specpipe key rotate`: asked at each heartbeat and
    # when a message names a key this stage does not hold.
    reload_keys: Callable[[], wire.Keyring] | None = None
    # The sampler a session's parameters get on the tail (the lossless one they name, unless
    # the process installs a test double).
    tail_sampling: TailSampling = TailSampling()
    # A swarm-wide data-plane password (only a swarm without host identities has one).
    redis_password: str | None = field(default=None, repr=False)
    # This host's own users on the other hosts' Redis (`specpipe.swarm.peering`).
    peering: Peering | None = None
    # The stage's own Redis as its keeper, who makes the other hosts' users there (None: the
    # registry's, whose users host 0 keeps, or a Redis without a keeper).
    keeper_url: str | None = field(default=None, repr=False)
    # This host's copy of the swarm CA: every other host's TLS Redis is verified against it.
    tls_ca: str | None = None

    @property
    def registry(self) -> str:
        """The URL of the inventory's Redis, where the replies go too."""
        return self.registry_url or self.redis_url


class StageWorker:
    """Serves one stage from its Redis stream until stopped: the parts of `specpipe.swarm.stage`
    put together."""

    def __init__(
        self,
        stage: Stage,
        config: WorkerConfig,
        node: inventory.NodeInfo | None = None,
        head: TailDrafter | None = None,
    ) -> None:
        self.stage = stage
        self.config = config
        host, swarm = config.host, config.swarm
        self.stream = streams.stage_key(swarm, host)
        dialer = Dialer.configured(
            (config.redis_url, config.registry),
            config.redis_password,
            config.tls_ca,
            config.peering,
        )
        self.connections = streams.Connections(dialer)
        self.client = self.connections.get(config.redis_url)
        self.consumer = streams.StreamConsumer(
            self.client,
            self.stream,
            config.consumer or host,
            claim_idle_ms=config.claim_idle_ms,
            max_bytes=config.max_message_bytes,
            dead=streams.dead_key(swarm, host),
        )
        self.stage_keys = StageKeys(config.keys, host, config.reload_keys)
        self.stats = StageStats(self.client, swarm, host)
        self.activity = Activity()
        self.prefixes = KeptPrefixes(stage, self.stats, config.prefix_keep_s)
        # Swarm time, what heartbeats are dated and messages judged in.
        self.clock = SwarmClock(
            redis.Redis.from_url(
                dialer.url(config.registry),
                socket_timeout=CLOCK_TIMEOUT_S,
                socket_connect_timeout=CLOCK_TIMEOUT_S,
            )
        )
        self.admission = Admission(
            swarm,
            host,
            self.stage_keys,
            config.max_message_bytes,
            self.stats,
            self.activity,
            self.clock,
        )
        self.batcher = Batcher(self.consumer, self.admit, isinstance(stage, BatchedStage))
        self.samplers = TailSamplers(stage, config.tail_sampling, self.stats, head)
        replies = Replies(swarm, host, self.stage_keys, config.registry)
        self.outbox = Outbox(self._link(replies))
        keeper = redis.Redis.from_url(config.keeper_url) if config.keeper_url else None
        self.directory = Directory(
            self.connections.get(config.registry),
            swarm,
            self.stage_keys,
            self.clock,
            dialer,
            keeper,
        )
        self.directory.refresh()  # the roster, before the first message is read
        self.admission.refresh_roster = self.directory.refresh
        self.onward = Onward(
            stage,
            swarm,
            host,
            self.stage_keys,
            self.samplers,
            replies,
            self.outbox,
            self.stats,
            self.directory,
        )
        # A round routed here for other layers or another model is refused, by the record.
        self.forward = Forward(stage, host, self.stats, self.onward, Serves.of(node))
        # The record says what this process does, whatever the caller built it with.
        self.kv_budget_tokens = budget.kv_budget(stage)
        if node is not None:
            node = replace(
                node,
                redis_url=without_credentials(node.redis_url),  # the dialler brings its own
                sampler=config.tail_sampling.name,
                kv_budget_tokens=self.kv_budget_tokens,
                heartbeat_s=config.heartbeat_s,
                incarnation=secrets.token_hex(8),
                draft_taps=inventory.taps_text(head.taps if head is not None else ()),
            )
        self.heartbeat = Heartbeat(
            node,
            host,
            swarm,
            config.registry,
            config.heartbeat_s,
            self.stage_keys,
            self.stats,
            lambda: self.onward.next_hop,
            dialer,
            self.directory,
            self.clock,
        )
        self._next_housekeeping = 0.0
        self.heap = heap.Trimmer(HEAP_TRIM_S)

    def _link(self, replies: Replies) -> Link:
        """How a batch's messages leave: through the `Sender`, or what the config wraps it in."""
        sender = Sender(self.config.host, self.connections, self.config.maxlen, replies, self.stats)
        wrap = self.config.wrap_sender
        return sender if wrap is None else wrap(sender)

    @property
    def keys(self) -> wire.Keyring:
        """The keyring this stage signs and verifies with now."""
        return self.stage_keys.ring

    @property
    def counters(self) -> dict[str, int]:
        return self.stats.counters

    @property
    def timings(self) -> dict[str, float]:
        return self.stats.timings

    def serve(self, stop: threading.Event | None = None) -> None:
        """Process messages until `stop` is set, heartbeating meanwhile."""
        stop = stop or threading.Event()
        with self.heartbeat.beating():
            self._serve(stop)

    def _serve(self, stop: threading.Event) -> None:
        wait_s = 0.0
        while not stop.is_set():
            try:
                self.housekeeping()
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
                self.outbox.clear()  # the rounds it was for are read again
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
        messages = self.admit([data for _, data in entries])
        size = self.batcher.size()
        entries += self.batcher.gather(messages, size)
        self.admission.count_dead_letters(self.consumer)
        self.process(messages, size)
        self.consumer.ack(entry_id for entry_id, _ in entries)

    def housekeeping(self) -> None:
        """Every `HOUSEKEEPING_S`, on the serving loop (it touches the caches): forget idle
        sessions, keep within the KV budget, reload the keys (a rotation may have changed
        them) and give what ended sessions freed back to the system. The record and counters
        are the heartbeat thread's."""
        now = time.monotonic()
        if now < self._next_housekeeping:
            return
        self._next_housekeeping = now + HOUSEKEEPING_S
        self.forget_idle_sessions(now)
        if self.prefixes.within(self.kv_budget_tokens, now):
            self.heap.freed()
        self.keep_within_budget(now)
        self.stage_keys.reload()
        self.heap.due(now)

    def forget_idle_sessions(self, now: float | None = None) -> list[str]:
        """Drop every session without a message for `session_idle_s`; return their names."""
        idle = self.activity.idle(self.config.session_idle_s, now)
        for session in idle:
            self._forget(session)
        if idle:
            log.info("%s: dropped %d idle session(s)", self.config.host, len(idle))
        return idle

    def keep_within_budget(self, now: float | None = None) -> list[str]:
        """While the caches hold more tokens than the KV budget, forget the session idle
        longest, if idle for `budget.OVER_BUDGET_IDLE_S`; return their names."""
        if not self.kv_budget_tokens:
            return []
        now = time.monotonic() if now is None else now
        forgotten = budget.over_budget(
            self.stage.held_tokens(), self.kv_budget_tokens, self.activity.last_used, now
        )
        for session in forgotten:
            self._forget(session)
        if forgotten:
            log.info(
                "%s: over the KV budget; dropped %d idle session(s)",
                self.config.host,
                len(forgotten),
            )
        return forgotten

    def flush_counters(self) -> None:
        """Write the counters where `specpipe nodes` and the tests can read them."""
        self.stats.flush()

    def admit(self, entries: list[bytes | None]) -> list[wire.Message]:
        """The messages of read `entries` to act on, noted for batching; the rest are counted
        and dropped."""
        admitted = (self._safely(self.admission.admit, data) for data in entries)
        messages = [message for message in admitted if message is not None]
        self.batcher.note(messages)
        return messages

    def process(self, messages: list[wire.Message], size: int) -> None:
        """Act on admitted messages in order, in batches (`Batcher.batches`); what a batch sends
        goes out when it ends, one write per destination."""
        for batch in self.batcher.batches(messages, size):
            self._safely(self._act, batch)
            self._safely(self.outbox.flush)

    def _act(self, batch: list[wire.Message]) -> None:
        message = batch[0]
        if message.kind == "round":
            self.forward.run(batch)
        elif message.kind in ("reset", "reseed"):
            if message.kind == "reset":  # a reseed keeps the caches (many draws from one context)
                self._drop_caches(message.session)
                if message.prefix:
                    self.prefixes.start(message)
            self.samplers.set_params(message)
        elif message.kind == "keep":
            self.prefixes.keep(message)
        elif message.kind == "drop":
            if message.prefix:
                self.prefixes.keep(message)
            self._forget(message.session)
        else:
            self.stats.drop(f"a {message.kind!r} message does not belong on a stage stream")

    def _drop_caches(self, session: str) -> None:
        self.stage.drop(session)
        self.heap.freed()  # given back to the system at a housekeeping

    def _forget(self, session: str) -> None:
        self._drop_caches(session)
        self.batcher.forget(session)
        self.samplers.forget(session)
        self.activity.forget(session)

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
                self.stats.count("errors")
            except redis.RedisError:
                pass
            return None


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
    head: TailDrafter | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM, then leave the inventory cleanly."""
    release_load_memory()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    worker = StageWorker(stage, config, node, head)
    if not config.tail_sampling.exact:
        log.warning(
            "%s: samples with %r, not the exact samplers: the output is NOT lossless",
            config.host,
            config.tail_sampling.name,
        )
    log.info("%s: serving %s", config.host, worker.stream)
    try:
        worker.serve(stop)
    finally:
        if node is not None:
            try:
                registry = worker.connections.get(config.registry)
                inventory.remove(registry, config.swarm, node.host)
            except redis.RedisError:
                pass
        worker.connections.close()
        worker.clock.client.close()
        if worker.directory.keeper is not None:
            worker.directory.keeper.close()
