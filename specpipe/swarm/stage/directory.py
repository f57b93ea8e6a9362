"""Where a stage's next hops are: each host's Redis address, from the signed inventory.

A round names its hops by host only. The stage looks the next one up here: the addresses of
every host whose record verified, as the registry last had them (the heartbeat reads them again
at each beat, and a host not known yet is looked up at once: it may have joined since). An
address carries no credentials; the stage's own `Connections` add them when it dials. With host
identities, the roster read with the records is what the stage believes senders by from then
on, so a revoked host's messages are refused from the next beat.
"""

from __future__ import annotations

import logging

import redis

from specpipe.swarm import inventory
from specpipe.swarm.clock import SwarmClock
from specpipe.swarm.stage.keys import StageKeys

log = logging.getLogger("specpipe.stage")


class Directory:
    """Host name to Redis address, from the inventory on the stage's registry."""

    def __init__(
        self, registry: redis.Redis, swarm: str, keys: StageKeys, clock: SwarmClock
    ) -> None:
        self.registry, self.swarm, self.keys, self.clock = registry, swarm, keys, clock
        self._addresses: dict[str, str] = {}

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

    def address(self, host: str) -> str | None:
        """The address of `host`'s Redis; None when the inventory has no verified record of it."""
        found = self._addresses.get(host)
        if found is None:
            self.refresh()
            found = self._addresses.get(host)
        return found
