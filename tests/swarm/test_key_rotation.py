"""A key rotation ends old keys: it never moves a deadline later, `--revoke` ends them at once,
`NEW,OLD@UNTIL` in the environment expires OLD, and a running stage process refuses a key once
it has ended."""

from __future__ import annotations

import subprocess
import time

import pytest
import redis
from click.testing import CliRunner

from specpipe import settings
from specpipe.cli import cli
from specpipe.swarm import inventory, streams, wire
from tests.swarm.test_redis_ring import caught_up, stats, two_heartbeats_later
from tests.swarmprocs import ROOT, SPECPIPE, Swarm, write_tiny_model
from tests.waiting import wait_until

RESET = {"temp": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}


@pytest.fixture
def key_file(tmp_path, monkeypatch):
    """An instance folder whose key file holds one signing key."""
    monkeypatch.setenv("SPECPIPE_HOME", str(tmp_path))
    monkeypatch.delenv("SPECPIPE_SWARM_KEY", raising=False)
    monkeypatch.delenv("SPECPIPE_SWARM_KEY_FILE", raising=False)
    path = tmp_path / settings.SWARM_KEY_FILE
    settings.write_private(path, "leaked\n")
    return path


def deadlines(path) -> dict[str, int]:
    """Each old key of a key file with its deadline."""
    lines = [line.split() for line in path.read_text().splitlines()[1:]]
    return {key: int(until) for key, until in lines}


