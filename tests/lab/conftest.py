"""The lab's fixtures: a multi-host lab (network namespaces, root only) serving the tiny model."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from click.testing import CliRunner

from specpipe.cli import cli
from specpipe.ops.lab_hosts import Lab
from tests.swarmprocs import write_tiny_model


def lab_unavailable() -> str | None:
    """Why the lab cannot run here, or None."""
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "the lab needs iproute2's `ip`"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` does not work here"
    return None


def need(reason: str | None) -> None:
    """Skip the test for `reason` on a developer's machine; fail it under CI, which runs as
    root with everything the lab needs: a test that cannot run there is a broken one."""
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"cannot run under CI: {reason}")
    pytest.skip(reason)


def need_lab() -> None:
    """`need` the lab."""
    need(lab_unavailable())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


def run(*args: str, env: dict[str, str] | None = None):
    """`specpipe ARGS` in this process; the result."""
    return CliRunner().invoke(cli, list(args), env=env)


@pytest.fixture(scope="module")
def lab(tiny, tmp_path_factory):
    """Two hosts serving the tiny model (2 ms links; host 1's Redis TLS only) and one idle host,
    taken down afterwards."""
    need_lab()
    home = tmp_path_factory.mktemp("lab") / "lab"
    result = run(
        "lab",
        "up",
        "--hosts",
        "2",
        "--idle",
        "1",
        "--model",
        str(tiny),
        "--link-delay-ms",
        "2",
        "--port",
        "8000",
        "--home",
        str(home),
    )
    the_lab = Lab(home)
    try:
        assert result.exit_code == 0, result.output
        yield the_lab
    finally:
        the_lab.down()
