"""The lab's trust: its swarm CA, each host's certificates, and the secrets in its folder.

The lab has a swarm CA of its own (`specpipe.ops.certificates`), made afresh by each `up`, and
every host a TLS folder with a certificate for its address and a copy of the CA, as `specpipe
ca issue` makes them. The lab's folder keeps the swarm key, the web app's secret key and the
Redis passwords, each readable by its owner only: the keeper's (who makes the other hosts'
users on a host's Redis) and the lab's admin password; each host's folder keeps the password
of its own Redis user. (The passwords hosts log in to each other's Redis with are derived,
never kept: `specpipe.swarm.credentials`, `specpipe.swarm.peering`.) The lab's hosts share its
folder, as one operator's machines may; a host that joins by invitation has its own.
"""

from __future__ import annotations

import hashlib
import secrets
import shutil
from pathlib import Path

from specpipe.ops import certificates
from specpipe.ops.lab_network import LabError
from specpipe.ops.redis_server import TlsFiles
from specpipe.settings import (
    KEEPER_PASSWORD_FILE,
    LOCAL_REDIS_PASSWORD_FILE,
    TLS_DIR,
    write_private,
)

# A user of every host's Redis allowed every command (CONFIG too), for what disturbs the lab
# on purpose; its password is in the lab's folder only, no swarm process has it.
ADMIN_USER = "lab-admin"
ADMIN_PASSWORD_FILE = "redis_admin_password"
LAB_CA_DIR = "ca"  # the lab's swarm CA, made afresh by each `up`
LAB_CA_DAYS = 30


def make_certificates(directory: Path, address: str, authority: certificates.Authority) -> TlsFiles:
    """A host's TLS folder `directory`: a certificate `authority` signed for `address`, its
    key and a copy of the CA's certificate (what `specpipe ca issue` writes)."""
    try:
        return certificates.issue(authority, [address], directory, days=LAB_CA_DAYS, overwrite=True)
    except (certificates.CaError, OSError) as exc:
        raise LabError(f"cannot make {address}'s certificate in {directory}: {exc}") from None


class LabTrust:
    """The CA and the secrets of the lab whose folder is `home`."""

    def __init__(self, home: Path) -> None:
        self.home = home

    def make_secrets(self) -> None:
        """The swarm key, the web app's secret key and the lab's Redis passwords, each made
        once and kept."""
        key = self.home / "swarm_key"
        if not key.exists():
            write_private(key, secrets.token_hex(32) + "\n")
        secret = self.home / "secret_key"
        if not secret.exists():
            write_private(secret, secrets.token_hex(32) + "\n")
        # The keeper of each host's Redis users, which host 0's roster commands and beat log in
        # as to admit, revoke and invite, and each other host's stage to make its writers.
        for name in (ADMIN_PASSWORD_FILE, KEEPER_PASSWORD_FILE):
            if not (self.home / name).exists():
                write_private(self.home / name, secrets.token_hex(16) + "\n")

    def make_ca(self) -> certificates.Authority:
        """The lab's CA, made afresh, and a copy of its certificate in this machine's TLS
        folder (for the commands run here with the lab's folder as SPECPIPE_HOME)."""
        try:
            authority = certificates.make_ca(
                self.home / LAB_CA_DIR, name="specpipe lab CA", days=LAB_CA_DAYS, overwrite=True
            )
        except (certificates.CaError, OSError) as exc:
            raise LabError(f"cannot make the lab's CA: {exc}") from None
        here = self.tls_dir()
        here.mkdir(mode=0o700, exist_ok=True)
        shutil.copyfile(authority.cert, here / authority.cert.name)
        return authority

    def tls_dir(self, host_name: str | None = None) -> Path:
        """The TLS folder of the host named `host_name` (this machine's without one)."""
        return (self.home / host_name if host_name else self.home) / TLS_DIR

    def ca_cert(self) -> Path:
        """The lab's CA's certificate, which every host's TLS folder holds a copy of."""
        return certificates.Authority.in_dir(self.home / LAB_CA_DIR).cert

    def keeper_password(self) -> str:
        """The password of the keeper of each host's Redis users (`KEEPER_USER`)."""
        return (self.home / KEEPER_PASSWORD_FILE).read_text().strip()

    def admin_password(self) -> str:
        """The password of the lab's admin user of every host's Redis."""
        return (self.home / ADMIN_PASSWORD_FILE).read_text().strip()

    def admin_acl(self) -> str:
        """The ACL line of the lab's admin user, allowed every command."""
        digest = hashlib.sha256(self.admin_password().encode()).hexdigest()
        return f"user {ADMIN_USER} on #{digest} ~* &* +@all\n"

    def own_password(self, directory: Path) -> str:
        """The password of the `specpipe` user of the host whose folder is `directory`: made
        once, kept there (mode 0600), handed to that host's processes only."""
        path = directory / LOCAL_REDIS_PASSWORD_FILE
        if not path.exists():
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_private(path, secrets.token_hex(16) + "\n")
        return path.read_text().strip()
