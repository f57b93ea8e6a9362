"""The beat task's work: the live inventory in Redis copied into the store's nodes table."""

from __future__ import annotations

import time

import redis

from models.nodes import ring_nodes
from specpipe.swarm import inventory
from workers.node_sync import sync_inventory


def test_heartbeats_reach_the_nodes_table(redis_url, swarm, db_session, key):
    client = redis.Redis.from_url(redis_url)
    now = time.time()
    for i, (start, end) in enumerate([(0, 15), (15, 30)]):
        node = inventory.NodeInfo(
            host=f"h{i}",
            layer_start=start,
            layer_end=end,
            redis_url=redis_url,
            role="stage0" if i == 0 else "tail",
            geo=["WA", "NJ"][i],
            cpu_model="Test CPU",
            memory_bytes=2**30,
        )
        inventory.publish(client, swarm, node, key, now=now - 100 * i)
    assert sync_inventory(db_session, inventory.load(client, swarm, key)) == 2
    db_session.commit()
    stored = ring_nodes(db_session)
    assert [(n.host, n.role, n.layer_start, n.layer_end, n.geo) for n in stored] == [
        ("h0", "stage0", 0, 15, "WA"),
        ("h1", "tail", 15, 30, "NJ"),
    ]
    assert stored[0].status() == "online" and stored[1].status() == "stale"
    assert stored[0].gpu_name == "cpu (Test CPU)"

    # A later heartbeat updates the same row, never a second one.
    inventory.publish(
        client,
        swarm,
        inventory.NodeInfo(
            host="h1", layer_start=15, layer_end=30, redis_url=redis_url, role="tail"
        ),
        key,
        now=time.time(),
    )
    sync_inventory(db_session, inventory.load(client, swarm, key))
    db_session.commit()
    assert [n.status() for n in ring_nodes(db_session)] == ["online", "online"]
    client.close()


def test_the_store_never_holds_a_redis_password(db_session):
    # No record carries a password (`inventory.publish` refuses one); should a node built in
    # code hold one, the store still keeps it hidden.
    own = "redis://specpipe:s3cr3t@10.0.0.7:6379/0"
    sync_inventory(db_session, [inventory.NodeInfo("wa", 0, 2, own, last_heartbeat=time.time())])
    db_session.commit()
    [stored] = ring_nodes(db_session)
    assert stored.redis_url == "redis://specpipe:***@10.0.0.7:6379/0"
