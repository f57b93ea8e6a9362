"""Host identities fail closed: a process that uses the swarm's keys and pins no coordinator key
refuses to start, in one line saying how to pin it, unless the operator opts out out loud
(`SPECPIPE_INSECURE_SHARED_KEY=1`), and then it starts, warning of what that means."""

from __future__ import annotations

import logging
import subprocess
import uuid

import pytest
import redis
from click.testing import CliRunner

from specpipe.cli import cli
from specpipe.ops import roster
from specpipe.settings import Settings
from specpipe.swarm import identity, inventory, trust
from tests.swarmprocs import ROOT, SPECPIPE, swarm_env
from tests.waiting import wait_until

KEY = "k" * 32
SHARED_KEY_WARNING = "WARNING specpipe.trust this host pins no coordinator key (SPECPIPE_INSECURE"


def refusal(home) -> str:
    return (
        f"Error: this host pins no coordinator key: copy host 0's coordinator.pub into "
        f"{home / 'tls'} or {home} (`specpipe host init` on host 0 makes it), or set "
        "SPECPIPE_INSECURE_SHARED_KEY=1 to trust every holder of the swarm key alike"
    )


@pytest.fixture
def unpinned(monkeypatch, tmp_path, swarm, redis_url):
    """A host with the swarm key and a live Redis, pinning no coordinator key, not opted out."""
    home = tmp_path / "home"
    monkeypatch.setenv("SPECPIPE_HOME", str(home))
    monkeypatch.setenv("SPECPIPE_SWARM", swarm)
    monkeypatch.setenv("SPECPIPE_SWARM_KEY", KEY)
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("DATABASE_URL", f"sqlite:///{tmp_path / 'store.sqlite3'}")
    for name in ("SPECPIPE_INSECURE_SHARED_KEY", "SPECPIPE_COORDINATOR_PUB", "SPECPIPE_TLS_DIR"):
        monkeypatch.delenv(name, raising=False)
    return home


@pytest.fixture
def no_celery(monkeypatch):
    """A Celery worker or beat that would start here fails the test instead of serving."""
    from workers.celery_app import celery

    def started(*args, **kwargs):
        raise AssertionError(f"started {args}")

    monkeypatch.setattr(celery, "worker_main", started)
    monkeypatch.setattr(celery, "start", started)


COMMANDS = {
    "stage": ["worker", "stage", "--host", "h", "--layers", "0:2"],
    "coordinator": ["worker", "coordinator"],
    "nightly": ["worker", "nightly"],
    "beat": ["worker", "beat"],
    "nodes": ["nodes"],
    "generate": ["generate", "hi"],
}


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_without_a_pin_each_process_refuses_in_one_line_and_starts_nothing(
    unpinned, no_celery, swarm, redis_url, command
):
    result = CliRunner().invoke(cli, command)
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [refusal(unpinned)]
    assert not (unpinned / "host_keys").exists()  # no key made for a host
    client = redis.Redis.from_url(redis_url)
    try:
        assert not list(client.scan_iter(f"specpipe:{swarm}:*"))  # nothing registered or sent
    finally:
        client.close()


def test_a_coordinator_without_its_key_on_a_pinned_host_refuses_in_one_line(
    unpinned, no_celery, monkeypatch, tmp_path
):
    host0 = roster.init_coordinator(tmp_path / "host0")  # the key stays on host 0
    monkeypatch.setenv("SPECPIPE_COORDINATOR_PUB", host0.public_hex)
    result = CliRunner().invoke(cli, ["worker", "coordinator"])
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert line.startswith("Error: this host pins a coordinator key but holds none at ")


def test_the_rule_is_the_keyrings_and_the_opt_out_is_the_settings(tmp_path, swarm, redis_url):
    settings = Settings.from_env().for_swarm(redis_url, swarm, KEY)
    with pytest.raises(identity.IdentityError, match="pins no coordinator key"):
        trust.keyring(settings)
    with pytest.raises(identity.IdentityError, match="pins no coordinator key"):
        trust.keyring(settings, "a-host")
    shared = Settings.from_env().for_swarm(redis_url, swarm, KEY, insecure_shared_key=True)
    keys = trust.keyring(shared, "a-host")
    assert keys.coordinator is None and keys.signer is None  # every key holder alike
    pin = roster.init_coordinator(tmp_path).public_hex
    pinned = Settings.from_env().for_swarm(redis_url, swarm, KEY, coordinator_public_key=pin)
    assert trust.keyring(pinned).coordinator is not None


def test_an_instance_folder_without_its_pin_gives_no_keyring(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECPIPE_INSECURE_SHARED_KEY", raising=False)
    (tmp_path / "swarm_key").write_text(KEY + "\n")
    with pytest.raises(identity.IdentityError, match="pins no coordinator key"):
        trust.home_keyring(tmp_path)
    roster.init_coordinator(tmp_path)
    assert trust.home_keyring(tmp_path).coordinator is not None


def test_with_the_opt_out_a_coordinator_starts_and_warns_once_at_start(tmp_path, redis_url, swarm):
    queue = f"fail-closed-{uuid.uuid4().hex[:8]}"
    env = swarm_env(redis_url, swarm, KEY, SPECPIPE_HOME=str(tmp_path))
    assert env["SPECPIPE_INSECURE_SHARED_KEY"] == "1"
    log_path = tmp_path / "coordinator.log"
    argv = [*SPECPIPE, "worker", "coordinator", "--queue", queue, "--loglevel", "INFO"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(
            lambda: proc.poll() is None and " ready." in log_path.read_text(),
            90,
            "the coordinator to be ready",
            detail=lambda: log_path.read_text()[-2000:],
        )
    finally:
        proc.terminate()
        proc.wait(30)
    said = log_path.read_text()
    [warning] = [line for line in said.splitlines() if SHARED_KEY_WARNING in line]
    assert "can speak here as the coordinator or as any host" in warning
    assert said.index(warning) < said.index(" ready.")


def test_with_the_opt_out_nodes_reads_the_inventory_and_warns(
    unpinned, monkeypatch, swarm, redis_url, caplog
):
    client = redis.Redis.from_url(redis_url)
    inventory.publish(client, swarm, inventory.NodeInfo("wa", 0, 2, redis_url), KEY)
    client.close()
    monkeypatch.setattr(trust, "_warned", False)  # the warning is once per process: this test's
    monkeypatch.setenv("SPECPIPE_INSECURE_SHARED_KEY", "1")
    with caplog.at_level(logging.WARNING):
        result = CliRunner().invoke(cli, ["nodes", "--json"])
    assert result.exit_code == 0, result.output
    assert '"host": "wa"' in result.stdout
    [warning] = [r.getMessage() for r in caplog.records if r.name == "specpipe.trust"]
    assert "every holder of the swarm key can speak here as the coordinator" in warning
