"""`CheckedRing`: a job's ring that re-routes around stages the inventory no longer vouches for.

Store-free on purpose: it knows rings, routes and the inventory, never a job, so the job's run
(`workers/job_run.py`) wraps its rings in it, and tests drive it with rings of their own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import redis

from specpipe.core.ring import GapError, Hop, Prefix, Ring, Round, RoundResult, WatchedRing
from specpipe.core.sampling import SamplingParams
from specpipe.settings import Settings
from specpipe.swarm import inventory, trust
from specpipe.swarm.inventory import NodeInfo, RouteError
from specpipe.swarm.redact import one_line_reason
from specpipe.swarm.redis_ring import (
    ROUND_TIMEOUT_S,
    HopLostError,
    HopUnreachableError,
    RingError,
    StaleRouteError,
)

log = logging.getLogger("specpipe.coordinator")  # it runs in the coordinator, logged as such

FAILOVER_WAIT_S = 10.0  # the longest a failed round waits to learn which hop died
STALE_WAIT_S = 5.0  # the longest a refused round waits for the inventory to change
MAX_REFUSALS = 3  # refused rounds in a row that fail the round
UNREACHABLE_PAUSE_S = 0.5  # between tries of a round whose next hop refused it, no way around


class CheckedRing:
    """A job's ring, checked against the inventory when a hop goes quiet or answers `gap`.

    Failover: two stages may serve the same layers. While a round waits, the ring's watchdog
    asks `lost_hops` whether a hop of the route has lapsed (stopped heartbeating: killed, cut
    off), left or serves other layers *and* the inventory holds a route around it; then the
    ring is built again without those hosts and the job replays on the spare at once (a
    `GapError` to the generation loop), without waiting for the dead host. A stage that could
    not pass a round on answers `unreachable` at once (`HopUnreachableError`, naming the next
    hop: its Redis gone with its host, cut off, or full); the ring checks the claim by writing
    to that Redis itself, and goes around that host at once when the inventory has a route
    without it, even while it still heartbeats (around the stage that made the claim too when
    the check found the Redis writable: one stage's word never moves another's traffic), else waits
    up to the route's lapse time for the inventory to say which hop died; with no hop dead and no
    way around (its Redis full, or cut off from the hop before), the round goes out again every
    `UNREACHABLE_PAUSE_S` for as long as a round waits for its reply (`ROUND_TIMEOUT_S`), then
    fails with the stage's reason. A reset (a job starting, or replaying) whose hop's Redis
    does not answer asks the watchdog too, and goes around a lost hop before the first round.
    Without a spare nothing changes: the round waits for the stage to come back. A stage whose
    process started again (a new `incarnation` in its record, `restarted_hops`) lost the round
    in flight with its caches, so the ring is built again from the inventory at once and the
    job replays on it (a `GapError`), instead of waiting out the round; a round sent to it
    later answers gap.

    A stage that restarted has lost its caches and answers gap, and the job replays its tokens
    from position 0. If the stage came back serving other layers than the ring's route has it
    for (the model was split again), it would refuse the replay (below); so after a gap, when
    any hop of the route serves other layers now, the ring is built again from the inventory
    before the replay: the job re-routes, or fails with a RouteError naming the layers no online
    stage serves.

    Every hop checks that the route names it for the layers and model it serves, and refuses a
    round that does not (`StaleRouteError`: the route came from a stale record, a re-split at
    any moment). Nothing ran on the refusing stage, so the ring waits up to `STALE_WAIT_S` for
    the inventory to show the change, builds itself again from it (a RouteError when no route
    covers the model now) and replays: a round from position 0 is sent again at once on the new
    ring, a later one is a `GapError`, and the caller replays its tokens from position 0 there.
    The `MAX_REFUSALS`th refusal in a row fails the round with the StaleRouteError.

    `on_reroute`, when set, is called with the new route each time the ring is built again, before
    the replay: the job's KV room follows the route (`workers/room.py`)."""

    def __init__(
        self,
        build: Callable[..., WatchedRing],
        layers_now: Callable[[], dict[str, tuple[int, int]]],
        lost_hops: Callable[[tuple], list[str]] | None = None,
        restarted_hops: Callable[[tuple], list[str]] | None = None,
    ) -> None:
        # `build()` makes the ring; `build(avoid=hosts)` one around those hosts (failover).
        self.build, self.layers_now, self.lost_hops = build, layers_now, lost_hops
        self.restarted_hops = restarted_hops
        self.ring: WatchedRing | None = self._watched(build())
        self.rebuilt = 0
        self.failovers = 0
        self.refusals = 0  # refused rounds since the last round answered
        self.on_reroute: Callable[[Sequence[Hop]], None] | None = None
        self._params: dict[str, SamplingParams] = {}  # a new ring's reset, per session

    @property
    def route(self) -> tuple:
        return tuple(self.ring.route) if self.ring is not None else ()

    def reset(self, session: str, params: SamplingParams, prefix: Prefix | None = None) -> None:
        """Reset the session on every hop (from `prefix` where a stage keeps it); a hop lost
        while its Redis does not answer (a job starting, or replaying, as a stage's link goes
        down) is gone around as a round's is, and the session reset on the new ring."""
        try:
            self.ring.reset(session, params, prefix)
        except HopLostError as exc:
            self._around_lost(session, str(exc))
            self.ring.reset(session, params, prefix)
        except RingError as exc:
            self._fail_over_once_lost(session, exc)
            self.ring.reset(session, params, prefix)
        self._params[session] = params

    def reseed(self, session: str, params: SamplingParams) -> None:
        self.ring.reseed(session, params)
        self._params[session] = params

    def round(self, r: Round) -> RoundResult:
        refused_since = None  # when a next hop with no way around it first refused the round
        while True:
            try:
                result = self._round(r)
            except HopUnreachableError as exc:
                now = time.monotonic()
                refused_since = refused_since or now
                if now - refused_since >= ROUND_TIMEOUT_S:
                    raise
                log.warning(
                    "session %s: %s; sending the round again", r.session, one_line_reason(exc)
                )
                time.sleep(UNREACHABLE_PAUSE_S)
                continue
            except StaleRouteError as exc:
                self._reroute_stale(r.session, exc)
                params = self._params.get(r.session)
                if r.start_pos > 0 or params is None:
                    raise GapError(f"re-routed after a refused round: {exc}") from None
                self.ring.reset(r.session, params)  # and the round from position 0 again
                continue
            self.refusals = 0
            return result

    def _round(self, r: Round) -> RoundResult:
        try:
            return self.ring.round(r)
        except StaleRouteError:
            raise
        except HopLostError as exc:
            raise GapError(f"{self._around_lost(r.session, str(exc))}: {exc}") from None
        except GapError:
            if self._route_changed():
                self._rebuild(r.session, "a stage serves other layers now")
            raise
        except HopUnreachableError as exc:
            # Its host may still heartbeat (its Redis full, or cut off from this hop only): go
            # around it at once where the inventory has a route without it, and without the
            # stage that said so too when this coordinator can write to that host's Redis.
            if exc.host and self._fail_over_if_routed(r.session, exc.blamed, str(exc)):
                raise GapError(f"re-routed around an unreachable stage: {exc}") from None
            self._fail_over_once_lost(r.session, exc)
            raise GapError(f"re-routed around a lost stage: {exc}") from None
        except RingError as exc:
            self._fail_over_once_lost(r.session, exc)
            raise GapError(f"re-routed around a lost stage: {exc}") from None

    def _fail_over_once_lost(self, session: str, exc: RingError) -> None:
        """After a failure the ring could not say whose it was: wait for the watchdog to name
        the lost stages and route around them; `exc` raised again when none is lost (the
        failure was not a stage's)."""
        lost = self._await_lost()
        if not lost:
            raise exc
        self._fail_over(session, lost, str(exc))

    def _around_lost(self, session: str, why: str) -> str:
        """After the watchdog said a hop is gone: the ring built again on the same hosts when
        a stage restarted, else around the lost ones; what was done."""
        lost = self._lost()
        if not lost and self._restarted():
            self._rebuild(session, one_line_reason(why))
            return "a stage of the route restarted"
        self._fail_over(session, lost, why)
        return "re-routed around a lost stage"

    def drop(self, session: str, keep: Prefix | None = None) -> None:
        self._params.pop(session, None)
        if self.ring is not None:
            self.ring.drop(session, keep)

    def keep(self, session: str, prefix: Prefix) -> None:
        if self.ring is not None:
            self.ring.keep(session, prefix)

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()

    def _watched(self, ring: WatchedRing) -> WatchedRing:
        """`ring`, whose late rounds ask whether a hop of its route is lost or restarted (when
        there is a way to tell)."""
        if self.lost_hops is not None or self.restarted_hops is not None:
            ring.watchdog = self._lost_reason
        return ring

    def _lost(self) -> list[str]:
        """The hosts of the route that are gone while a route around them exists."""
        if self.lost_hops is None:
            return []
        try:
            return self.lost_hops(self.route)
        except (redis.RedisError, RouteError) as exc:  # cannot tell: keep waiting
            log.warning("cannot check the route's stages: %s", exc)
            return []

    def _restarted(self) -> list[str]:
        """The hosts of the route whose stage process started again since the ring was built."""
        if self.restarted_hops is None:
            return []
        try:
            return self.restarted_hops(self.route)
        except redis.RedisError as exc:  # cannot tell: keep waiting
            log.warning("cannot check the route's stages: %s", exc)
            return []

    def _lost_reason(self) -> str | None:
        lost = self._lost()
        if lost:
            return f"{', '.join(lost)} stopped heartbeating"
        restarted = self._restarted()
        if restarted:
            return f"{', '.join(restarted)} restarted, and the round in flight with it"
        return None

    def _await_lost(self) -> list[str]:
        """The lost hosts of the route, waiting for as long as a dead hop takes to lapse."""
        lapse_s = max(
            (hop.lapse_s() for hop in self.route if isinstance(hop, NodeInfo)), default=0.0
        )
        give_up_at = time.monotonic() + min(lapse_s, FAILOVER_WAIT_S)
        while True:
            lost = self._lost()
            if lost or time.monotonic() >= give_up_at:
                return lost
            time.sleep(0.25)

    def _fail_over_if_routed(self, session: str, hosts: list[str], why: str) -> bool:
        """Fail over around `hosts` when a route without them exists; whether it did."""
        try:
            self._fail_over(session, hosts, why)
        except RouteError:
            return False
        return True

    def _fail_over(self, session: str, lost: list[str], why: str) -> None:
        """Build the ring again around the `lost` hosts (RouteError, the ring as it was, when
        no route avoids them); the caller replays on it."""
        new = self._watched(self.build(avoid=frozenset(lost)))
        old, self.ring = self.ring, new
        try:
            old.drop(session, skip=lost)  # the lost hosts' Redis may be gone with them
        except Exception as exc:  # only costs the survivors some memory until they idle out
            log.warning("could not drop %s on the old ring: %s", session, exc)
        old.close()
        self.failovers += 1
        self._rerouted()
        hosts = " -> ".join(hop.host for hop in self.route)
        log.warning(
            "session %s: %s lost (%s); failed over to %s",
            session,
            ", ".join(lost),
            one_line_reason(why),
            hosts,
        )

    def _reroute_stale(self, session: str, refused: StaleRouteError) -> None:
        """Build the ring again from the inventory once it shows the refusing stage's change
        (or `STALE_WAIT_S` has passed); `refused` again at the `MAX_REFUSALS`th in a row."""
        self.refusals += 1
        if self.refusals >= MAX_REFUSALS:
            self.refusals = 0
            raise refused
        give_up_at = time.monotonic() + STALE_WAIT_S
        while not self._route_changed() and time.monotonic() < give_up_at:
            time.sleep(0.1)
        self._rebuild(session, one_line_reason(str(refused)))

    def _rebuild(self, session: str, why: str) -> None:
        """Build the ring again from the inventory as it is now (RouteError: the model is not
        covered), the old one's session dropped."""
        old, self.ring = self.ring, None
        drop_quietly(old, session)
        self.ring = self._watched(self.build())
        self.rebuilt += 1
        self._rerouted()
        hosts = " -> ".join(hop.host for hop in self.route)
        log.warning("session %s: %s; new ring %s", session, why, hosts)

    def _rerouted(self) -> None:
        if self.on_reroute is not None:
            self.on_reroute(self.route)

    def _route_changed(self) -> bool:
        try:
            layers = self.layers_now()
        except redis.RedisError as exc:  # cannot tell: replay on the ring as it is
            log.warning("cannot read the inventory after a gap: %s", exc)
            return False
        # A bare hop (no inventory record) says nothing of its layers.
        return any(
            layers.get(hop.host) != (hop.layer_start, hop.layer_end)
            for hop in self.route
            if isinstance(hop, NodeInfo)
        )


