"""Where a stage's next hops are: each host's Redis address, from the signed inventory.

A round names its hops by host only. The stage looks the next one up here: the addresses of
every host whose record verified, as the registry last had them (the heartbeat reads them again
at each beat, and a host not known yet is looked up at once: it may have joined since). An
address carries no credentials; the stage's own `Connections` add them when it dials. With host
identities, the roster read with the records is what the stage believes senders by from then
on, so a revoked host's messages are refused from the next beat.

With host identities the same reading tells the stage's dialer whose each address is and the
hosts' sealing keys (`specpipe.swarm.peering`), and, where the stage keeps its own Redis's users
(`keeper`, a client as that Redis's keeper), makes them those of the roster: a new host may write
here from the beat after its admission, a revoked one not from the beat after its revocation
(and its connections are closed). They are made again when the roster changes and every
`KEEP_S` besides, so a restarted Redis gets them back.
"""

from __future__ import annotations

import logging
import time

import redis

from specpipe.swarm import inventory
from specpipe.swarm.clock import SwarmClock
from specpipe.swarm.dialing import Dialer
from specpipe.swarm.stage.keys import StageKeys

log = logging.getLogger("specpipe.stage")
KEEP_S = 30.0  # how often the users of the stage's own Redis are made again, the roster unchanged


class Directory:
    """Host name to Redis address, from the inventory on the stage's registry."""

    def __init__(
        self,
        registry: redis.Redis,
        swarm: str,
        keys: StageKeys,
        clock: SwarmClock,
        dialer: Dialer | None = None,
        keeper: redis.Redis | None = None,
    ) -> None:
        self.registry, self.swarm, self.keys, self.clock = registry, swarm, keys, clock
        self.dialer, self.keeper = dialer, keeper
        self._addresses: dict[str, str] = {}
        self._kept: tuple[int, float] | None = None  # the roster version kept, and when

    def refresh(self, registry: redis.Redis | None = None) -> None:
        """Read the inventory again (on `registry`, another thread's client, when given)."""
        try:
            found = inventory.read(
                registry or self.registry, self.swarm, self.keys.ring, now=self.clock.now()
            )
        except redis.RedisError as exc:
            log.warning("cannot read the inventory: %s", exc)
            return
        self.keys.take_roster(found.roster)
        self._addresses = {node.host: node.redis_url for node in found.nodes}  # swapped whole
        if self.dialer is not None:
            self.dialer.learn(found.roster, found.nodes)
        if found.roster is not None:
            self.keep_users(found.roster)

    def keep_users(self, roster) -> None:
        """Make the users of the stage's own Redis those of `roster` (see the module's
        docstring), when it changed or `KEEP_S` passed; a failure is logged, and tried again at
        the next reading."""
        peering = self.dialer.peering if self.dialer is not None else None
        if self.keeper is None or peering is None:
            return
        kept = self._kept
        if kept is not None and kept[0] == roster.version and time.monotonic() - kept[1] < KEEP_S:
            return
        try:
            made, deleted = peering.keep(self.keeper, roster)
        except (redis.RedisError, ValueError) as exc:
            log.warning("cannot keep this Redis's host users: %s", exc)
            return
        if kept is None or kept[0] != roster.version:
            log.info("host users of this Redis: %s; deleted: %s", made, deleted or "none")
        self._kept = (roster.version, time.monotonic())

    def address(self, host: str) -> str | None:
        """The address of `host`'s Redis; None when the inventory has no verified record of it."""
        found = self._addresses.get(host)
        if found is None:
            self.refresh()
            found = self._addresses.get(host)
        return found