def rotate(*args: str) -> str:
    result = CliRunner().invoke(cli, ["key", "rotate", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_rotating_again_never_gives_an_old_key_longer(key_file):
    rotate("--grace-s", "60")
    first = deadlines(key_file)["leaked"]
    assert time.time() + 55 < first <= time.time() + 60
    rotate("--grace-s", "3600")
    rotate("--grace-s", "3600")
    assert deadlines(key_file)["leaked"] == first  # on main: re-dated to now + 3600
    later = deadlines(key_file)
    assert len(later) == 3 and max(later.values()) > first  # the newer keys got the grace


def test_a_shorter_grace_brings_every_deadline_in(key_file):
    rotate("--grace-s", "3600")
    rotate("--grace-s", "5")
    assert all(until <= time.time() + 5 for until in deadlines(key_file).values())


def test_revoke_ends_every_old_key_at_once(key_file):
    rotate("--grace-s", "3600")
    output = rotate("--revoke")
    assert "no old key is accepted" in output
    (signing,) = settings.swarm_keys()
    assert key_file.read_text() == signing + "\n" and signing != "leaked"
    assert key_file.stat().st_mode & 0o777 == 0o600


def test_revoke_with_a_grace_is_refused_and_changes_nothing(key_file):
    result = CliRunner().invoke(cli, ["key", "rotate", "--revoke", "--grace-s", "60"])
    assert result.exit_code == 2 and "--revoke keeps no old key" in result.output
    assert key_file.read_text() == "leaked\n"


def test_rotate_writes_the_key_file_processes_read(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPIPE_HOME", str(tmp_path / "instance"))
    monkeypatch.delenv("SPECPIPE_SWARM_KEY", raising=False)
    path = tmp_path / "etc" / "swarm_key"
    settings.write_private(path, "old\n")
    monkeypatch.setenv("SPECPIPE_SWARM_KEY_FILE", str(path))
    rotate()
    assert settings.swarm_keys()[1:] == ("old",) and len(path.read_text().splitlines()) == 2


@pytest.mark.parametrize(
    ("value", "accepted"),
    [
        ("NEW,OLD", ("NEW", "OLD")),
        ("NEW,OLD@{past}", ("NEW",)),
        ("NEW,OLD@{future}", ("NEW", "OLD")),
        ("NEW,OLD@2001-01-01", ("NEW",)),
        ("NEW,OLD@2999-01-01T00:00Z", ("NEW", "OLD")),
        ("NEW, OLD@{past} ,OTHER@2999-01-01T00:00:00+02:00", ("NEW", "OTHER")),
    ],
    ids=["no-expiry", "unix-past", "unix-future", "iso-past", "iso-future", "mixed"],
)
def test_old_keys_in_the_environment_expire(monkeypatch, value, accepted):
    now = int(time.time())
    monkeypatch.setenv("SPECPIPE_SWARM_KEY", value.format(past=now - 1, future=now + 60))
    assert settings.swarm_keys() == accepted


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("sekrit@1,other", "the first key signs and takes no @expiry"),
        ("other,sekrit@soon", "old key 1 ends at 'soon', which is neither a Unix time nor an ISO"),
    ],
    ids=["signing-key", "unreadable"],
)
def test_an_unreadable_expiry_is_one_line_without_the_keys(monkeypatch, value, reason):
    monkeypatch.setenv("SPECPIPE_SWARM_KEY", value)
    result = CliRunner().invoke(cli, ["nodes"])
    assert result.exit_code == 1 and reason in result.output
    assert result.output.count("\n") == 1 and "sekrit" not in result.output


def send_reset(url: str, swarm: str, host: str, key: str, session: str) -> None:
    """A coordinator's reset for `session`, signed with `key`, into `host`'s stream."""
    message = wire.Message(
        kind="reset",
        session=session,
        params=RESET,
        to=streams.stage_key(swarm, host),
        sender=wire.COORDINATOR,
        seq=wire.next_seq(0),
    )
    client = redis.Redis.from_url(url)
    try:
        streams.send(client, message.to, wire.encode(message, swarm, key))
    finally:
        client.close()


def dropped_after(url: str, swarm: str, host: str, key: str, *sent: tuple[str, str]) -> float:
    """The stage's `dropped` count once it has handled the resets `sent` ((key, session) each)
    and flushed its counters (its records signed with `key`)."""
    for signing, session in sent:
        send_reset(url, swarm, host, signing, session)
    client = redis.Redis.from_url(url)
    try:
        wait_until(lambda: caught_up(client, swarm, host), 30, f"{host} to read its stream")
    finally:
        client.close()
    two_heartbeats_later(url, swarm, key.encode(), host)
    return stats(url, swarm, host).get("dropped", 0)


def signs_with(url: str, swarm: str, key: str) -> bool:
    client = redis.Redis.from_url(url)
    try:
        return bool(inventory.load(client, swarm, key))
    finally:
        client.close()


@pytest.fixture
def tiny_model(tmp_path):
    return write_tiny_model(tmp_path / "tiny")


def test_a_running_stage_refuses_a_revoked_key(tmp_path, tiny_model, redis_url, swarm):
    """`specpipe key rotate --revoke` on the stage's host: within a heartbeat the stage process
    signs with the new key and drops what the old one signs."""
    home = tmp_path / "home"
    settings.write_private(home / settings.SWARM_KEY_FILE, "leaked-key\n")
    procs = Swarm(redis_url, swarm, "", tiny_model, SPECPIPE_HOME=str(home))
    procs.key = "leaked-key"
    try:
        procs.start_stage("s0", "0:4")
        procs.wait_stages(["s0"])
        assert dropped_after(redis_url, swarm, "s0", "leaked-key", ("leaked-key", "a")) == 0
        subprocess.run(
            [*SPECPIPE, "key", "rotate", "--revoke"], cwd=ROOT, env=procs.env, check=True
        )
        new = (home / settings.SWARM_KEY_FILE).read_text().strip()
        wait_until(lambda: signs_with(redis_url, swarm, new), 10, "s0 to sign with the new key")
        sent = (("leaked-key", "b"), (new, "c"))
        assert dropped_after(redis_url, swarm, "s0", new, *sent) == 1  # on main: 0
    finally:
        procs.stop()


def test_a_running_stage_refuses_an_old_key_once_it_expires(tiny_model, redis_url, swarm):
    """`SPECPIPE_SWARM_KEY=NEW,OLD@UNTIL`: the stage accepts OLD until UNTIL, then drops it."""
    until = int(time.time()) + 20
    procs = Swarm(redis_url, swarm, f"new-key,old-key@{until}", tiny_model)
    procs.key = "new-key"
    try:
        procs.start_stage("s0", "0:4")
        procs.wait_stages(["s0"])
        assert time.time() < until - 1, "the stage took too long to start for this test"
        assert dropped_after(redis_url, swarm, "s0", "new-key", ("old-key", "a")) == 0
        wait_until(lambda: time.time() > until + 1, 30, "the old key's deadline")
        assert dropped_after(redis_url, swarm, "s0", "new-key", ("old-key", "b")) == 1
    finally:
        procs.stop()
