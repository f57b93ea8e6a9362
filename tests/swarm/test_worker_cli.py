"""`specpipe worker …` refuses bad input with one line and changes nothing; a stage worker
records that it samples exactly, and one that pins no coordinator key says it runs in the
shared-key mode."""

from __future__ import annotations

import subprocess

import pytest
import redis
from click.testing import CliRunner

from specpipe.cli import cli
from specpipe.ops.redis_server import free_port
from specpipe.ops.supervisor import terminate_all
from specpipe.swarm import inventory
from tests.swarmprocs import ROOT, SPECPIPE, swarm_env, wait_heartbeats, write_tiny_model

DEAD = f"redis://127.0.0.1:{free_port()}/0"


@pytest.fixture
def clean_env(monkeypatch, tmp_path, swarm, redis_url):
    monkeypatch.setenv("SPECPIPE_HOME", str(tmp_path))  # no swarm key kept there
    monkeypatch.setenv("SPECPIPE_SWARM", swarm)
    monkeypatch.setenv("SPECPIPE_SWARM_KEY", "k" * 32)
    # What these tests try comes after the identity check: they run in the shared-key mode.
    monkeypatch.setenv("SPECPIPE_INSECURE_SHARED_KEY", "1")
    monkeypatch.setenv("REDIS_URL", redis_url)
    return monkeypatch


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--layers", "2:1"], 2, "'2:1' is empty or reversed"),
        (["--layers", "a:b"], 2, "'a:b' is not A:B"),
        (["--layers", "0:2", "--redis", DEAD], 1, f"cannot reach Redis at {DEAD}"),
        (["--layers", "0:2", "--model", "/nonexistent"], 2, "/nonexistent: no such file"),
        (["--layers", "0:99"], 2, "layer range [0, 99) is out of range (the model has 30)"),
    ],
    # Named, not numbered by their values: DEAD's port differs between test workers.
    ids=["reversed", "not-a-range", "dead-redis", "no-model", "out-of-range"],
)
def test_stage_bad_input_is_one_line(clean_env, swarm, redis_url, args, code, message):
    result = CliRunner().invoke(cli, ["worker", "stage", "--host", "h", *args])
    assert result.exit_code == code, result.output
    assert message in result.output and "Traceback" not in result.output
    client = redis.Redis.from_url(redis_url)
    assert inventory.load(client, swarm, "k" * 32) == []  # it never registered
    client.close()


def test_stage_without_a_swarm_key(clean_env):
    clean_env.delenv("SPECPIPE_SWARM_KEY")
    result = CliRunner().invoke(cli, ["worker", "stage", "--host", "h", "--layers", "0:2"])
    assert result.exit_code == 1
    assert result.output.strip() == (
        "Error: no swarm key: set SPECPIPE_SWARM_KEY (or run `specpipe up`, which keeps one)"
    )


def test_stage_with_a_bad_kv_budget_is_one_line(clean_env):
    clean_env.setenv("SPECPIPE_KV_BUDGET_TOKENS", "lots")
    result = CliRunner().invoke(cli, ["worker", "stage", "--host", "h", "--layers", "0:2"])
    assert result.exit_code == 1
    assert result.output.strip() == (
        "Error: SPECPIPE_KV_BUDGET_TOKENS must be an integer >= 1, got 'lots'"
    )


@pytest.mark.parametrize("command", ["coordinator", "nightly", "beat"])
def test_coordinator_and_beat_need_their_broker(clean_env, command):
    clean_env.setenv("REDIS_URL", DEAD)
    result = CliRunner().invoke(cli, ["worker", command])
    assert result.exit_code == 1
    assert f"cannot reach the broker Redis at {DEAD}" in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


def test_a_stage_samples_exactly_and_warns_of_the_shared_key_mode_at_start(tiny, swarm, redis_url):
    env = swarm_env(redis_url, swarm, "k" * 32)
    argv = [
        *SPECPIPE,
        "worker",
        "stage",
        "--host",
        "nj",
        "--layers",
        "0:4",
        "--model",
        str(tiny),
        "--threads",
        "1",
        "--heartbeat-s",
        "0.5",
    ]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_heartbeats(redis_url, swarm, "k" * 32, {"nj": proc}, ["nj"], timeout_s=90)
        client = redis.Redis.from_url(redis_url)
        [node] = inventory.load(client, swarm, "k" * 32)
        client.close()
    finally:
        terminate_all([proc], timeout_s=10)
    log = proc.stderr.read()
    proc.stderr.close()
    assert node.sampler == inventory.EXACT_SAMPLER
    # It pins no coordinator key, out loud: said once, at start (not at each key reload).
    [shared] = [line for line in log.splitlines() if "SPECPIPE_INSECURE_SHARED_KEY=1" in line]
    assert " WARNING specpipe.trust this host pins no coordinator key" in shared
    assert log.index(shared) < log.index("nj: serving")
    assert "NOT lossless" not in log
