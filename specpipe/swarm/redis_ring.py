"""`RedisRing`: the `Ring` interface over the swarm's per-host Redis Streams.

A round is signed and XADDed to stage 0's stream on stage 0's Redis, carrying its route: each
hop's host and the layers of the model it was routed for (never an address: each stage finds its
next hop's address in the signed inventory and dials it with its own credentials, and replies go
to its registry, which is this coordinator's reply Redis). The ring dials each hop's address
with this process's credentials (its `dialer`). It then waits on
`specpipe:{swarm}:reply:{session}` for the reply, re-sending the round under a new id and
sequence number (a reply to any of its ids will do) a bounded number of times before it gives up
with a `RingError`. Every message the ring sends carries a sequence number larger than the last,
which is how stages tell a replay from a fresh message; a reply counts only if it is addressed
to this session's reply stream, comes from a stage of the route and answers one of the round's
ids: anything else is dropped and counted. A sequence number is swarm time (`swarm.clock`: the
clock of the reply Redis, which is the registry the stages reply to), so a stage judges how old
a round is whatever either host's own clock says. A `gap` reply re-sends the session's reset to
every stage and raises `GapError`, so the caller's replay from position 0 finds the tail with its
sampling parameters again. A result is a `RoundResult`, with the tail's log-probabilities when
the session's parameters asked for them. A `misrouted` reply (a hop serves other layers or
another model than the route has it for: the route was built from a stale inventory record)
raises `StaleRouteError`; nothing ran there.

A round that has waited `watch_after_s` without a reply asks its `watchdog` (when it has one)
every `watch_every_s` whether a hop of the route is gone; a reason back ends the round at once
with `HopLostError`, so the caller can re-route to a spare instead of waiting out the tries.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import redis

from specpipe.core.coupling import sampler_for
from specpipe.core.ring import GapError, Prefix, Round, RoundResult
from specpipe.core.sampling import SamplingParams, TokenLogprob
from specpipe.settings import Settings
from specpipe.swarm import identity, inventory, mending, streams, trust, wire
from specpipe.swarm.clock import SwarmClock
from specpipe.swarm.dialing import Dialer
from specpipe.swarm.inventory import NodeInfo
from specpipe.swarm.redact import redact_text, redact_url

log = logging.getLogger("specpipe.coordinator")  # it runs in the coordinator

# What a round's wait grows by for each token it carries: a long prefill, or the replay of a
# whole generation after a gap, takes the stages longer than one decode step.
PER_TOKEN_S = 0.05
RECONNECT_S = 1.0  # pause before sending a round again after a connection error
# What a Redis on the way gets over by itself: restarting, unreachable for a while, or full (it
# refuses writes until trimmed streams and ended sessions free its memory). A round or a control
# waits these out, as long as it would wait for a reply; any other refusal fails it at once.
PASSING = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.OutOfMemoryError)
ROUND_TIMEOUT_S = 30.0  # a round's wait for its reply (and for a restarting Redis), before its work
WATCH_AFTER_S = 0.5  # a round this late asks its watchdog whether a hop is gone…
WATCH_EVERY_S = 0.25  # …and again this often while it waits
# With host identities, a ring reads the roster again at most this often (a host admitted just
# now is believed within it).
ROSTER_EVERY_S = 0.5
ROSTER_FORCED_S = 0.1  # a reply under an unknown key reads the roster at most this often
# How long checking a stage's word that its next hop's Redis is unreachable may take: a cut-off
# host is as gone to this check as to the stage.
PROBE_TIMEOUT_S = 1.0


class RingError(RuntimeError):
    """The ring did not answer a round, or answered with an error."""


class HopLostError(RingError):
    """A hop of the route is gone (its watchdog says why): the round will not be answered."""


class HopUnreachableError(RingError):
    """A stage (`reporter`) could not pass the round on to the next hop (`host`): that host's
    Redis refused or did not answer (a cut link, a Redis full or gone), or the inventory does
    not list it. `confirmed`: this coordinator could not write to that Redis either; else it
    is one stage's word against another's."""

    def __init__(
        self, message: str, host: str = "", reporter: str = "", confirmed: bool = True
    ) -> None:
        super().__init__(message)
        self.host, self.reporter, self.confirmed = host, reporter, confirmed

    @property
    def blamed(self) -> list[str]:
        """The hosts a failover leaves out: the hop, when the claim is confirmed (or no stage
        made it); else the stage that made it too, so no stage can move a hop's traffic
        elsewhere by its word alone."""
        if self.confirmed or not self.reporter:
            return [self.host]
        return [self.reporter, self.host]


class StaleRouteError(RingError):
    """A hop refused the round: it serves other layers or another model than the route has it
    for (the route came from a stale inventory record). `host` is the hop's."""

    def __init__(self, message: str, host: str = "") -> None:
        super().__init__(message)
        self.host = host


