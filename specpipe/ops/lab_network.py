"""The lab's network: a bridge in the root namespace and each host's namespace on it.

Each host is a network namespace joined to the bridge by a veth pair, with its own address on
a /24 no interface of this machine uses; the bridge has an address too, so this machine
reaches every host. Every namespace and link is named under `PREFIX`, so a lab's leftovers are
found by name after a crash. Root only: namespaces need it.
"""

from __future__ import annotations

import os
import shutil
import subprocess

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


def _ip(*args: str, namespace: str | None = None, check: bool = True) -> str:
    argv = ["ip", *(["-n", namespace] if namespace else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _free_subnet() -> str:
    """A 10.231.N prefix no interface of this machine uses."""
    used = _ip("-4", "-o", "addr", check=False)
    for n in range(1, 255):
        if f" {SUBNET_PREFIX}.{n}." not in used:
            return f"{SUBNET_PREFIX}.{n}"
    raise LabError(f"every {SUBNET_PREFIX}.N.0/24 subnet is taken")


def _links() -> list[str]:
    names = []
    for line in _ip("-o", "link", check=False).splitlines():
        parts = line.split(":", 2)
        if len(parts) > 1:
            names.append(parts[1].strip().split("@")[0])
    return names
