"""How a process dials a host's Redis from the address the inventory gives for it.

Messages name hops by host only, and the inventory records each host's Redis address without
user or password. The credentials are the dialling process's own: a URL it was configured with
(its own `--redis`, its `--registry`, `REDIS_URL`) is dialled as configured, with its host's own
user and password, and another host's address as this host's own user there, with the password
that pair derives (`specpipe.swarm.peering`), which reaches there only what another host does.
The one peer user with a data-plane password (`settings.redis_password`) is left for a swarm
that opted out of host identities (`SPECPIPE_INSECURE_SHARED_KEY`) and for a unix socket, which
is this machine's own Redis (`specpipe up`'s stages, whose password never leaves the machine).
Without either, an address is dialled without a password. A password is never sent in clear: a
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

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from specpipe import settings
from specpipe.swarm import identity
from specpipe.swarm.peering import Peering
from specpipe.swarm.redact import without_credentials

REDIS_USER = "specpipe"  # a locked-down swarm Redis's own user, for its host's processes
PEER_USER = "specpipe-peer"  # the one peer user of a swarm without host identities
ADDRESS_OPTIONS = ("db",)  # all that another host's address may say about how it is dialled

log = logging.getLogger(__name__)
_warned: set[str] = set()  # the clear hosts already logged as dialled without a password


@dataclass(frozen=True)
class Dialer:
    """Turns a host's address into the URL this process connects with."""

    own: tuple[str, ...] = ()  # the URLs this process was configured with, credentials and all
    password: str | None = field(default=None, repr=False)  # a swarm-wide data-plane password
    username: str = PEER_USER
    ca: str | None = None  # this host's copy of the swarm CA's certificate
    # Send the password over plain redis:// to another machine too (a test lab's own links).
    clear: bool = field(default_factory=settings.insecure_clear_passwords)
    # This host's own users on the others' Redis; it takes the password's place where it knows
    # the owner of an address.
    peering: Peering | None = None

    @classmethod
    def configured(
        cls,
        urls: Iterable[str | None],
        password: str | None,
        ca: str | None = None,
        peering: Peering | None = None,
    ) -> Dialer:
        """A dialer for a process configured with `urls` (None entries skipped) that verifies
        other hosts' TLS servers against `ca`."""
        return cls(tuple(url for url in urls if url), password, ca=ca, peering=peering)

    @classmethod
    def for_settings(
        cls, config: settings.Settings, *urls: str | None, as_host: str | None = None
    ) -> Dialer:
        """The dialer of a process with `config` (its registry and broker, its CA) and `urls`,
        logging in to other hosts as `as_host` (else, on host 0, as the coordinator)."""
        return cls.configured(
            (config.redis_url, *urls),
            config.redis_password,
            config.tls_ca,
            own_peering(config, as_host),
        )

    @classmethod
    def from_env(cls) -> Dialer:
        """The dialer of a process configured by its environment alone."""
        return cls.for_settings(settings.Settings.from_env(), settings.registry_url())

    def learn(self, roster: identity.Roster | None = None, nodes: Iterable = ()) -> None:
        """Tell the peering the hosts' sealing keys (`roster`) and addresses (`nodes`: records,
        or (host, address) pairs)."""
        if self.peering is not None:
            pairs = [n if isinstance(n, tuple) else (n.host, n.redis_url) for n in nodes]
            self.peering.learn(roster, pairs)

    def url(self, address: str, host: str | None = None) -> str:
        """The URL to connect to `address` (an address or a URL, credentials or not), the
        Redis of `host` when the caller knows it."""
        bare = without_credentials(address)
        for url in self.own:
            if without_credentials(url) == bare:
                return url
        if "//" not in bare:
            return address
        # A unix socket is this machine's (`specpipe up`'s stages on one Redis): no pair there.
        paired = self.peering is not None and not bare.startswith("unix:")
        login = self.peering.login(bare, host) if paired else None
        if login is None and self.password:
            login = (self.username, self.password)
        if login is None:
            return self._checked(address)
        if not self.clear and not carries_secrets_safely(bare):
            _warn_clear(bare)
            return self._checked(bare)
        auth = f"{quote(login[0], safe='')}:{quote(login[1], safe='')}@"
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


def own_peering(config: settings.Settings, name: str | None = None) -> Peering | None:
    """How this process logs in to the other hosts' Redis: as host `name` with its sealing key,
    or without a name, as the coordinator where this host holds its key (host 0); None where
    no coordinator key is pinned (no host identities) or the key is not here."""
    if config.coordinator_public_key is None:
        return None
    _, coordinator = identity.pinned(config.coordinator_public_key)
    if name is None or name == identity.COORDINATOR:
        name, signing = identity.COORDINATOR, settings.coordinator_key_path(config.home)
    else:
        signing = settings.host_key_path(name, config.home)
    path = settings.sealing_key_path(signing)
    if not path.exists():
        return None
    return Peering(config.swarm, name, identity.load_private(path, X25519PrivateKey), coordinator)


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
        "dialling %s without a password: it would travel in clear (plain redis:// "
        "to another machine); that host's Redis refuses the link until it serves TLS "
        "(`specpipe join` without --insecure-no-tls)",
        address,
    )
