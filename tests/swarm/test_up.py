"""`specpipe up` on a fresh instance folder: the whole swarm as child processes, a job through
it, a stage that dies and comes back, and nothing left behind after SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import urllib.request

import psutil
import pytest
import redis
from click.testing import CliRunner
from redis.backoff import NoBackoff
from redis.retry import Retry

from specpipe.cli import cli
from specpipe.ops import redis_server
from specpipe.ops.redis_server import free_port
from specpipe.swarm import inventory, trust
from tests.swarmprocs import ROOT, SPECPIPE, write_tiny_model
from tests.waiting import wait_until

CLEARED = (
    "REDIS_URL",
    "DATABASE_URL",
    "SPECPIPE_SWARM_KEY",
    "SECRET_KEY",
    "SPECPIPE_SWARM",
    "SPECPIPE_MODEL",
    "SPECPIPE_REDIS_PASSWORD",
    # Its processes pin its own coordinator key: none comes from outside, nor the opt-out.
    "SPECPIPE_COORDINATOR_PUB",
    "SPECPIPE_INSECURE_SHARED_KEY",
)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "healthz", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def online_hosts(redis_url: str, swarm: str, home) -> set[str]:
    """The online stages of the swarm `specpipe up` runs from `home`, as its keys verify them."""
    client = redis.Redis.from_url(redis_url)
    keys = trust.home_keyring(home)
    try:
        return {n.host for n in inventory.load(client, swarm, keys) if n.status() == "online"}
    finally:
        client.close()


def recorded_pid(home, role: str) -> int | None:
    """The pid `processes.json` gives `role`; None while it is restarting (or not yet there)."""
    return json.loads((home / "processes.json").read_text()).get(role)


def stage_pids(up: psutil.Process) -> dict[str, int]:
    pids = {}
    for child in up.children(recursive=True):
        try:
            argv = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "stage" in argv and "--host" in argv:
            pids[argv[argv.index("--host") + 1]] = child.pid
    return pids


def redis_server_pid(up: psutil.Process) -> int | None:
    for child in up.children(recursive=True):
        try:
            if "redis-server" in " ".join(child.cmdline()):
                return child.pid
        except psutil.NoSuchProcess:
            continue
    return None


@pytest.mark.slow
def test_up_runs_a_job_restarts_a_dead_stage_and_leaves_nothing(tmp_path, monkeypatch):
    tiny = write_tiny_model(tmp_path / "tiny")
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(SPECPIPE_HOME=str(home), OMP_NUM_THREADS="1")
    port = free_port()
    log = open(tmp_path / "up.log", "w")
    proc = subprocess.Popen(
        [
            *SPECPIPE,
            "up",
            "--stages",
            "2",
            "--model",
            str(tiny),
            "--port",
            str(port),
            "--status-every",
            "0",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    up = psutil.Process(proc.pid)
    try:
        state_file = home / "swarm.json"
        state = wait_until(
            lambda: state_file.is_file() and json.loads(state_file.read_text()),
            60,
            "the swarm's state file",
            interval_s=0.2,
        )
        assert state["pid"] == proc.pid and state["web_url"] == f"http://127.0.0.1:{port}/"
        assert state["redis_url"] != "redis://127.0.0.1:6379/0"  # a private Redis of its own
        secrets = ("swarm_key", "secret_key", "redis_password", "redis_local_password")
        for name in ("swarm.json", *secrets):
            assert stat.S_IMODE((home / name).stat().st_mode) == 0o600, name
        swarm_key = (home / "swarm_key").read_text().strip()
        # Its processes reach it as its own user; the data-plane password is the peer user's.
        password = (home / "redis_local_password").read_text().strip()
        data_password = (home / "redis_password").read_text().strip()
        assert state["redis_url"].startswith(f"redis://specpipe:{password}@127.0.0.1:")
        assert data_password != password
        wait_until(
            lambda: healthy(state["web_url"]), 90, "the web app to be healthy", interval_s=0.2
        )
        wait_until(
            lambda: len(online_hosts(state["redis_url"], state["swarm"], home)) == 2,
            90,
            "both stages to come online",
            interval_s=0.2,
        )
        # It says which process is which: each child's pid by the name it started it under,
        # and each stage's host and layers.
        recorded = json.loads((home / "processes.json").read_text())
        roles = {"redis", "stage0", "stage1", "coordinator", "nightly", "beat", "web"}
        assert set(recorded) == roles
        assert set(recorded.values()) <= {child.pid for child in up.children()}
        assert {recorded[f"stage{i}"] for i in range(2)} == set(stage_pids(up).values())
        assert sorted(n["layers"] for n in state["stage_nodes"].values()) == [[0, 2], [2, 4]]
        assert {n["host"] for n in state["stage_nodes"].values()} == set(stage_pids(up))
        # Its Redis refuses whoever has not the password.
        port_of_redis = redis.connection.parse_url(state["redis_url"])["port"]
        once = {"port": port_of_redis, "retry": Retry(NoBackoff(), 0)}
        for anonymous in (
            redis.Redis(**once),
            redis.Redis(username="specpipe", password="x", **once),
            redis.Redis(username="specpipe", password=data_password, **once),
        ):
            with pytest.raises(redis.AuthenticationError):
                anonymous.ping()
        # The data-plane password reaches a stage's stream to send to, and nothing else.
        peer = redis.Redis(username="specpipe-peer", password=data_password, **once)
        assert peer.ping()
        for command in (("KEYS", "*"), ("XRANGE", f"specpipe:{state['swarm']}:stage:x", "-", "+")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                peer.execute_command(*command)
        peer.close()
        # And the swarm's own user cannot reconfigure, list, empty or stop it.
        swarm_user = redis.Redis.from_url(state["redis_url"])
        for command in (
            ("CONFIG", "SET", "maxmemory", "0"),
            ("KEYS", "*"),
            ("FLUSHALL",),
            ("SHUTDOWN", "NOSAVE"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                swarm_user.execute_command(*command)
        swarm_user.close()
        client = redis.Redis.from_url(state["redis_url"])
        # Host identities: the stages sign as themselves, the coordinator pins its own key, and
        # so does every child (without a pin none would have started).
        keys = trust.home_keyring(home)
        assert keys.coordinator is not None
        pin = (home / "coordinator.pub").read_text().strip()
        for child in up.children():
            if "redis-server" not in " ".join(child.cmdline()):
                environ = child.environ()
                assert environ.get("SPECPIPE_COORDINATOR_PUB") == pin, child.cmdline()
                assert "SPECPIPE_INSECURE_SHARED_KEY" not in environ
        nodes = inventory.load(client, state["swarm"], keys)
        for name in ("coordinator_key", f"rosters/{state['swarm']}"):
            assert stat.S_IMODE((home / name).stat().st_mode) == 0o600, name
        # Each record is signed by its host's own key: the swarm key alone verifies none.
        assert inventory.read(client, state["swarm"], swarm_key).ignored == len(nodes) == 2
        for node in nodes:
            key_file = home / "host_keys" / f"{node.host}.key"
            assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        client.close()
        assert all(n.redis_url.startswith("unix://") for n in nodes)  # streams on the socket
        # The passwords are on no command line, and in no record `specpipe nodes` shows.
        lines = [" ".join(p.cmdline()) for p in up.children(recursive=True)]
        assert not [line for line in lines if password in line or data_password in line]
        shown = subprocess.run(
            [*SPECPIPE, "nodes"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
        )
        assert shown.returncode == 0 and "unix:///" in shown.stdout, shown.stderr
        assert password not in shown.stdout + shown.stderr
        assert data_password not in shown.stdout + shown.stderr

        # Another shell: only SPECPIPE_HOME, and `generate` finds the swarm.
        for key in CLEARED:
            monkeypatch.delenv(key, raising=False)
        monkeypatch.setenv("SPECPIPE_HOME", str(home))
        args = [
            "--model",
            str(tiny),
            "--max-new-tokens",
            "24",
            "--temp",
            "0.9",
            "--seed",
            "4",
            "--json",
        ]
        want = json.loads(CliRunner().invoke(cli, ["generate", "hello", "--local", *args]).output)
        first = subprocess.run(
            [*SPECPIPE, "generate", "hello", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert first.returncode == 0, first.stderr
        assert json.loads(first.stdout)["tokens"] == want["tokens"] and want["tokens"]

        # A stage that dies is started again and serves the next job.
        before = stage_pids(up)
        assert len(before) == 2
        host, pid = sorted(before.items())[-1]
        os.kill(pid, signal.SIGKILL)
        wait_until(
            lambda: stage_pids(up).get(host, pid) != pid,
            30,
            f"stage {host} to restart",
            interval_s=0.2,
        )
        role = next(r for r, n in state["stage_nodes"].items() if n["host"] == host)
        wait_until(
            lambda: (
                recorded_pid(home, role) not in (None, pid)
                and recorded_pid(home, role) == stage_pids(up).get(host)
            ),
            10,
            f"the restarted {role}'s pid on record",
            interval_s=0.2,
        )
        again = subprocess.run(
            [*SPECPIPE, "generate", "hello", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["tokens"] == want["tokens"]

        # So is a Redis that dies, on the same port with the same data, and every process
        # finds it again by itself.
        redis_pid = redis_server_pid(up)
        os.kill(redis_pid, signal.SIGKILL)
        wait_until(lambda: redis_server_pid(up) not in (None, redis_pid), 30, "Redis to restart")
        third = subprocess.run(
            [*SPECPIPE, "generate", "hello", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert third.returncode == 0, third.stderr
        assert json.loads(third.stdout)["tokens"] == want["tokens"]
        assert (home / "redis").is_dir() and any((home / "redis").rglob("*.aof*"))

        children = up.children(recursive=True)
        assert len(children) >= 7  # 2 stages, coordinator, nightly, beat, web, Redis
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert alive == [], [p.pid for p in alive]
        assert not (home / "swarm.json").exists() and not (home / "processes.json").exists()
        log.flush()
        output = (tmp_path / "up.log").read_text()
        assert password not in output and "Redis redis://specpipe:***@127.0.0.1:" in output
        build = redis_server.describe(redis_server.find_binary())
        assert f"specpipe up: runs {build} on loopback" in output  # which Redis, at the start
        assert data_password not in output
        assert "no permissions" not in output  # the ACL let every process do its work
    finally:
        if proc.poll() is None:
            for child in up.children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()
        log.close()
        if proc.returncode not in (0, None):
            pytest.fail((tmp_path / "up.log").read_text()[-3000:])
