"""How a process dials a host's Redis from the address the inventory gives for it.

Messages name hops by host only, and the inventory records each host's Redis address without
user or password. The credentials are the dialling process's own: a URL it was configured with
(its own `--redis`, its `--registry`, `REDIS_URL`) is dialled as configured, with its host's own
user and password, and any other address as the peer user with the swarm's data-plane password
(`settings.redis_password`), which every stage host's Redis accepts for that user and which
reaches there only what another host does (`specpipe.ops.redis_server.PEER_COMMANDS`). Without
a data-plane password an address is dialled without one. A password is never sent in clear: a
plain `redis://` address other than loopback (a host joined with `--insecure-no-tls`) is dialled
without it, and its Redis refuses the link, which the dialling process logs once, with why
(unless `SPECPIPE_INSECURE_CLEAR_PASSWORDS=1` says out loud to send it all the same, as a test
lab does for its plain links inside one machine).

How another host's server is checked is the dialling process's own too: of the options an
address carries (its query), only the database is kept, and a `rediss://` address is verified
against this host's own copy of the swarm CA (`settings.swarm_ca`), never a file or an option
(`ssl_cert_reqs=none`, `ssl_ca_path`, …) the address names. Without a CA of its own, such a
server is verified against the system's CAs, which never signed it: it is refused.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

from specpipe import settings
from specpipe.swarm.redact import without_credentials

REDIS_USER = "specpipe"  # a locked-down swarm Redis's own user, for its host's processes
PEER_USER = "specpipe-peer"  # the user other hosts dial a stage host's Redis as
ADDRESS_OPTIONS = ("db",)  # all that another host's address may say about how it is dialled

log = logging.getLogger(__name__)
_warned: set[str] = set()  # the clear hosts already logged as dialled without a password


@dataclass(frozen=True)
class Dialer:
    """Turns a host's address into the URL this process connects with."""

    own: tuple[str, ...] = ()  # the URLs this process was configured with, credentials and all
    password: str | None = field(default=None, repr=False)  # the swarm's data-plane password
    username: str = PEER_USER
    ca: str | None = None  # this host's copy of the swarm CA's certificate
    # Send the password over plain redis:// to another machine too (a test lab's own links).
    clear: bool = field(default_factory=settings.insecure_clear_passwords)

    @classmethod
    def configured(
        cls, urls: Iterable[str | None], password: str | None, ca: str | None = None
    ) -> Dialer:
        """A dialer for a process configured with `urls` (None entries skipped) that verifies
        other hosts' TLS servers against `ca`."""
        return cls(tuple(url for url in urls if url), password, ca=ca)

    @classmethod
    def for_settings(cls, config: settings.Settings, *urls: str | None) -> Dialer:
        """The dialer of a process with `config` (its registry and broker, its CA) and `urls`."""
        return cls.configured((config.redis_url, *urls), config.redis_password, config.tls_ca)

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
        if "//" not in bare:
            return address
        if not self.password:
            return self._checked(address)
        if not self.clear and not carries_secrets_safely(bare):
            _warn_clear(bare)
            return self._checked(bare)
        auth = f"{quote(self.username, safe='')}:{quote(self.password, safe='')}@"
        start = bare.index("//") + 2
        return self._checked(bare[:start] + auth + bare[start:])

    def _checked(self, url: str) -> str:
        """`url` with this process's own options for another host: its database kept, any
        other option dropped, and for TLS this host's CA."""
        base, _, query = url.partition("?")
        options = [(k, v) for k, v in parse_qsl(query) if k in ADDRESS_OPTIONS]
        if base.startswith("rediss://") and self.ca:
            options.append(("ssl_ca_certs", self.ca))
        return f"{base}?{urlencode(options, quote_via=quote, safe='/')}" if options else base


def carries_secrets_safely(address: str) -> bool:
    """Whether a password may travel to `address`: over TLS (`rediss://`), a unix socket, or
    plain `redis://` to loopback, where it never leaves the machine."""
    scheme = address.partition("://")[0].lower()
    if scheme in ("rediss", "unix"):
        return True
    host = urlsplit(address).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _warn_clear(address: str) -> None:
    address = f"redis://{urlsplit(address).netloc}"
    if address in _warned:
        return
    _warned.add(address)
    log.warning(
        "dialling %s without the data-plane password: it would travel in clear (plain redis:// "
        "to another machine); that host's Redis refuses the link until it serves TLS "
        "(`specpipe join` without --insecure-no-tls)",
        address,
    )
