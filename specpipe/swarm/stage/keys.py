"""The keyring a stage seals, signs and verifies with, its reload after a key rotation, and
the roster of admitted hosts it learns from the inventory."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from specpipe.swarm import identity, wire

log = logging.getLogger("specpipe.stage")

KEY_RELOAD_S = 1.0  # an unknown key id reloads the keyring at most this often


class StageKeys:
    """The keyring in use (`ring`), replaced by what `reload_keys` gives when asked to reload
    (at a heartbeat, and when a message names a key or a sender this stage does not know), with
    the roster it last read kept."""

    def __init__(
        self,
        keys: wire.Keyring | bytes | str,
        host: str,
        reload_keys: Callable[[], wire.Keyring] | None = None,
    ) -> None:
        self.ring = wire.keyring(keys)
        self.host = host
        self._reload_keys = reload_keys
        self._next_reload = 0.0

    def reload(self) -> None:
        """Take the keyring `reload_keys` gives now (a rotation may have changed it)."""
        if self._reload_keys is None:
            return
        try:
            self.ring = self._reload_keys().with_roster(self.ring.roster)
        except (OSError, ValueError) as exc:  # keep the keys we have
            log.warning("%s: cannot reload the swarm keys: %s", self.host, exc)

    def take_roster(self, roster: identity.Roster | None) -> None:
        """Believe `roster` (read with the inventory) from now on; None changes nothing."""
        if roster is not None and roster != self.ring.roster:
            self.ring = self.ring.with_roster(roster)

    def reload_due(self) -> bool:
        """Whether a message under an unknown key (or from an unknown sender) may reload the
        keyring and the roster now: at most every KEY_RELOAD_S, whatever the heartbeats and the
        housekeeping reload meanwhile (a message sealed under a new data key must not wait for
        them, nor be dropped)."""
        now = time.monotonic()
        if now < self._next_reload:
            return False
        self._next_reload = now + KEY_RELOAD_S
        return True
