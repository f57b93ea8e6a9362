"""Real swarm processes for tests: a tiny checkpoint with a tokenizer, `specpipe worker stage`
processes serving it, and a `specpipe worker coordinator` process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from specpipe.ops.supervisor import terminate_all
from specpipe.swarm import inventory
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
SPECPIPE = [sys.executable, "-m", "specpipe"]


def wait_heartbeats(
    registry: str,
    swarm: str,
    key: str | bytes,
    procs: dict[str, subprocess.Popen],
    hosts,
    timeout_s: float,
) -> None:
    """Wait until each stage host has heartbeated since now; fail early if its process exits."""
    client = redis.Redis.from_url(registry)
    since = time.time() - 0.5
    pending = set(hosts)

    def all_up() -> bool:
        for node in inventory.load(client, swarm, key):
            if node.host in pending and node.last_heartbeat >= since:
                pending.discard(node.host)
        for host in pending:
            if procs[host].poll() is not None:
                raise RuntimeError(f"stage {host} exited with {procs[host].returncode}")
        return not pending

    try:
        wait_until(
            all_up,
            timeout_s,
            f"stages {sorted(hosts)} to heartbeat",
            detail=lambda: f"still waiting for {sorted(pending)}",
        )
    finally:
        client.close()


def write_tiny_model(path: Path) -> Path:
    """A 4-layer random Llama checkpoint with a 90-word tokenizer and a chat template."""
    from tests.model.conftest import write_llama
    from tests.model.test_tokenizer import _write_tokenizer

    write_llama(path, "llama", seed=11)
    _write_tokenizer(path, 90)
    return path


def swarm_env(redis_url: str, swarm: str, key: str, **extra: str) -> dict[str, str]:
    """The environment a swarm process needs. It pins no coordinator key: these swarms run in
    the shared-key mode, which a process takes only when told to out loud."""
    return {
        **os.environ,
        "REDIS_URL": redis_url,
        "SPECPIPE_SWARM": swarm,
        "SPECPIPE_SWARM_KEY": key,
        "SPECPIPE_INSECURE_SHARED_KEY": "1",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


class Swarm:
    """Starts stage and coordinator processes; `stop` ends every one of them."""

    def __init__(self, redis_url: str, swarm: str, key: str, model: Path, **env: str) -> None:
        self.redis_url, self.swarm, self.key, self.model = redis_url, swarm, key, model
        self.env = swarm_env(redis_url, swarm, key, **env)
        self.procs: dict[str, subprocess.Popen] = {}
        self.argv: dict[str, list[str]] = {}
        self.logs: dict[str, Path | None] = {}

    def start_stage(self, host: str, layers: str, *extra: str) -> None:
        """Start `specpipe worker stage` for `host` (not waiting for it), with `extra` options."""
        argv = [
            *SPECPIPE,
            "worker",
            "stage",
            "--host",
            host,
            "--layers",
            layers,
            "--model",
            str(self.model),
            "--threads",
            "1",
            "--heartbeat-s",
            "0.5",
            *extra,
        ]
        self._start(host, argv)

    def start_coordinator(
        self, queue: str = "coordinator", name: str = "coordinator", log: Path | None = None
    ) -> None:
        """Start `specpipe worker coordinator` on `queue` (its output to `log` when given)."""
        argv = [*SPECPIPE, "worker", "coordinator", "--queue", queue, "--loglevel", "WARNING"]
        self._start(name, argv, log)

    def _start(self, name: str, argv: list[str], log: Path | None = None) -> None:
        self.argv[name], self.logs[name] = argv, log
        out = open(log, "a") if log else None  # noqa: SIM115 (the child keeps it open)
        self.procs[name] = subprocess.Popen(
            argv, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT if out else None
        )
        if out:
            out.close()

    def restart(self, name: str) -> None:
        """Start `name` again with the same arguments."""
        self._start(name, self.argv[name], self.logs[name])

    def kill9(self, name: str) -> None:
        """SIGKILL: no clean-up of any kind."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def wait_stages(self, hosts, timeout_s: float = 90.0) -> None:
        """Wait until each host has heartbeated since now."""
        wait_heartbeats(self.redis_url, self.swarm, self.key, self.procs, hosts, timeout_s)

    def stop(self) -> None:
        """SIGTERM everything still running, SIGKILL what does not stop."""
        terminate_all(self.procs.values())
