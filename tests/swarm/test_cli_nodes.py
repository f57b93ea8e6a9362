"""`specpipe nodes` against a real Redis."""

import redis
from click.testing import CliRunner

from specpipe import inventory
from specpipe.cli import cli
from specpipe.inventory import NodeInfo
from specpipe.redis_server import free_port


def test_nodes_prints_the_inventory_in_ring_order(swarm, redis_url):
    client = redis.Redis.from_url(redis_url)
    inventory.publish(client, swarm, NodeInfo("nj", 2, 4, redis_url, role="tail", geo="NJ"))
    inventory.publish(client, swarm, NodeInfo("wa", 0, 2, redis_url, role="stage0", geo="WA"))
    client.close()
    result = CliRunner().invoke(cli, ["nodes", "--redis", redis_url, "--swarm", swarm])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("HOST")
    assert lines[1].split()[:4] == ["wa", "stage0", "0:2", "online"]
    assert lines[2].split()[:4] == ["nj", "tail", "2:4", "online"]


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