def drop_quietly(ring: Ring, session: str) -> None:
    """End `session` on `ring` and close it; a failure to drop is logged, not raised."""
    try:
        ring.drop(session)
    except Exception as exc:  # the job's outcome is stored; a stale cache only costs memory
        log.warning("could not drop %s on the ring: %s", session, exc)
    ring.close()


def served_layers(settings: Settings) -> dict[str, tuple[int, int]]:
    """Each stage host's layer range as the swarm's inventory has it now."""
    return {n.host: (n.layer_start, n.layer_end) for n in _inventory_now(settings).nodes}


def lost_with_spare(settings: Settings, model: str, n_layers: int) -> Callable[[tuple], list[str]]:
    """For a CheckedRing: the hosts of a route that the inventory no longer vouches for
    (`inventory.lost_hops`), when the online stages still cover the model without them; none
    while there is no spare (the job then waits for the stage to come back). Judged in swarm
    time, as the inventory is read."""

    def lost(route: tuple) -> list[str]:
        found = _inventory_now(settings, timeout_s=2)
        gone = inventory.lost_hops(route, found.nodes, found.now)
        if not gone:
            return []
        try:
            inventory.route(found.nodes, n_layers, model=model, now=found.now, avoid=gone)
        except RouteError:
            return []
        return gone

    return lost


def restarted_stages(settings: Settings) -> Callable[[tuple], list[str]]:
    """For a CheckedRing: the hosts of a route whose stage process the inventory shows started
    again since the route was read (`inventory.restarted_hops`), spare or not."""

    def restarted(route: tuple) -> list[str]:
        hops = [hop for hop in route if isinstance(hop, NodeInfo)]
        return inventory.restarted_hops(hops, _inventory_now(settings, timeout_s=2).nodes)

    return restarted


def _inventory_now(settings: Settings, timeout_s: float = 5) -> inventory.Inventory:
    client = redis.Redis.from_url(
        settings.redis_url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s
    )
    try:
        return inventory.read(client, settings.swarm, trust.keyring(settings))
    finally:
        client.close()
