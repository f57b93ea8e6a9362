"""The nodes page counts the live inventory's records that do not verify."""

from __future__ import annotations

import uuid

import redis

from specpipe import inventory
from tests.factories import gen_ring


def test_nodes_page_counts_records_that_do_not_verify(app, client, session, monkeypatch):
    swarm = f"w{uuid.uuid4().hex[:10]}"
    app.config["SWARM"] = swarm
    monkeypatch.setenv("SPECPIPE_SWARM_KEY", "the swarm key")
    gen_ring(session, 2)
    assert 'id="ignored-records"' not in client.get("/nodes/").get_data(as_text=True)
    registry = redis.Redis.from_url(app.config["REDIS_URL"])
    try:
        good = inventory.NodeInfo("a", 0, 4, "redis://a")
        inventory.publish(registry, swarm, good, "the swarm key")
        inventory.publish(registry, swarm, inventory.NodeInfo("b", 0, 4, "redis://b"), "forged")
        registry.hset(inventory.nodes_key(swarm), "c", '{"host": "c"}')
        html = client.get("/nodes/").get_data(as_text=True)
    finally:
        registry.delete(inventory.nodes_key(swarm))
        registry.close()
    note = html.split('id="ignored-records">', 1)[1].split("</div>", 1)[0]
    assert note.startswith("2 inventory records ignored: unsigned, forged")
