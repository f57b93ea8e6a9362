"""`specpipe join` in the lab: a bare host joins the running swarm with one command (starting
its own Redis, choosing its layers, registering at its own address), as a spare; then the
stage a job runs through is killed and the job goes on through the other, across namespaces."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import redis

from models import Job
from models.db import make_session_factory
from models.runs import Run
from specpipe.swarm import inventory, trust
from tests.lab.conftest import run
from tests.waiting import wait_until

PROMPT = "hello world"
ARGS = ["--temp", "0.8", "--seed", "11", "--max-new-tokens", "120", "--no-spec"]


def lab_env(lab) -> dict[str, str]:
    return {
        "SPECPIPE_HOME": str(lab.home),
        "REDIS_URL": "",
        "SPECPIPE_SWARM": "",
        "SPECPIPE_SWARM_KEY": "",
        "DATABASE_URL": "",
    }


def nodes(lab) -> list[inventory.NodeInfo]:
    client = redis.Redis.from_url(lab.state["registry_url"])
    try:
        return inventory.load(client, "lab", trust.home_keyring(lab.home))
    finally:
        client.close()


def admit(lab, host: str) -> str:
    """As the operator does: `specpipe host key` where the host's keys are (the lab's folder),
    `specpipe host admit` on host 0; the host's public keys, signing and sealing."""
    keys = run("host", "key", "--host", host, env=lab_env(lab)).output.strip()
    admitted = run("host", "admit", host, *keys.split(), env=lab_env(lab))
    assert admitted.exit_code == 0, admitted.output
    return keys


def join_argv(host, model, layers: str) -> list[str]:
    """`specpipe join` in `host`'s namespace, as that host's operator runs it."""
    return [
        *("ip", "netns", "exec", host.namespace, sys.executable, "-m", "specpipe", "join"),
        *("--layers", layers, "--model", str(model), "--host", host.name),
        *("--threads", "1"),
    ]


def one_process_tokens(lab, tiny) -> list[int]:
    """The job's tokens from a one-process run of the same model split in two (the reference
    every run through the lab must equal)."""
    local = run(
        "generate",
        PROMPT,
        "--model",
        str(tiny),
        "--json",
        "--local",
        "--stages",
        "2",
        *ARGS,
        env=lab_env(lab),
    )
    assert local.exit_code == 0, local.output
    return json.loads(local.output)["tokens"]


def latest_job(lab) -> Job | None:
    with make_session_factory(lab.state["database_url"])() as session:
        return session.query(Job).order_by(Job.id.desc()).first()


def test_join_needs_a_registry_and_a_pin_or_a_key_and_says_so_in_one_line(tmp_path):
    env = {"SPECPIPE_HOME": str(tmp_path), "SPECPIPE_SWARM_KEY": "", "SPECPIPE_REGISTRY_URL": ""}
    result = run("join", env=env)
    assert result.exit_code == 1
    assert "no registry: pass --registry URL or set SPECPIPE_REGISTRY_URL" in result.output
    # A registry, but neither the coordinator's pin nor (without identities) a swarm key.
    env["SPECPIPE_REGISTRY_URL"] = "rediss://192.0.2.1:6379/0"
    result = run("join", env=env)
    assert result.exit_code == 1
    assert (
        result.output.strip()
        == "Error: no swarm key: set SPECPIPE_SWARM_KEY or SPECPIPE_SWARM_KEY_FILE"
    )


def test_a_bare_host_joins_as_a_spare_and_takes_over_when_the_stage_dies(lab, tiny):
    lab.load()
    bare = lab.hosts()[2]
    assert not bare.redis_url  # nothing runs there yet
    join = join_argv(bare, tiny, "auto")
    # Not admitted yet: one line that says what to run on host 0, and nothing started.
    refused = subprocess.run(join, env=lab.env(bare), capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    key = admit(lab, bare.name)
    assert refused.stderr.strip().splitlines()[-1] == (
        f"Error: host {bare.name!r} is not admitted under this host's keys: on host 0 run "
        f"`specpipe host admit {bare.name} {key}`"
    )
    joined = subprocess.Popen(
        join,
        env=lab.env(bare),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(
            lambda: any(n.host == bare.name for n in nodes(lab)) or joined.poll(),
            60,
            "the new host to register",
        )
        assert joined.poll() is None, joined.stdout.read()
        record = next(n for n in nodes(lab) if n.host == bare.name)
        # Every layer was served: it spares one of the two ranges, at its own address, with a
        # Redis it started there (locked down: TLS only, with the certificate of its host's
        # TLS folder, and a password, which its record does not carry).
        assert record.layers in ("0:2", "2:4") and record.public_ip == bare.address
        ca = lab.tls_dir(bare) / "ca.pem"
        assert record.redis_url == f"rediss://{bare.address}:6379/0?ssl_ca_certs={ca}"
        with pytest.raises(redis.RedisError, match="(?i)auth"):
            redis.Redis.from_url(record.redis_url, socket_connect_timeout=5).ping()
        with pytest.raises(redis.ConnectionError):  # plain text is not spoken
            redis.Redis.from_url(f"redis://{bare.address}:6379/0", socket_connect_timeout=5).ping()
        partner = next(
            n.host for n in nodes(lab) if n.layers == record.layers and n.host != bare.name
        )

        want = one_process_tokens(lab, tiny)
        out = {}
        thread = threading.Thread(
            target=lambda: out.update(
                result=run(
                    "generate", PROMPT, "--model", str(tiny), "--json", *ARGS, env=lab_env(lab)
                )
            )
        )
        thread.start()
        job = wait_until(
            lambda: (j := latest_job(lab)) and j.generated_tokens >= 10 and j.run_id and j,
            60,
            "10 tokens of the job",
        )
        with make_session_factory(lab.state["database_url"])() as session:
            route = session.get(Run, job.run_id).topology.split(" -> ")
        victim = bare.name if bare.name in route else partner
        assert victim in route
        before = job.generated_tokens
        if victim == bare.name:
            joined.send_signal(signal.SIGKILL)
        else:
            os.kill(lab.state["processes"][f"{victim}-stage-{victim}"], signal.SIGKILL)
        killed = time.monotonic()

        def next_round() -> bool:
            job = latest_job(lab)
            return job.generated_tokens > before + 1 or job.finished

        wait_until(next_round, 60, "the next round", interval_s=0.01)
        stall_s = time.monotonic() - killed
        thread.join(120)
        result = out["result"]
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["tokens"] == want
        assert stall_s < 6.0, stall_s
        print(f"failover across namespaces ({victim} killed): {stall_s:.2f} s to the next round")
    finally:
        if joined.poll() is None:
            joined.terminate()
            joined.wait(20)
