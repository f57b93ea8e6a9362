"""The lab's trust: its swarm CA, each host's certificates, and the secrets in its folder.

The lab has a swarm CA of its own (`specpipe.ops.certificates`), made afresh by each `up`, and
every host a TLS folder with a certificate for its address and a copy of the CA, as `specpipe
ca issue` makes them. The lab's folder keeps the swarm key, the web app's secret key and the
Redis passwords, each readable by its owner only: the swarm's data-plane password (every
host's Redis takes it for its peer user), host 0's `specpipe-remote` password, and the lab's
admin password; each host's folder keeps the password of its own Redis user.
"""

from __future__ import annotations

import os
from pathlib import Path

from specpipe.ops import certificates
from specpipe.ops.lab_network import LabError
from specpipe.ops.redis_server import TlsFiles

# A user of every host's Redis allowed every command (CONFIG too), for what disturbs the lab
# on purpose; its password is in the lab's folder only, no swarm process has it.
ADMIN_USER = "lab-admin"
ADMIN_PASSWORD_FILE = "redis_admin_password"
# The password of host 0's `specpipe-remote`: the registry's user for the other hosts.
REMOTE_PASSWORD_FILE = "redis_remote_password"
LAB_CA_DIR = "ca"  # the lab's swarm CA, made afresh by each `up`
LAB_CA_DAYS = 30


def _private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def make_certificates(directory: Path, address: str, authority: certificates.Authority) -> TlsFiles:
    """A host's TLS folder `directory`: a certificate `authority` signed for `address`, its
    key and a copy of the CA's certificate (what `specpipe ca issue` writes)."""
    try:
        return certificates.issue(authority, [address], directory, days=LAB_CA_DAYS, overwrite=True)
    except (certificates.CaError, OSError) as exc:
        raise LabError(f"cannot make {address}'s certificate in {directory}: {exc}") from None
