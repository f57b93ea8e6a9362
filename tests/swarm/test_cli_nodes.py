"""`specpipe nodes` against a real Redis."""

import json

import pytest
import redis
from click.testing import CliRunner

from specpipe.cli import cli
from specpipe.ops.redis_server import free_port
from specpipe.swarm import inventory, streams
from specpipe.swarm.inventory import NodeInfo
from specpipe.swarm.redact import without_credentials


@pytest.fixture(autouse=True)
def swarm_key(monkeypatch, key):
    """`specpipe nodes` checks every record with the swarm key (the shared-key mode: these
    swarms pin no coordinator key, so the command runs only with the opt-out)."""
    monkeypatch.setenv("SPECPIPE_SWARM_KEY", key.decode())
    monkeypatch.setenv("SPECPIPE_INSECURE_SHARED_KEY", "1")


def test_nodes_prints_the_inventory_in_ring_order(swarm, redis_url, key):
    client = redis.Redis.from_url(redis_url)
    inventory.publish(client, swarm, NodeInfo("nj", 2, 4, redis_url, role="tail", geo="NJ"), key)
    inventory.publish(client, swarm, NodeInfo("wa", 0, 2, redis_url, role="stage0", geo="WA"), key)
    client.close()
    result = CliRunner().invoke(cli, ["nodes", "--redis", redis_url, "--swarm", swarm])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("HOST")
    assert lines[1].split()[:4] == ["wa", "stage0", "0:2", "online"]
    assert lines[2].split()[:4] == ["nj", "tail", "2:4", "online"]


def test_nodes_say_what_each_stage_keeps_of_ended_jobs(swarm, redis_url, key):
    client = redis.Redis.from_url(redis_url)
    inventory.publish(client, swarm, NodeInfo("wa", 0, 2, redis_url), key)
    inventory.publish(client, swarm, NodeInfo("nj", 2, 4, redis_url), key)
    kept = {"kept_prefixes": 2, "kept_tokens": 1234, "prefix_hits": 5, "prefix_misses": 1}
    client.hset(streams.stats_key(swarm, "nj"), mapping=kept)
    client.hset(streams.stats_key(swarm, "wa"), mapping={"processed": 3, "kept_prefixes": 0})
    client.close()
    result = CliRunner().invoke(cli, ["nodes", "--redis", redis_url, "--swarm", swarm])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    at = lines.index("kept prefixes:")
    assert lines[at + 1 :] == [
        "  nj: keeps 2 prefix(es), 1234 tokens; started from one 5 time(s), missed 1"
    ]


def test_nodes_with_an_empty_swarm(swarm, redis_url):
    result = CliRunner().invoke(cli, ["nodes", "--redis", redis_url, "--swarm", swarm])
    assert result.exit_code == 0 and f"no nodes in swarm '{swarm}'" in result.output


