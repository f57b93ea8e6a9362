"""A registry whose roster was retyped, mended on host 0.

No stage host's registry user may write the roster (`specpipe.swarm.credentials`), nor any key
but its own record and reply streams, which no reader fails on whatever their type. What is left
is the roster turned into a key of another type by anything else that writes host 0's Redis (an
operator's mistake, a registry shared with older hosts), after which every read of it fails
with WRONGTYPE. Whoever reads the registry on host 0 (a ring's build, `specpipe generate`, beat's
sync) mends it the same way (`repair`): the key of the wrong type deleted, the roster published
again from host 0's copy, and the registry marked mended for `MEND_WAIT_S`. While the mark
lives, a reader on host 0 that finds layers uncovered (`read_mended`) reads again, as the stages
beat back into the emptied inventory, whichever process did the mending. Only host 0's processes
can write the mark.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import redis

from specpipe import settings
from specpipe.swarm import identity, inventory
from specpipe.swarm.inventory import Inventory, RouteError
from specpipe.swarm.wire import Keyring

log = logging.getLogger("specpipe.registry")

# How long after a mending the stages are waited for: many beats (DEFAULT_HEARTBEAT_S) even on
# a loaded host, and well inside a job's patience.
MEND_WAIT_S = 10.0
MEND_PAUSE_S = 0.25  # between reads while the stages beat back in: about one beat

# The registry's keys every reader reads, and the type each must have.
REGISTRY_TYPES = {"roster": "string"}

Routed = TypeVar("Routed")


def mended_key(swarm: str) -> str:
    return f"specpipe:{swarm}:mended"


def wrong_type(exc: BaseException) -> bool:
    """Whether `exc` is Redis refusing a command on a key of another type (one a host put
    there in place of the registry's own)."""
    return isinstance(exc, redis.ResponseError) and str(exc).startswith("WRONGTYPE")


def repair(client: redis.Redis, swarm: str, home: Path | None = None) -> list[str]:
    """Put the registry's keys right: any of another type deleted, the registry marked mended
    when one was, and the roster published again from host 0's copy (in `home`) when the
    registry has none and this host holds the coordinator key. The keys deleted."""
    keys = {"roster": identity.roster_key(swarm)}
    deleted = []
    for name, key in keys.items():
        try:
            found = client.type(key)
        except redis.exceptions.NoPermissionError:  # not host 0's own user: not its to mend
            return []
        found = found.decode() if isinstance(found, bytes) else found
        if found not in ("none", REGISTRY_TYPES[name]):
            client.delete(key)
            deleted.append(key)
    if deleted:
        client.set(mended_key(swarm), ",".join(deleted), px=int(MEND_WAIT_S * 1000))
        log.warning("the registry held %s of the wrong type: deleted", ", ".join(deleted))
    _republish_roster(client, swarm, home)
    return deleted


def _republish_roster(client: redis.Redis, swarm: str, home: Path | None) -> None:
    path = settings.coordinator_key_path(home)
    if not path.exists() or identity.stored_roster(client, swarm) is not None:
        return
    signer = identity.Signer(identity.COORDINATOR, identity.load_private(path))
    kept = identity.load_roster_file(settings.roster_path(swarm, home), swarm, signer)
    if kept.version > 0:
        identity.publish_roster(client, kept, signer)


def read_mended(
    client: redis.Redis,
    swarm: str,
    keys: Keyring | None,
    route_of: Callable[[Inventory], Routed],
    home: Path | None = None,
) -> tuple[Inventory, Routed]:
    """The registry's verified inventory and `route_of` it (which raises RouteError when the
    inventory does not serve what the caller needs). A key of the wrong type is mended here
    (`repair`); while the registry is marked mended, by this process or another on host 0, a
    RouteError is read again after a pause, for up to `MEND_WAIT_S`. Other Redis errors, and a
    registry still retyped after the wait, are raised."""
    waiting_until = 0.0

    def waited() -> bool:
        return 0 < waiting_until <= time.monotonic()

    while True:
        try:
            found = inventory.read(client, swarm, keys)
            return found, route_of(found)
        except RouteError:
            # Every read of a retyped roster finds none (`identity.stored_roster`): the layers
            # look uncovered. Mended here, or by another process of host 0 a moment ago.
            if waited() or not (repair(client, swarm, home) or client.exists(mended_key(swarm))):
                raise
        except redis.ResponseError as exc:
            if not wrong_type(exc) or waited():
                raise
            repair(client, swarm, home)
        waiting_until = waiting_until or time.monotonic() + MEND_WAIT_S
        time.sleep(MEND_PAUSE_S)
