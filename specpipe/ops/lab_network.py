"""The lab's network: a bridge in the root namespace and each host's namespace on it.

`LabNetwork.make` makes a bridge with an address in the root namespace (so this machine reaches
every host), and per host a namespace joined to it by a veth pair, with its own address on a
/24 no interface of this machine uses. Every namespace and link is named under `PREFIX` and
the lab's id, and noted (through the `record` the lab gives) *before* it is made, so
`leftovers` and `remove` find and remove them all even after a crash halfway. Root only:
namespaces need it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from specpipe.ops.redis_server import find_binary

SUBNET_PREFIX = "10.231"  # hosts at 10.231.N.1…, the bridge at 10.231.N.254
PREFIX = "splab"  # of every namespace and link a lab makes


class LabError(RuntimeError):
    """The lab cannot be brought up (or down) here; the message says why in one line."""


def check_can_run() -> None:
    """LabError unless this process is root and `ip netns` and redis-server are there."""
    if os.geteuid() != 0:
        raise LabError("the lab needs root: network namespaces cannot be made otherwise")
    if shutil.which("ip") is None:
        raise LabError("the lab needs the `ip` command (iproute2)")
    try:
        subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, timeout=10)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise LabError(f"`ip netns` does not work here: {exc}") from None
    find_binary()


def run_ip(*args: str, namespace: str | None = None, check: bool = True) -> str:
    """Run `ip args` (in `namespace`, if given) and return its output; LabError if it fails
    and `check`."""
    argv = ["ip", *(["-n", namespace] if namespace else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def free_subnet() -> str:
    """A 10.231.N prefix no interface of this machine uses."""
    used = run_ip("-4", "-o", "addr", check=False)
    for n in range(1, 255):
        if f" {SUBNET_PREFIX}.{n}." not in used:
            return f"{SUBNET_PREFIX}.{n}"
    raise LabError(f"every {SUBNET_PREFIX}.N.0/24 subnet is taken")


def link_names() -> list[str]:
    """The names of this machine's network links (in the root namespace)."""
    names = []
    for line in run_ip("-o", "link", check=False).splitlines():
        parts = line.split(":", 2)
        if len(parts) > 1:
            names.append(parts[1].strip().split("@")[0])
    return names


def namespace_names() -> set[str]:
    """The network namespaces that exist now."""
    return set(run_ip("netns", "list", check=False).split())


def namespace_pids(namespace: str) -> set[int]:
    """The processes that run in `namespace`."""
    return {int(p) for p in run_ip("netns", "pids", namespace, check=False).split()}


def leftovers(lab_id: str) -> tuple[set[str], set[str]]:
    """The namespaces and links that exist under lab `lab_id`'s names."""
    namespaces = {ns for ns in namespace_names() if ns.startswith(f"{PREFIX}-{lab_id}-")}
    links = {name for name in link_names() if name.startswith(f"{PREFIX}{lab_id}")}
    return namespaces, links


def remove(namespaces: Iterable[str], links: Iterable[str]) -> list[str]:
    """Delete those of `namespaces` and then of `links` that exist; return what was removed."""
    removed = []
    for namespace in sorted(set(namespaces) & namespace_names()):
        run_ip("netns", "del", namespace, check=False)
        removed.append(f"namespace {namespace}")
    for link in sorted(set(links) & set(link_names())):
        run_ip("link", "del", link, check=False)
        removed.append(f"link {link}")
    return removed


@dataclass(frozen=True)
class LabNetwork:
    """Lab `lab_id`'s bridge and namespaces in `subnet`; `record(kind, name)` notes each
    namespace ("namespaces") or link ("links") before it is made."""

    lab_id: str
    subnet: str
    record: Callable[[str, str], None]

    @property
    def bridge(self) -> str:
        """The bridge's name."""
        return f"{PREFIX}{self.lab_id}"

    def namespace(self, index: int) -> str:
        """Host `index`'s namespace's name."""
        return f"{PREFIX}-{self.lab_id}-h{index}"

    def address(self, index: int) -> str:
        """Host `index`'s address."""
        return f"{self.subnet}.{index + 1}"

    def make(self, n_hosts: int) -> None:
        """The bridge, with this machine's address on it, and `n_hosts` hosts' namespaces."""
        self.record("links", self.bridge)
        run_ip("link", "add", "name", self.bridge, "type", "bridge")
        run_ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        run_ip("link", "set", self.bridge, "up")
        for index in range(n_hosts):
            self.add_namespace(index)

    def add_namespace(self, index: int) -> str:
        """Host `index`'s namespace on the bridge, with its address; return its name."""
        namespace = self.namespace(index)
        veth, peer = f"{PREFIX}{self.lab_id}v{index}", f"{PREFIX}{self.lab_id}p{index}"
        self.record("namespaces", namespace)
        run_ip("netns", "add", namespace)
        self.record("links", veth)
        run_ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        run_ip("link", "set", peer, "netns", namespace)
        run_ip("link", "set", peer, "name", "eth0", namespace=namespace)
        run_ip("addr", "add", f"{self.address(index)}/24", "dev", "eth0", namespace=namespace)
        run_ip("link", "set", "eth0", "up", namespace=namespace)
        run_ip("link", "set", "lo", "up", namespace=namespace)
        run_ip("link", "set", veth, "master", self.bridge)
        run_ip("link", "set", veth, "up")
        return namespace
