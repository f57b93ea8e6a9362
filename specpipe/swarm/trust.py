"""The keyring a process of this host seals, signs and believes with, from its settings.

One place turns the settings into a `wire.Keyring`: the swarm keys, and where the host pins
the coordinator's public key, the identities (`specpipe.swarm.identity`): a stage signs as its
host with its own key (made on first use), the coordinator's processes with the coordinator key
that host 0 holds. The roster comes later, from the registry, with the inventory
(`inventory.read`).
"""

from __future__ import annotations

from pathlib import Path

from specpipe import settings as settings_module
from specpipe.settings import Settings
from specpipe.swarm import identity, wire


def keyring(settings: Settings, signer: str | None = None) -> wire.Keyring:
    """`settings`' keyring, signing as `signer` (a host's name, or `identity.COORDINATOR`; None:
    it only reads and verifies). WireError without a swarm key; IdentityError when the pinned
    coordinator key cannot be read, or the coordinator signs on a host without its key."""
    if not settings.accepted_swarm_keys:
        raise wire.WireError("no swarm key: set SPECPIPE_SWARM_KEY")
    if settings.coordinator_public_key is None:
        return wire.Keyring(settings.accepted_swarm_keys)
    return wire.Keyring(
        settings.accepted_swarm_keys,
        signer=_signer(signer, settings.home),
        coordinator=identity.public_key(settings.coordinator_public_key),
    )


def home_keyring(home: Path) -> wire.Keyring:
    """The verifying keyring of the swarm whose instance folder is `home` (`specpipe up`'s, a
    lab's): the keys of its key file, and its pinned coordinator key when it has one."""
    keys = settings_module.key_file_keys(home / settings_module.SWARM_KEY_FILE)
    pin = home / settings_module.COORDINATOR_PUB_FILE
    coordinator = identity.public_key(pin.read_text()) if pin.is_file() else None
    return wire.Keyring(keys, coordinator=coordinator)


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
        return identity.Signer(name, identity.load_private(path))
    path = settings_module.host_key_path(name, home)
    return identity.Signer(name, identity.ensure_private(path))


def reading_keyring() -> wire.Keyring | None:
    """This process's verifying keyring (`keyring` of its settings, signing nothing); None when
    it has no swarm key, or its keys or pinned coordinator key cannot be read."""
    try:
        return keyring(Settings.from_env())
    except ValueError:
        return None