class RedisRing:
    """A ring of stage workers reached through Redis Streams."""

    def __init__(
        self,
        route: Sequence[NodeInfo | wire.Hop],
        swarm: str,
        keys: wire.Keyring | bytes | str,
        reply_url: str,
        timeout_s: float = ROUND_TIMEOUT_S,
        retries: int = 2,
        maxlen: int = streams.DEFAULT_MAXLEN,
        per_token_s: float = PER_TOKEN_S,
        watchdog: Callable[[], str | None] | None = None,
        watch_after_s: float = WATCH_AFTER_S,
        dialer: Dialer | None = None,
        registry_url: str | None = None,
        clock: SwarmClock | None = None,
        taps: Sequence[int] | None = None,
    ) -> None:
        if not route:
            raise ValueError("a ring needs at least one stage")
        # The stages in ring order: inventory records when routed from the inventory (the run's
        # node snapshot), else bare hops. All but their addresses go on the wire.
        self.route = tuple(route)
        self._hops_on_wire = tuple(wire.RouteEntry.of(hop) for hop in self.route)
        self._hosts = frozenset(hop.host for hop in self.route)  # who may reply
        self._tail = self.route[-1].host  # the one stage whose word ends a round
        self.swarm = swarm
        self.keys = wire.keyring(keys)
        self.reply_url = reply_url
        self.connections = streams.Connections(dialer or Dialer.configured([reply_url], None))
        self.timeout_s = timeout_s  # a round's wait for its reply, before the work it carries
        self.per_token_s = per_token_s
        self.retries = retries
        self.maxlen = maxlen
        dial = self.connections.dialer.url
        # One write can carry a round and the read of its reply when they share a Redis.
        self._first_is_reply = dial(self.route[0].redis_url) == dial(reply_url)
        self._params: dict[str, SamplingParams] = {}
        # The last reply entry read, per session and reply stream (one per host of the route).
        self._cursor: dict[str, dict[str, bytes | str]] = {}
        self._seq = 0  # the last sequence number sent, for any session
        # Swarm time, for sequence numbers: the reply Redis's clock (shared with twins).
        self.clock = clock or SwarmClock(self.connections.get(reply_url))
        self.dropped_replies = 0  # replies refused: stale, replayed, redirected or forged
        # Asked while a round is late: a reason when a hop of the route is gone for good.
        self.watchdog = watchdog
        self.watch_after_s = watch_after_s
        # Where the roster is read again (with host identities): a host revoked mid-job is
        # believed no longer, so its replies are dropped and the job goes around it.
        self.registry_url = registry_url
        self._roster_due = time.monotonic() + ROSTER_EVERY_S
        self._roster_forced = 0.0  # when a reply under an unknown key last read it
        # The layers every round asks the stages to tap for the tail's drafter: what its record
        # says it reads (an EAGLE-3 head's), unless given.
        tail = self.route[-1]
        if taps is None and isinstance(tail, NodeInfo):
            taps = tail.tap_layers()
        self.taps = tuple(taps or ())

    @classmethod
    def from_inventory(
        cls,
        settings: Settings,
        model: str,
        n_layers: int,
        *,
        registry_url: str | None = None,
        reply_url: str | None = None,
        avoid: Collection[str] = (),
        prefer: Collection[str] = (),
        outage_s: float = 0.0,
        **options,
    ) -> RedisRing:
        """The ring every caller builds: the online stages serving `model` that the swarm's
        registry lists, covering its `n_layers` layers in order.

        The registry is `settings.redis_url` unless `registry_url` is given, and replies come
        back there unless `reply_url` is given. Raises RingError when the swarm has no key or
        the registry cannot be read, RouteError when the online stages leave layers uncovered.
        The hosts in `avoid` are left out (a failover around them); among replicas of a range,
        those in `prefer` are chosen first (they keep the job's prefix). An unreachable registry
        is read again for up to `outage_s` (a job's ring waits out a restarting Redis as its
        rounds do; a command asked once answers at once).
        """
        if not settings.swarm_key:
            raise RingError("the swarm is not configured: SPECPIPE_SWARM_KEY is not set")
        registry = registry_url or settings.redis_url
        try:
            keys = trust.keyring(settings, wire.COORDINATOR)
        except ValueError as exc:  # a pinned key or the coordinator's own that cannot be read
            raise RingError(str(exc)) from None
        found, route = _routed_through_outage(
            keys,
            settings,
            registry,
            outage_s,
            lambda found: inventory.route(
                found.nodes,
                n_layers,
                model=model,
                now=found.now,
                avoid=avoid,
                prefer=prefer,
                latency_ms=found.latency_ms,
            ),
        )
        keys = keys.with_roster(found.roster)
        reply = reply_url or registry
        dialer = Dialer.for_settings(settings, registry, reply)
        dialer.learn(found.roster, found.nodes)  # whose each address is, to log in there
        return cls(
            route, settings.swarm, keys, reply, dialer=dialer, registry_url=registry, **options
        )

    def reset(self, session: str, params: SamplingParams, prefix: Prefix | None = None) -> None:
        """Clear every stage's cache for the session (or start it from the kept `prefix`, on the
        stages that keep it) and give the tail its sampling parameters."""
        sampler_for(params)  # ValueError if invalid

        def reset() -> None:
            try:
                client = self.connections.get(self.reply_url)
                client.delete(*self._reply_keys(session))
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                where = f"the reply Redis at {redact_url(self.reply_url)}"
                raise redis.ConnectionError(f"cannot reach {where}: {exc}") from None
            self._control(session, "reset", params, prefix=prefix)

        self._until_reachable(reset)
        self._cursor[session] = {}
        self._params[session] = params

    def reseed(self, session: str, params: SamplingParams) -> None:
        """New sampling parameters for the tail; every stage keeps its cache."""
        if session not in self._params:
            raise RingError(f"session {session!r} was not reset on this ring")
        sampler_for(params)  # ValueError if invalid
        self._params[session] = params
        # Only the tail samples. Its stream is FIFO and this lands there before the next round.
        self._until_reachable(
            lambda: self._control(session, "reseed", params, hops=self.route[-1:])
        )

    def round(self, r: Round) -> RoundResult:
        """Send one round, wait for the tail's result vector; GapError or RingError otherwise.
        The drafts the tail's draft head (if it has one) proposes for the next round, when `r`
        asks for them, come back on the result (`RoundResult.drafts`)."""
        if r.session not in self._params:
            raise RingError(f"session {r.session!r} was not reset on this ring")
        message = self._round_message(r)
        self._refresh_roster()
        wait_s = self.round_wait_s(len(r.tokens))
        problem = f"no reply in {wait_s:g} s"
        # Each send has an id of its own, and a reply to any of them is the round's result: a
        # stage that was only slow still answers the first, while one whose message was lost
        # (its Redis restarted) does not take the re-sent round for a duplicate. A stage that
        # gets both recomputes the same rows, since a round truncates its cache to start_pos.
        round_ids: set[str] = set()
        # A try is a wait that ran its course. A connection error uses none up (the round goes
        # out again once Redis answers), but nothing waits past every try's time together.
        started = time.monotonic()
        tries, give_up_at = self.retries + 1, started + (self.retries + 1) * wait_s
        while tries > 0 and time.monotonic() < give_up_at:
            round_id = uuid.uuid4().hex
            round_ids.add(round_id)
            # Any try's answer will do until the last try's wait ends: that long it stays fresh.
            left_ms = int(max(give_up_at - time.monotonic(), 0.0) * 1000)
            sent = replace(message, round_id=round_id, seq=self._next_seq(), wait_ms=left_ms)
            send = streams.stage_send_commands(
                message.to, wire.encode(sent, self.swarm, self.keys), self.maxlen
            )
            try:
                reply = self.send_round(r.session, send, round_ids, wait_s)
            except PASSING as exc:
                problem = f"Redis unavailable: {exc}"
                self._watch()
                time.sleep(RECONNECT_S)
                continue
            if reply is None:
                tries -= 1
                problem = f"no reply in {wait_s:g} s"
                continue
            return self._answered(r, reply)
        route = " -> ".join(h.host for h in self.route)
        waited = time.monotonic() - started
        raise RingError(f"round failed after {waited:.1f} s ({problem}; route {route})")

    def _round_message(self, r: Round) -> wire.Message:
        """The round as it goes to stage 0's stream, but for what each send stamps (its id,
        sequence number and wait)."""
        message = wire.Message(
            kind="round",
            session=r.session,
            start_pos=r.start_pos,
            n_draft=r.n_draft,
            tokens=r.tokens,
            route=self._hops_on_wire,
            head_k=min(int(r.head_k), wire.MAX_HEAD_DRAFTS),
            taps=self.taps,
            to=streams.stage_key(self.swarm, self.route[0].host),
            sender=wire.COORDINATOR,
        )
        branches = r.branches
        if branches is None:
            return message
        shape = branches.shape
        return replace(
            message,
            parents=None if branches.parents is None else tuple(branches.parents),
            keep=tuple(branches.keep),
            head_shape=() if shape is None else tuple(zip(shape.parents, shape.ranks, strict=True)),
        )

    def _answered(self, r: Round, reply: wire.Message) -> RoundResult:
        """Round `r`'s result from the tail's `reply` (with up to the drafts it wanted); for
        any other reply, the error it stands for."""
        if reply.kind == "result":
            if len(reply.tokens) != r.n_draft + 1:
                raise RingError(f"result of {len(reply.tokens)} ids for {r.n_draft} drafts")
            logprobs = [
                TokenLogprob(token, lp, top)
                for token, (lp, top) in zip(reply.tokens, reply.logprobs, strict=False)
            ]
            return RoundResult(
                reply.tokens,
                logprobs,
                reply.drafts[: r.wanted],
                path=reply.path,
                draft_parents=reply.draft_parents[: r.wanted],
                ranks=reply.ranks,
                batch=reply.batch or 1,
            )
        session = r.session
        if reply.kind == "gap":
            self._until_reachable(lambda: self._control(session, "reset", self._params[session]))
            raise GapError(reply.reason or "a stage lost the session's cache")
        if reply.kind == "misrouted":
            raise StaleRouteError(f"round refused: {reply.reason}", reply.sender)
        if reply.kind == "unreachable":
            raise self._unreachable(reply)
        raise RingError(f"round failed: {reply.reason or reply.kind}")

    def _unreachable(self, reply: wire.Message) -> HopUnreachableError:
        """A stage's word that it could not pass the round on: the hop after it, and whether
        this process cannot write there either."""
        hosts = [hop.host for hop in self.route]
        after = hosts.index(reply.sender) + 1 if reply.sender in hosts else len(hosts)
        unreachable = hosts[after] if after < len(hosts) else ""
        confirmed = not unreachable or not self.writes_reach(unreachable)
        return HopUnreachableError(
            f"round failed: {reply.reason}", unreachable, reply.sender, confirmed
        )

    def send_round(
        self, session: str, send: tuple, round_ids: set[str], wait_s: float
    ) -> wire.Message | None:
        """Send a round (`send`, the commands that add it to stage 0's stream) and wait up to
        `wait_s` for the reply to one of `round_ids`; None if none came."""
        if self._first_is_reply:
            # One write carries the round and the read that waits for its reply.
            return self._wait(session, round_ids, wait_s, send)
        self.connections.link(self.route[0].redis_url).call(*send, resend=True)
        return self._wait(session, round_ids, wait_s)

    def writes_reach(self, host: str) -> bool:
        """Whether this process can write to the Redis of `host` (a hop of the route) itself:
        it rings the stage's bell, which costs the stage one idle wake. How a stage's word that
        it could not is checked before its next hop is left out."""
        hop = next(hop for hop in self.route if hop.host == host)
        client = redis.Redis.from_url(
            self.connections.dialer.url(hop.redis_url, host),
            socket_timeout=PROBE_TIMEOUT_S,
            socket_connect_timeout=PROBE_TIMEOUT_S,
        )
        try:
            pipe = client.pipeline(transaction=False)
            for command in streams.bell_commands(streams.stage_key(self.swarm, host)):
                pipe.execute_command(*command)
            pipe.execute()
            return True
        except redis.RedisError:
            return False
        finally:
            client.close()

    def round_wait_s(self, n_tokens: int) -> float:
        """How long a round of `n_tokens` tokens waits for its reply before it is sent again:
        the base timeout and the tokens' share of work."""
        return self.timeout_s + n_tokens * self.per_token_s

    def drop(self, session: str, keep: Prefix | None = None, skip: Collection[str] = ()) -> None:
        """Forget the session on every stage (but the hosts in `skip`, gone ones), each keeping
        its cache's first positions as the prefix `keep` if given, and delete its reply
        stream."""
        hops = [hop for hop in self.route if hop.host not in skip]
        self._control(session, "drop", None, hops, prefix=keep)
        self.connections.get(self.reply_url).delete(*self._reply_keys(session))
        self._params.pop(session, None)
        self._cursor.pop(session, None)

    def keep(self, session: str, prefix: Prefix) -> None:
        """Every stage keeps the session's first `prefix.length` positions as `prefix.name`;
        the session goes on. Like every control, it goes into each stage's stream behind the
        session's rounds, and ahead of any reset sent after it."""
        self._control(session, "keep", None, prefix=prefix)

    def twin(self) -> RedisRing:
        """A ring of this one's kind over the same route, keys and settings with connections of
        its own, for a second thread: a ring is used by one thread at a time. It shares no
        session."""
        return type(self)(
            self.route,
            self.swarm,
            self.keys,
            self.reply_url,
            timeout_s=self.timeout_s,
            retries=self.retries,
            maxlen=self.maxlen,
            per_token_s=self.per_token_s,
            watchdog=self.watchdog,
            watch_after_s=self.watch_after_s,
            dialer=self.connections.dialer,
            registry_url=self.registry_url,
            clock=self.clock,
        )

    @contextmanager
    def twins(self, n: int) -> Iterator[list[RedisRing]]:
        """`n` twins of this ring (see `twin`) for other threads, closed on the way out."""
        lanes = [self.twin() for _ in range(n)]
        try:
            yield lanes
        finally:
            for lane in lanes:
                lane.close()

    def close(self) -> None:
        """Close the Redis connections."""
        self.connections.close()

    def _control(
        self,
        session: str,
        kind: str,
        params: SamplingParams | None,
        hops: Sequence[wire.Hop] | None = None,
        prefix: Prefix | None = None,
    ) -> None:
        """Send a reset, reseed, keep or drop to each of `hops` (default: the route); `prefix`:
        the kept prefix a reset starts from, or a keep or drop keeps."""
        fields = {} if params is None else params.to_fields()
        message = wire.Message(
            kind=kind,
            session=session,
            round_id=uuid.uuid4().hex,
            seq=self._next_seq(),
            sender=wire.COORDINATOR,
            params=fields,
            wait_ms=int(self.round_wait_s(0) * 1000),
            prefix=prefix.name if prefix else "",
            start_pos=prefix.length if prefix else 0,
        )
        for hop in self.route if hops is None else hops:
            to = streams.stage_key(self.swarm, hop.host)
            data = wire.encode(replace(message, to=to), self.swarm, self.keys)
            try:
                streams.send(self.connections.get(hop.redis_url), to, data, self.maxlen)
            except redis.RedisError as exc:
                where = f"{hop.host}'s Redis at {redact_url(hop.redis_url)}"
                if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
                    raise redis.ConnectionError(f"cannot reach {where}: {exc}") from None
                if isinstance(exc, redis.exceptions.OutOfMemoryError):
                    raise redis.exceptions.OutOfMemoryError(f"{where} is full: {exc}") from None
                raise RingError(f"{where} refused: {exc}") from None

    def _until_reachable(self, step, *args) -> None:
        """`step(*args)`, again after a pause while a Redis on the way is unreachable
        (restarting) or full, for as long as a round would wait; then a RingError. Other Redis
        errors at once."""
        give_up_at = time.monotonic() + self.round_wait_s(0)
        while True:
            try:
                return step(*args)
            except PASSING as exc:
                if time.monotonic() >= give_up_at:
                    raise RingError(redact_text(str(exc))) from None
                self._watch()  # a hop the inventory says is gone: no use waiting for its Redis
                time.sleep(RECONNECT_S)
            except redis.RedisError as exc:
                raise RingError(f"Redis refused: {redact_text(str(exc))}") from None

    def _reply_keys(self, session: str) -> dict[str, str]:
        """The session's reply streams, one per host of the route: stream -> host."""
        return {streams.reply_key(self.swarm, session, hop.host): hop.host for hop in self.route}

    def _decoded(self, data: bytes | None, key: str) -> wire.Message | None:
        """The reply in `data`, None when it does not open. One sealed under a key this ring
        does not hold reads the roster first (a rotation's new data key comes with it), at most
        every ROSTER_FORCED_S."""
        try:
            return wire.decode(data, self.swarm, self.keys, to=key)
        except wire.UnknownKeyError:
            if time.monotonic() < self._roster_forced + ROSTER_FORCED_S:
                return None
        except wire.WireError:
            return None
        self._roster_forced = time.monotonic()
        self._roster_due = 0.0
        self._refresh_roster()
        try:
            return wire.decode(data, self.swarm, self.keys, to=key)
        except wire.WireError:
            return None

    def _refresh_roster(self) -> None:
        """The roster read again, at most every ROSTER_EVERY_S (see `registry_url`)."""
        due = self.keys.coordinator is not None and self.registry_url is not None
        if not due or time.monotonic() < self._roster_due:
            return
        self._roster_due = time.monotonic() + ROSTER_EVERY_S
        try:
            client = self.connections.get(self.registry_url)
            roster, _ = identity.read_roster(client, self.swarm, self.keys.coordinator)
        except redis.RedisError:  # the roster it has holds until the registry answers
            return
        if roster != self.keys.roster:  # a new one may bring a new data key epoch
            self.keys = self.keys.with_roster(roster)

    def _watch(self) -> None:
        """HopLostError when the watchdog says a hop of the route is gone."""
        reason = self.watchdog() if self.watchdog is not None else None
        if reason:
            raise HopLostError(reason)

    def _next_seq(self) -> int:
        self._seq = wire.next_seq(self._seq, self.clock.now())
        return self._seq

    def _wait(
        self, session: str, round_ids: set[str], wait_s: float, send: tuple = ()
    ) -> wire.Message | None:
        """The reply to one of `round_ids`, or None after `wait_s`. Other replies are stale.
        `send`, commands for the reply's Redis, go out in the same write as the first read."""
        link = self.connections.link(self.reply_url)
        keys = self._reply_keys(session)
        now = time.monotonic()
        deadline, watch_at = now + wait_s, now + self.watch_after_s
        while True:
            now = time.monotonic()
            if self.watchdog is not None and now >= watch_at:
                self._watch()
                watch_at = now + WATCH_EVERY_S
            left_ms = int((deadline - now) * 1000)
            if left_ms <= 0:
                return None
            cursors = self._cursor.setdefault(session, {})
            block_ms = min(left_ms, streams.MAX_BLOCK_MS)
            if self.watchdog is not None:
                block_ms = max(1, min(block_ms, int((watch_at - now) * 1000) + 1))
            read = (
                "XREAD",
                "BLOCK",
                block_ms,
                "STREAMS",
                *keys,
                *(cursors.get(k, "0-0") for k in keys),
            )
            try:
                entries = link.call(*send, read)[-1]
            except redis.ResponseError as exc:
                if not mending.wrong_type(exc):
                    raise
                # A key of another type where the session's replies go: the tail's could not
                # be written. These are this coordinator's keys: deleted, the round sent again.
                self.connections.get(self.reply_url).delete(*keys)
                self._cursor.pop(session, None)
                self.dropped_replies += 1
                return None
            send = ()
            for key, entry_id, data in streams.keyed_entries(entries):
                cursors[key] = entry_id
                reply = self._accepted_reply(data, key, session, round_ids)
                if reply is not None and reply.sender == keys.get(key):
                    return reply
                if reply is not None:  # signed by one host, put in another's stream
                    self.dropped_replies += 1

    def _accepted_reply(
        self, data: bytes | None, key: str, session: str, round_ids: set[str]
    ) -> wire.Message | None:
        """The reply in `data` if it is one of this round's; else count it and return None.
        A reply to an earlier round of this ring is late, not hostile, but is dropped all the
        same: its round was already answered. Only the tail verifies, so a `result` from any
        other stage of the route is a forgery (with host identities its sender is proven, and
        a middle stage could otherwise answer rounds it never passed on)."""
        reply = self._decoded(data, key)
        if (
            reply is None
            or reply.session != session
            or reply.round_id not in round_ids
            or reply.sender not in self._hosts
            or (reply.kind == "result" and reply.sender != self._tail)
        ):
            self.dropped_replies += 1
            return None
        return reply


def _routed_through_outage(
    keys: wire.Keyring,
    settings: Settings,
    registry: str,
    outage_s: float,
    route_of: Callable[[inventory.Inventory], list[NodeInfo]],
) -> tuple[inventory.Inventory, list[NodeInfo]]:
    """The registry's verified inventory and `route_of` it (`mending.read_mended`: a registry
    a host retyped is mended, and read again while the stages beat back in), read again after
    a pause while the registry is unreachable (restarting, loading its file) for up to
    `outage_s`, as a round waits for a restarting Redis. Then, or on any other Redis error, a
    RingError; a RouteError once no wait is left.
    """
    give_up_at = time.monotonic() + outage_s
    client = redis.Redis.from_url(registry, socket_connect_timeout=5, socket_timeout=5)

    def failed(exc: Exception) -> RingError:
        why = redact_text(str(exc))
        return RingError(f"cannot read the inventory at {redact_url(registry)}: {why}")

    try:
        while True:
            try:
                return mending.read_mended(client, settings.swarm, keys, route_of, settings.home)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if time.monotonic() >= give_up_at:
                    raise failed(exc) from None
                time.sleep(RECONNECT_S)
            except redis.RedisError as exc:
                raise failed(exc) from None
    finally:
        client.close()
