"""`specpipe worker …` refuses bad input with one line and changes nothing."""

from __future__ import annotations

import pytest
import redis
from click.testing import CliRunner

from specpipe import inventory
from specpipe.cli import cli
from specpipe.redis_server import free_port

DEAD = f"redis://127.0.0.1:{free_port()}/0"


@pytest.fixture
def clean_env(monkeypatch, tmp_path, swarm, redis_url):
    monkeypatch.setenv("SPECPIPE_HOME", str(tmp_path))  # no swarm key kept there
    monkeypatch.setenv("SPECPIPE_SWARM", swarm)
    monkeypatch.setenv("SPECPIPE_SWARM_KEY", "k" * 32)
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
)
def test_stage_bad_input_is_one_line(clean_env, swarm, redis_url, args, code, message):
    result = CliRunner().invoke(cli, ["worker", "stage", "--host", "h", *args])
    assert result.exit_code == code, result.output
    assert message in result.output and "Traceback" not in result.output
    client = redis.Redis.from_url(redis_url)
    assert inventory.load(client, swarm) == []  # it never registered
    client.close()


def test_stage_without_a_swarm_key(clean_env):
    clean_env.delenv("SPECPIPE_SWARM_KEY")
    result = CliRunner().invoke(cli, ["worker", "stage", "--host", "h", "--layers", "0:2"])
    assert result.exit_code == 1
    assert result.output.strip() == (
        "Error: no swarm key: set SPECPIPE_SWARM_KEY (or run `specpipe up`, which keeps one)"
    )


@pytest.mark.parametrize("command", ["coordinator", "beat"])
def test_coordinator_and_beat_need_their_broker(clean_env, command):
    clean_env.setenv("REDIS_URL", DEAD)
    result = CliRunner().invoke(cli, ["worker", command])
    assert result.exit_code == 1
    assert f"cannot reach the broker Redis at {DEAD}" in result.output
    assert len(result.output.strip().splitlines()) == 1
