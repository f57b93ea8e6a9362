"""The multi-host lab: hosts in network namespaces of their own, each with its own Redis (one
behind TLS) and stage, jobs through them equal to the one-process run, and `lab down` leaving
nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace

import pytest
import redis

from specpipe.ops import certificates
from specpipe.ops.lab_hosts import Lab
from specpipe.settings import COORDINATOR_PUB_FILE, Settings
from specpipe.swarm import identity, inventory, streams, trust
from specpipe.swarm.dialing import Dialer, own_peering
from specpipe.swarm.redact import without_credentials
from tests.lab.conftest import need_lab, run

PROMPT = "hello world"


def generate(lab: Lab, tiny, *args: str) -> dict:
    result = run(
        "generate",
        PROMPT,
        "--model",
        str(tiny),
        "--json",
        "--max-new-tokens",
        "40",
        *args,
        env={
            "SPECPIPE_HOME": str(lab.home),
            "REDIS_URL": "",
            "SPECPIPE_SWARM": "",
            "SPECPIPE_SWARM_KEY": "",
            "DATABASE_URL": "",
        },
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_every_host_has_its_own_namespace_address_and_redis(lab):
    hosts = lab.hosts()
    assert [h.name for h in hosts] == ["h0", "h1", "h2"]
    assert len({h.namespace for h in hosts}) == len({h.address for h in hosts}) == 3
    assert [h.tls for h in hosts] == [False, True, False]
    assert hosts[1].redis_url.startswith("rediss://specpipe:")
    for host in hosts:  # each host's TLS folder, as `specpipe ca issue` makes it
        certificates.check_host_files(certificates.host_files(lab.tls_dir(host)), host.address)
    # Each Redis listens on its host's address only: not from another host's loopback.
    here = subprocess.run(
        ["ip", "netns", "exec", hosts[0].namespace, "ss", "-ltn"], capture_output=True, text=True
    ).stdout
    assert f"{hosts[0].address}:6379" in here and "127.0.0.1:6379" not in here


def test_what_other_hosts_hold_reaches_only_a_stages_stream_and_the_registrys_keys(
    lab, monkeypatch
):
    """Each host's own user's password is its own; another host (and the coordinator) dials a
    stage host's Redis as its own user there, with the password that pair derives, which takes
    a message for the stage and shows none, and which opens it as no other user; the
    swarm-wide peer user is gone. The other hosts reach the registry as its user for them."""
    hosts = lab.hosts()
    swarm = lab.state["swarm"]
    owner = hosts[1]  # a stage host (its Redis TLS only); host 0 runs the registry
    monkeypatch.setenv("SPECPIPE_INSECURE_CLEAR_PASSWORDS", "1")  # as the lab's processes do
    pin = (lab.home / COORDINATOR_PUB_FILE).read_text().strip()
    config = replace(Settings.from_env(), home=lab.home).for_swarm(
        hosts[0].redis_url, swarm, b"unused", coordinator_public_key=pin
    )
    admin = lab.admin_redis(hosts[0])
    roster, _ = identity.read_roster(admin, swarm, trust.keyring(config).coordinator)
    admin.close()
    address = without_credentials(owner.redis_url)
    stream = streams.stage_key(swarm, f"{owner.name}-probe")
    urls = {}
    for writer in (hosts[0].name, identity.COORDINATOR):
        dialer = replace(
            Dialer.configured([], None, str(lab.ca_cert()), own_peering(config, writer)),
            clear=True,
        )
        dialer.learn(roster, [(owner.name, address)])
        urls[writer] = dialer.url(address)
        assert f"//{writer}%40{swarm}:" in urls[writer]
        peer = redis.Redis.from_url(urls[writer], socket_timeout=10)
        try:
            streams.send(peer, stream, b"sealed elsewhere")
            for command in (("XRANGE", stream, "-", "+"), ("EVAL", "return 1", "0"), ("INFO",)):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    peer.execute_command(*command)
        finally:
            peer.close()
    # Each writer's password is its own: the coordinator's does not open the Redis as host 0.
    password = {w: url.split("//")[1].split("@")[0].split(":")[1] for w, url in urls.items()}
    assert password[hosts[0].name] != password[identity.COORDINATOR]
    swapped = urls[hosts[0].name].replace(password[hosts[0].name], password[identity.COORDINATOR])
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(swapped, socket_timeout=10).ping()
    own = redis.Redis.from_url(owner.redis_url, socket_timeout=10)
    try:
        assert own.xlen(stream) == 2
        own.delete(stream, streams.bell_key(stream))
    finally:
        own.close()
    keeper = lab.admin_redis(owner)
    users = {u.decode() for u in keeper.execute_command("ACL", "USERS")}
    keeper.close()
    writers = {f"{h}@{swarm}" for h in roster.sealing if h != owner.name}
    assert users == {"default", "specpipe", "specpipe-keeper", "lab-admin"} | writers | {
        f"{identity.COORDINATOR}@{swarm}"
    }
    # The registry: no password handed out; each host reaches it as its own user, with a
    # password it derives, that writes its own record only.
    registry = lab.env(hosts[1])["SPECPIPE_REGISTRY_URL"]
    assert "@" not in registry and f"//{hosts[0].address}:" in registry
    assert lab.env(hosts[0])["SPECPIPE_REGISTRY_URL"] == hosts[0].redis_url
    config = replace(Settings.from_env(), home=lab.home).for_swarm(
        registry, lab.state["swarm"], b"unused", coordinator_public_key=pin
    )
    urls = {h.name: trust.registry_url(config, h.name, registry) for h in hosts[:2]}
    assert len(set(urls.values())) == 2
    h1 = redis.Redis.from_url(urls["h1"], socket_timeout=10)
    try:
        assert h1.get(inventory.node_key(lab.state["swarm"], "h1"))  # its record, as it beats
        with pytest.raises(redis.exceptions.NoPermissionError):
            h1.set(inventory.node_key(lab.state["swarm"], "h0"), "forged")
    finally:
        h1.close()


@pytest.mark.parametrize(
    "kw",
    [["--temp", "0"], ["--temp", "0.8", "--seed", "7"]],
    ids=["greedy", "sampled"],
)
def test_a_job_through_the_lab_equals_the_one_process_run(lab, tiny, kw):
    local = generate(lab, tiny, "--local", "--stages", "2", "--no-spec", *kw)
    spec = generate(lab, tiny, *kw)
    plain = generate(lab, tiny, "--no-spec", *kw)
    assert spec["tokens"] == plain["tokens"] == local["tokens"]
    assert len(local["tokens"]) > 10


def test_lab_down_leaves_no_namespace_link_or_process(tiny, tmp_path):
    need_lab()
    home = tmp_path / "lab"
    up = run(
        "lab", "up", "--hosts", "1", "--model", str(tiny), "--port", "8001", "--home", str(home)
    )
    lab = Lab(home)
    state = lab.load()
    try:
        assert up.exit_code == 0, up.output
        assert state["processes"] and all(alive(pid) for pid in state["processes"].values())
        os.kill(state["processes"]["h0-coordinator"], 9)  # a crash leaves things half up
    finally:
        down = run("lab", "down", "--home", str(home))
    assert down.exit_code == 0, down.output
    assert not set(state["namespaces"]) & set(netns())
    assert not [name for name in links() if name.startswith(state["bridge"])]
    assert not [pid for pid in state["processes"].values() if alive(pid)]
    assert run("lab", "down", "--home", str(home)).output.strip() == "lab down: no lab here"


def test_the_lab_says_in_one_line_that_it_needs_root(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    result = run("lab", "up", "--hosts", "2", "--home", str(tmp_path / "lab"))
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: the lab needs root: network namespaces cannot be made otherwise"
    ]
    assert not (tmp_path / "lab").exists()


def netns() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


def links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
