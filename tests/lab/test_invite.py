"""Joining by invitation in the lab: `specpipe host invite` on host 0, and on a bare host with
an empty instance folder `specpipe join TOKEN` and nothing else. It serves (a job goes through
it once its partner is gone, with the tokens of the one-process run), and the line does not
work twice."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from specpipe.swarm import credentials
from tests.lab.conftest import run
from tests.lab.test_join import ARGS, PROMPT, lab_env, nodes, one_process_tokens
from tests.waiting import wait_until


def bare_env(lab, host, home) -> dict[str, str]:
    """A new host's environment: its own empty instance folder, nothing of the swarm's (the
    lab's plain links and its Redis build allowed, as on every lab host)."""
    env = lab.env(host)
    for name in ("SPECPIPE_REGISTRY_URL", "SPECPIPE_SWARM", "REDIS_URL", "SPECPIPE_TLS_DIR"):
        env.pop(name, None)
    env["SPECPIPE_HOME"] = str(home)
    return env


def join_argv(host, model, token: str) -> list[str]:
    return [
        *("ip", "netns", "exec", host.namespace, sys.executable, "-m", "specpipe", "join"),
        *(token, "--model", str(model), "--threads", "1"),
    ]


@pytest.mark.slow
def test_a_bare_host_joins_with_the_one_line_host_0_printed(lab, tiny, tmp_path):
    lab.load()
    bare = lab.hosts()[2]
    invited = run("host", "invite", bare.name, "--layers", "2:4", env=lab_env(lab))
    assert invited.exit_code == 0, invited.output
    token = invited.output.strip()
    assert token.startswith("specpipe-join-1:") and len(token.splitlines()) == 1
    home = tmp_path / "new-host"
    joined = subprocess.Popen(
        join_argv(bare, tiny, token),
        env=bare_env(lab, bare, home),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(
            lambda: any(n.host == bare.name for n in nodes(lab)) or joined.poll() is not None,
            90,
            "the invited host to register",
        )
        assert joined.poll() is None, joined.stdout.read()
        record = next(n for n in nodes(lab) if n.host == bare.name)
        assert record.layers == "2:4" and record.public_ip == bare.address
        ca = home / "tls" / "ca.pem"  # the CA copy the answer brought, where it verifies others
        assert record.redis_url == f"rediss://{bare.address}:6379/0?ssl_ca_certs={ca}"
        assert sorted(p.name for p in (home / "tls").iterdir()) == [
            "ca.pem",
            "coordinator.pub",
            "redis.key",
            "redis.pem",
        ]
        users = {u.decode() for u in admin_users(lab)}
        assert credentials.user("lab", bare.name) in users
        # What it holds is its own: no secret of host 0's (nor the swarm key, nor a
        # data-plane password) in its folder, the CA's certificate and the pin aside.
        held = credentials_in(home)
        assert {"swarm_key", "redis_password"}.isdisjoint(p.name for p in home.iterdir())
        assert held and not held & credentials_in(lab.home, skip={home})
        wait_until(  # spent: its user gone at host 0's next beat
            lambda: not [u for u in admin_users(lab) if u.startswith(b"invite/")],
            30,
            "the invitation's user to be deleted",
        )
        # The same line again, on another empty host folder: refused in one line.
        again = subprocess.run(
            join_argv(bare, tiny, token),
            env=bare_env(lab, bare, tmp_path / "again"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert again.returncode == 1
        assert again.stderr.strip().splitlines()[-1] == (
            "Error: the registry refuses this invitation: it was used, expired or withdrawn"
        )
        # It serves: with its partner gone, a job goes through it, with the one-process tokens.
        want = one_process_tokens(lab, tiny)
        os.kill(lab.state["processes"]["h1-stage-h1"], signal.SIGKILL)
        wait_until(
            lambda: all(n.host != "h1" or n.status() != "online" for n in nodes(lab)),
            60,
            "h1 to drop out",
        )
        result = run("generate", PROMPT, "--model", str(tiny), "--json", *ARGS, env=lab_env(lab))
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["tokens"] == want
    finally:
        if joined.poll() is None:
            joined.terminate()
            joined.wait(20)


PUBLIC = ("ca.pem", "coordinator.pub", "redis.pem")  # what any host may show anyone


def credentials_in(folder, skip=()) -> set[str]:
    """Every secret-looking value in the files under `folder` (but `skip`, and the public
    ones): each key's PEM body, and each run of 32 or more hex digits or base64 signs."""
    found = set()
    for path in folder.rglob("*"):
        if not path.is_file() or path.name in PUBLIC or any(s in path.parents for s in skip):
            continue
        text = path.read_bytes().decode("latin-1")
        found |= set(re.findall(r"[A-Za-z0-9+/=]{32,}", text))
    return found


def admin_users(lab) -> list[bytes]:
    client = lab.admin_redis(lab.hosts()[0])
    try:
        return client.execute_command("ACL", "USERS")
    finally:
        client.close()
