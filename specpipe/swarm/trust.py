"""The keyring a process of this host seals, signs and believes with, from its settings.

One place turns the settings into a `wire.Keyring`: the swarm keys and the identities
(`specpipe.swarm.identity`): a stage signs as its host with its own key (made on first use), the
coordinator's processes with the coordinator key that host 0 holds. The roster comes later, from
the registry, with the inventory (`inventory.read`).

It is also the one place that fails closed: settings that pin no coordinator key give no
keyring (`check_pinned`), unless the operator opted out out loud.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from specpipe import settings as settings_module
from specpipe.settings import Settings
from specpipe.swarm import credentials, identity, wire
from specpipe.swarm.dialing import carries_secrets_safely

log = logging.getLogger("specpipe.trust")
_warned = False  # the opt-out's warning is given once per process, not at every keyring


def keyring(settings: Settings, signer: str | None = None) -> wire.Keyring:
    """`settings`' keyring, signing as `signer` (a host's name, or `identity.COORDINATOR`; None:
    it only reads and verifies). WireError without a swarm key where no coordinator key is
    pinned (with one, the roster's data keys seal: a stage host holds no swarm key);
    IdentityError when no coordinator key is pinned (`check_pinned`) or it cannot be read, or
    the coordinator signs on a host without its key."""
    if not settings.accepted_swarm_keys and settings.coordinator_public_key is None:
        raise wire.WireError("no swarm key: set SPECPIPE_SWARM_KEY")
    check_pinned(settings)
    if settings.coordinator_public_key is None:  # the operator opted out
        return wire.Keyring(settings.accepted_swarm_keys)
    return wire.Keyring(
        settings.accepted_swarm_keys,
        signer=_signer(signer, settings.home),
        coordinator=identity.pinned(settings.coordinator_public_key)[0],
    )


def registry_url(settings: Settings, host: str, url: str) -> str:
    """`url`, the registry's address, as stage host `host` dials it: with its own registry user
    and the password it derives (`specpipe.swarm.credentials`) when the address names no user
    and the pinned coordinator key has a sealing half, and never to travel in clear (plain
    `redis://` to another machine, unless `SPECPIPE_INSECURE_CLEAR_PASSWORDS` says so); else as
    it is."""
    if settings.coordinator_public_key is None:
        return url
    _, coordinator_sealing = identity.pinned(settings.coordinator_public_key)
    signer = _signer(host, settings.home)
    if coordinator_sealing is None or signer is None or signer.sealing is None:
        return url
    if not settings_module.insecure_clear_passwords() and not carries_secrets_safely(url):
        return url  # never sent in clear: the registry refuses the link, and says so
    password = credentials.registry_password(
        signer.sealing, coordinator_sealing, settings.swarm, host
    )
    return credentials.registry_url(url, settings.swarm, host, password)


def check_pinned(settings: Settings) -> None:
    """Nothing when `settings` pin the coordinator's key. Without one, IdentityError: one line
    saying where to put it; unless the operator opted out (`insecure_shared_key`), and then a
    warning, once per process, of what that lets every holder of the swarm key do."""
    if settings.coordinator_public_key is not None:
        return
    folder = settings.tls_dir or settings.home / settings_module.TLS_DIR
    if not settings.insecure_shared_key:
        raise identity.IdentityError(
            f"this host pins no coordinator key: copy host 0's coordinator.pub into {folder} "
            f"or {settings.home} (`specpipe host init` on host 0 makes it), or set "
            "SPECPIPE_INSECURE_SHARED_KEY=1 to trust every holder of the swarm key alike"
        )
    global _warned
    if not _warned:
        _warned = True
        log.warning(
            "this host pins no coordinator key (SPECPIPE_INSECURE_SHARED_KEY=1): every holder "
            "of the swarm key can speak here as the coordinator or as any host, and write any "
            "host's inventory record; copy host 0's coordinator.pub into %s to end it",
            folder,
        )


def home_keyring(home: Path) -> wire.Keyring:
    """The verifying keyring of the swarm whose instance folder is `home` (`specpipe up`'s, a
    lab's): the keys of its key file and the coordinator key pinned there, under `keyring`'s
    rule (this process's opt-out, if any, applies)."""
    keys = settings_module.key_file_keys(home / settings_module.SWARM_KEY_FILE)
    pin = home / settings_module.COORDINATOR_PUB_FILE
    config = replace(
        Settings.from_env(),
        home=home,
        tls_dir=None,
        swarm_key=keys[0] if keys else None,
        old_swarm_keys=keys[1:],
        coordinator_public_key=pin.read_text().strip() if pin.is_file() else None,
    )
    return keyring(config)


def _signer(name: str | None, home: Path) -> identity.Signer | None:
    if name is None:
        return None
    if name == identity.COORDINATOR:
        path = settings_module.coordinator_key_path(home)
        if not path.exists():
            raise identity.IdentityError(
                f"this host pins a coordinator key but holds none at {path}: the coordinator's "
                "processes run on host 0 (`specpipe host init` makes its key)"
            )
        sealing = settings_module.sealing_key_path(path)
        opener = identity.load_private(sealing, X25519PrivateKey) if sealing.exists() else None
        return identity.Signer(name, identity.load_private(path), opener)
    path = settings_module.host_key_path(name, home)
    sealing = identity.ensure_private(settings_module.sealing_key_path(path), X25519PrivateKey)
    return identity.Signer(name, identity.ensure_private(path), sealing)


def reading_keyring() -> wire.Keyring:
    """This process's verifying keyring (`keyring` of its settings, signing nothing); a
    ValueError of one line (no secret in it) when it has no swarm key, pins no coordinator key
    without opting out, or its keys or pinned coordinator key cannot be read."""
    return keyring(Settings.from_env())