def test_nodes_errors_are_one_line(monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    result = CliRunner().invoke(cli, ["nodes"])
    assert result.exit_code == 1
    assert result.output.strip() == "Error: no swarm Redis: set REDIS_URL or pass --redis"
    dead = f"redis://127.0.0.1:{free_port()}/0"
    result = CliRunner().invoke(cli, ["nodes", "--redis", dead])
    assert result.exit_code == 1 and "cannot read the inventory" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_nodes_json_lists_records_status_and_stage_stats_in_ring_order(swarm, redis_url, key):
    client = redis.Redis.from_url(redis_url)
    inventory.publish(client, swarm, NodeInfo("nj", 2, 4, redis_url, geo="NJ"), key)
    inventory.publish(client, swarm, NodeInfo("wa", 0, 2, redis_url, geo="WA"), key)
    away = f"redis://127.0.0.1:{free_port()}/0"
    inventory.publish(client, swarm, NodeInfo("tx", 0, 2, away), key)  # its own Redis is down
    client.hset(streams.stats_key(swarm, "nj"), mapping={"processed": 7, "forward_ms": 1.5})
    client.close()
    result = CliRunner().invoke(cli, ["nodes", "--redis", redis_url, "--swarm", swarm, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["swarm"] == swarm and out["ignored_records"] == 0
    records = out["nodes"]
    assert [(r["host"], r["role"], r["status"]) for r in records] == [
        ("tx", "stage0", "online"),
        ("wa", "stage0", "online"),
        ("nj", "tail", "online"),
    ]
    assert records[2]["geo"] == "NJ" and records[2]["layer_end"] == 4
    assert records[2]["stats"] == {"processed": 7.0, "forward_ms": 1.5}
    assert records[1]["stats"] == {} and records[0]["stats"] is None


def test_nodes_json_of_an_empty_swarm_is_an_empty_list(swarm, redis_url):
    result = CliRunner().invoke(cli, ["nodes", "--redis", redis_url, "--swarm", swarm, "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {
        "swarm": swarm,
        "nodes": [],
        "ring": None,
        "host0_rtt_ms": {},
        "ignored_records": 0,
    }


def test_nodes_count_ignored_records_and_hide_passwords(swarm, redis_url, key):
    client = redis.Redis.from_url(redis_url)
    secret = "s3cr3t-password"
    own = f"unix://specpipe:{secret}@/run/specpipe/redis.sock?db=0"
    inventory.publish(client, swarm, NodeInfo("wa", 0, 2, without_credentials(own)), key)
    inventory.publish(client, swarm, NodeInfo("evil", 0, 4, redis_url), b"not the swarm key")
    client.set(inventory.node_key(swarm, "junk"), "{}")
    client.close()
    result = CliRunner().invoke(cli, ["nodes", "--redis", redis_url, "--swarm", swarm])
    assert result.exit_code == 0, result.output
    header, wa, note = result.output.splitlines()
    assert wa.split()[0] == "wa" and "unix:///run/specpipe/redis.sock" in wa
    assert note == inventory.ignored_note(2)
    assert note.startswith("2 inventory records ignored: unsigned, forged")
    result = CliRunner().invoke(cli, ["nodes", "--redis", redis_url, "--swarm", swarm, "--json"])
    out = json.loads(result.stdout)
    assert [n["host"] for n in out["nodes"]] == ["wa"] and out["ignored_records"] == 2
    assert secret not in result.output
    assert out["nodes"][0]["redis_url"] == "unix:///run/specpipe/redis.sock?db=0"


def test_nodes_needs_the_swarm_key(swarm, redis_url, monkeypatch, tmp_path):
    monkeypatch.delenv("SPECPIPE_SWARM_KEY")
    monkeypatch.setenv("SPECPIPE_HOME", str(tmp_path))
    result = CliRunner().invoke(cli, ["nodes", "--redis", redis_url, "--swarm", swarm])
    assert result.exit_code == 1 and "no swarm key" in result.output


def test_nodes_flags_a_node_that_does_not_sample_exactly_in_text_and_json(swarm, redis_url, key):
    client = redis.Redis.from_url(redis_url)
    inventory.publish(client, swarm, NodeInfo("nj", 2, 4, redis_url, sampler="lossy"), key)
    inventory.publish(client, swarm, NodeInfo("wa", 0, 2, redis_url), key)
    client.close()
    warning = "warning: not the exact sampler on nj ('lossy'): "

    result = CliRunner().invoke(cli, ["nodes", "--redis", redis_url, "--swarm", swarm])
    assert result.exit_code == 0, result.output
    header, wa, nj = result.stdout.splitlines()
    assert header.split()[-1] == "SAMPLER"
    assert nj.split()[0] == "nj" and nj.split()[-1] == "lossy"
    assert wa.split()[0] == "wa" and wa.split()[-1] == "exact"
    assert result.stderr.startswith(warning) and "NOT lossless" in result.stderr

    result = CliRunner().invoke(cli, ["nodes", "--redis", redis_url, "--swarm", swarm, "--json"])
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)["nodes"]
    assert [(r["host"], r["sampler"]) for r in records] == [("wa", "exact"), ("nj", "lossy")]
    assert result.stderr.startswith(warning)


def test_nodes_that_sample_exactly_warn_of_nothing(swarm, redis_url, key):
    client = redis.Redis.from_url(redis_url)
    inventory.publish(client, swarm, NodeInfo("wa", 0, 2, redis_url), key)
    client.close()
    for extra in ([], ["--json"]):
        result = CliRunner().invoke(cli, ["nodes", "--redis", redis_url, "--swarm", swarm, *extra])
        assert result.exit_code == 0 and result.stderr == ""
        assert "SAMPLER" not in result.stdout


def test_the_ring_latency_adds_every_stage_and_link_and_gives_the_ceiling():
    wa = NodeInfo("wa", 0, 2, "redis://wa", next_hop="nj", next_hop_rtt_ms=3.0)
    nj = NodeInfo("nj", 2, 4, "redis://nj", next_hop="coordinator", next_hop_rtt_ms=1.0)
    ring = [wa, nj]
    stats = {"wa": {"forward_ms": 3.0, "hop_ms": 0.5}, "nj": None}
    latency = inventory.ring_latency(ring, stats)
    assert [h.link_ms for h in latency.hops] == [1.5, 0.5]
    assert latency.ring_ms == pytest.approx(3.0 + 0.5 + 1.5 + 0.5)
    assert latency.ceiling_tok_s(2.0) == pytest.approx(2000 / 5.5)
    assert latency.as_dict()["ceiling_tok_s"] == pytest.approx(181.82)
    assert inventory.latency_lines(latency)[-1].endswith("181.8 tok/s per token per round")


def test_nodes_show_each_hops_measured_link_once_the_ring_has_carried_rounds(
    stages, ring_settings, redis_url, swarm
):
    from specpipe.swarm.redis_ring import RedisRing
    from tests.swarm.test_redis_ring import PARAMS, drive, two_heartbeats_later

    stages.start("h0", "0:2", redis_url, wait=False)
    stages.start("h1", "2:4", redis_url, wait=False)
    stages.wait_ready(["h0", "h1"])
    before = CliRunner().invoke(cli, ["nodes", "--redis", redis_url, "--swarm", swarm, "--json"])
    assert json.loads(before.output)["ring"] is None  # no round yet: no link measured
    ring = RedisRing.from_inventory(ring_settings, "toy", 4)
    ring.reset("s", PARAMS)
    drive(ring, "s", rounds=3, k=2)
    ring.close()
    for host in ("h0", "h1"):
        two_heartbeats_later(redis_url, swarm, ring_settings.swarm_key.encode(), host)
    result = CliRunner().invoke(cli, ["nodes", "--redis", redis_url, "--swarm", swarm, "--json"])
    latency = json.loads(result.stdout)["ring"]
    hops = [(h["host"], h["next_hop"]) for h in latency["hops"]]
    assert hops == [("h0", "h1"), ("h1", "coordinator")]
    assert all(0 < h["link_ms"] < 50 and h["forward_ms"] > 0 for h in latency["hops"])
    assert latency["ceiling_tok_s"] == pytest.approx(1000 / latency["ring_ms"], rel=1e-3)
    text = CliRunner().invoke(cli, ["nodes", "--redis", redis_url, "--swarm", swarm]).output
    assert "h0 -> h1: forward" in text and "latency ceiling" in text


def test_nodes_shows_how_far_each_hosts_clock_is_off_the_registrys(swarm, redis_url, key):
    client = redis.Redis.from_url(redis_url)
    # A host whose clock runs 20 s fast measured the registry's 20 s behind its own.
    inventory.publish(client, swarm, NodeInfo("wa", 0, 2, redis_url, clock_offset_s=-20.0), key)
    inventory.publish(client, swarm, NodeInfo("nj", 2, 4, redis_url), key)
    client.close()
    result = CliRunner().invoke(cli, ["nodes", "--redis", redis_url, "--swarm", swarm])
    assert result.exit_code == 0, result.output
    header, wa, nj = result.output.splitlines()[:3]
    assert header.split()[-1] == "CLOCK"
    assert wa.split()[:4] == ["wa", "stage0", "0:2", "online"] and wa.endswith("+20.0 s")
    assert nj.endswith("in step")
    result = CliRunner().invoke(cli, ["nodes", "--redis", redis_url, "--swarm", swarm, "--json"])
    offsets = {n["host"]: n["clock_offset_s"] for n in json.loads(result.output)["nodes"]}
    assert offsets == {"wa": -20.0, "nj": 0.0}
