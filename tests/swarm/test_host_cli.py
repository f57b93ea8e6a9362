"""`specpipe host`: the coordinator's key, a host's own key, and admitting and revoking hosts."""

from __future__ import annotations

import stat

import click
import pytest
import redis
from click.testing import CliRunner

from specpipe.cli import cli
from specpipe.swarm import identity


@pytest.fixture
def env(tmp_path, redis_url, swarm) -> dict[str, str]:
    return {
        "SPECPIPE_HOME": str(tmp_path / "instance"),
        "REDIS_URL": redis_url,
        "SPECPIPE_SWARM": swarm,
    }


def host(*args: str, env: dict[str, str]):
    return CliRunner().invoke(cli, ["host", *args], env=env)


def test_admitting_and_revoking_hosts_publishes_a_roster_only_the_coordinator_signed(
    env, tmp_path, redis_url, swarm
):
    home = tmp_path / "instance"
    refused = host("admit", "mn", "ab" * 32, env=env)
    assert refused.exit_code == 1
    assert refused.output.strip().startswith("Error: no coordinator key at")
    assert "specpipe host init" in refused.output

    made = host("init", env=env)
    assert made.exit_code == 0, made.output
    public = made.output.strip().splitlines()[-1]
    assert (home / "coordinator.pub").read_text().strip() == public
    assert stat.S_IMODE((home / "coordinator_key").stat().st_mode) == 0o600
    assert host("init", env=env).output.strip().splitlines()[-1] == public  # made once

    printed = host("key", "--host", "mn", env=env).output.strip()
    key, sealing = printed.split()  # the signing key, the sealing key
    assert len(key) == len(sealing) == 64 and bytes.fromhex(key) and bytes.fromhex(sealing)
    for name in ("mn.key", "mn.sealing"):
        assert stat.S_IMODE((home / "host_keys" / name).stat().st_mode) == 0o600
    assert host("key", "--host", "mn", env=env).output.strip() == printed  # the same keys again

    for bad in (["nj", "not a key"], ["coordinator", key], ["", key], ["mn", key, "not a key"]):
        result = host("admit", *bad, env=env)
        assert result.exit_code == 1 and result.output.startswith("Error: "), result.output
        assert len(result.output.strip().splitlines()) == 1
    assert host("admit", "mn", key, sealing, env=env).output.strip() == "admitted mn"
    listed = host("list", env=env).output.splitlines()
    # Every admitted host has a sealing key: the first data key epoch is made.
    assert listed == [
        f"roster of swarm {swarm!r}, version 1, data key epoch 1",
        f"mn  {key} {sealing}",
    ]

    client = redis.Redis.from_url(redis_url)
    try:
        pin = identity.pinned(public)[0]
        roster, believed = identity.read_roster(client, swarm, pin)
        assert believed and roster.hosts == {"mn": key} and roster.sealing == {"mn": sealing}
        assert set(roster.epoch.copies) == {"coordinator", "mn"}
        revoked = host("revoke", "nj", env=env)
        assert revoked.exit_code == 1 and "'nj' is not admitted" in revoked.output
        assert host("revoke", "mn", env=env).output.strip() == "revoked mn"
        roster, believed = identity.read_roster(client, swarm, pin)
        assert believed and roster.version == 2 and roster.hosts == {}
        assert roster.epoch.number == 2 and set(roster.epoch.copies) == {"coordinator"}
        assert set(roster.previous.copies) == {"coordinator"}  # mn's copy is gone
        # Data keys seal now: a host needs its sealing key to be admitted.
        unsealed = host("admit", "mn", key, env=env)
        assert unsealed.exit_code == 1 and "admit mn with both keys" in unsealed.output
        assert host("rotate", env=env).output.strip() == "data key epoch 3"
        # A Redis that lost the roster gets host 0's copy back with the next change.
        client.delete(identity.roster_key(swarm))
        assert host("admit", "mn", key, sealing, env=env).exit_code == 0
        assert identity.read_roster(client, swarm, pin)[0].version == 4
    finally:
        client.delete(identity.roster_key(swarm))
        client.close()


def test_a_host_name_that_cannot_name_a_file_is_one_line(env):
    result = host("key", "--host", "../etc/passwd", env=env)
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: host name '../etc/passwd' must be letters, digits, '.', '_', ':' or '-'"
    ]


def test_up_says_in_one_line_when_its_roster_file_cannot_be_read(
    tmp_path, monkeypatch, redis_url, swarm
):
    from specpipe.cli.up import _admit_own_hosts

    home = tmp_path / "instance"
    monkeypatch.setenv("SPECPIPE_HOME", str(home))
    assert _admit_own_hosts("redis://127.0.0.1:1/0", swarm, ["a"]) is False  # not up yet
    assert _admit_own_hosts(redis_url, swarm, ["a"])  # keys made, a admitted
    (home / "rosters" / swarm).write_text("not a roster\n")
    with pytest.raises(click.ClickException) as refused:
        _admit_own_hosts(redis_url, swarm, ["a"])
    assert refused.value.message == "cannot admit the stages' keys: the roster is not signed"
    redis.Redis.from_url(redis_url).delete(identity.roster_key(swarm))


def test_an_invitation_is_printed_on_one_line_and_revoking_the_name_withdraws_it(env):
    from specpipe.ops import invitations

    assert host("invite", "mn", env=env).output.strip().startswith("Error: no swarm CA in")
    assert CliRunner().invoke(cli, ["ca", "init"], env=env).exit_code == 0
    assert host("invite", "mn", env=env).output.strip().startswith("Error: no coordinator key")
    assert host("init", env=env).exit_code == 0
    for bad in (["--layers", "4:2"], ["--expires", "soon"]):
        refused = host("invite", "mn", *bad, env=env)
        assert refused.exit_code == 2 and "Invalid value" in refused.output
    invited = host("invite", "mn", "--layers", "2:4", "--expires", "30m", env=env)
    assert invited.exit_code == 0, invited.output
    line = invited.output.strip()
    invitation = invitations.parse(line)
    assert invitation.host == "mn" and invitation.swarm == env["SPECPIPE_SWARM"]
    client = redis.Redis.from_url(env["REDIS_URL"])
    assert client.hexists(invitations.invitations_key(invitation.swarm), "mn")
    withdrawn = host("revoke", "mn", env=env)
    assert withdrawn.exit_code == 0, withdrawn.output
    assert withdrawn.output.strip() == "withdrew the invitation of mn"  # it was never admitted
    assert not client.hexists(invitations.invitations_key(invitation.swarm), "mn")
    users = {u.decode() for u in client.execute_command("ACL", "USERS")}
    assert invitations.user(invitation.swarm, "mn") not in users
    client.close()
    assert host("revoke", "mn", env=env).output.strip() == "Error: 'mn' is not admitted"
