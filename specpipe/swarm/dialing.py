"""How a process dials a host's Redis from the address the inventory gives for it.

Messages name hops by host only, and the inventory records each host's Redis address without
user or password. The credentials are the dialling process's own: a URL it was configured with
(its own `--redis`, its `--registry`, `REDIS_URL`) is dialled as configured, with its host's own
user and password, and any other address as the peer user with the swarm's data-plane password
(`settings.redis_password`), which every stage host's Redis accepts for that user and which
reaches there only what another host does (`specpipe.ops.redis_server.PEER_COMMANDS`). Without
a data-plane password an address is dialled as it is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import quote

from specpipe import settings
from specpipe.swarm.redact import without_credentials

REDIS_USER = "specpipe"  # a locked-down swarm Redis's own user, for its host's processes
PEER_USER = "specpipe-peer"  # the user other hosts dial a stage host's Redis as


@dataclass(frozen=True)
class Dialer:
    """Turns a host's address into the URL this process connects with."""

    own: tuple[str, ...] = ()  # the URLs this process was configured with, credentials and all
    password: str | None = field(default=None, repr=False)  # the swarm's data-plane password
    username: str = PEER_USER

    @classmethod
    def configured(cls, urls: Iterable[str | None], password: str | None) -> Dialer:
        """A dialer for a process configured with `urls` (None entries skipped)."""
        return cls(tuple(url for url in urls if url), password)

    @classmethod
    def for_settings(cls, config: settings.Settings, *urls: str | None) -> Dialer:
        """The dialer of a process with `config` (its registry and broker) and `urls`."""
        return cls.configured((config.redis_url, *urls), config.redis_password)

    @classmethod
    def from_env(cls) -> Dialer:
        """The dialer of a process configured by its environment alone."""
        return cls.for_settings(settings.Settings.from_env(), settings.registry_url())

    def url(self, address: str) -> str:
        """The URL to connect to `address` with (an address or a URL, credentials or not)."""
        bare = without_credentials(address)
        for url in self.own:
            if without_credentials(url) == bare:
                return url
        if not self.password or "//" not in bare:
            return address
        auth = f"{quote(self.username, safe='')}:{quote(self.password, safe='')}@"
        start = bare.index("//") + 2
        return bare[:start] + auth + bare[start:]
