"""The nodes page counts the live inventory's records that do not verify, and says why it
reads none where it cannot."""

from __future__ import annotations

import uuid

import redis

from specpipe.swarm import inventory, streams
from tests.factories import gen_ring


def test_nodes_page_counts_records_that_do_not_verify(app, client, session, monkeypatch):
    swarm = f"w{uuid.uuid4().hex[:10]}"
    app.config["SWARM"] = swarm
    monkeypatch.setenv("SPECPIPE_SWARM_KEY", "the swarm key")
    # No coordinator key pinned: the shared-key mode, opted into out loud.
    monkeypatch.setenv("SPECPIPE_INSECURE_SHARED_KEY", "1")
    gen_ring(session, 2)
    assert 'id="ignored-records"' not in client.get("/nodes/").get_data(as_text=True)
    registry = redis.Redis.from_url(app.config["REDIS_URL"])
    try:
        good = inventory.NodeInfo("a", 0, 4, "redis://a")
        inventory.publish(registry, swarm, good, "the swarm key")
        inventory.publish(registry, swarm, inventory.NodeInfo("b", 0, 4, "redis://b"), "forged")
        registry.set(inventory.node_key(swarm, "c"), '{"host": "c"}')
        html = client.get("/nodes/").get_data(as_text=True)
    finally:
        registry.delete(*(inventory.node_key(swarm, host) for host in "abc"))
        registry.close()
    note = html.split('id="ignored-records">', 1)[1].split("</div>", 1)[0]
    assert note.startswith("2 inventory records ignored: unsigned, forged")


def test_nodes_page_shows_the_rings_latency_once_measured(app, client, session, monkeypatch):
    swarm = f"w{uuid.uuid4().hex[:10]}"
    app.config["SWARM"] = swarm
    monkeypatch.setenv("SPECPIPE_SWARM_KEY", "the swarm key")
    # No coordinator key pinned: the shared-key mode, opted into out loud.
    monkeypatch.setenv("SPECPIPE_INSECURE_SHARED_KEY", "1")
    gen_ring(session, 2)
    url = app.config["REDIS_URL"]
    registry = redis.Redis.from_url(url)
    try:
        wa = inventory.NodeInfo("wa", 0, 2, url, next_hop="nj", next_hop_rtt_ms=9.0)
        nj = inventory.NodeInfo("nj", 2, 4, url)  # has not carried a round yet
        for node in (wa, nj):
            inventory.publish(registry, swarm, node, "the swarm key")
        assert 'id="ring-time"' not in client.get("/nodes/").get_data(as_text=True)
        nj = inventory.NodeInfo("nj", 2, 4, url, next_hop="coordinator", next_hop_rtt_ms=3.0)
        inventory.publish(registry, swarm, nj, "the swarm key")
        registry.hset(streams.stats_key(swarm, "wa"), mapping={"forward_ms": 2.0, "hop_ms": 0.5})
        html = client.get("/nodes/").get_data(as_text=True)
    finally:
        nodes = (inventory.node_key(swarm, host) for host in ("wa", "nj"))
        registry.delete(*nodes, streams.stats_key(swarm, "wa"))
        registry.close()
    # 2 + 0.5 + 4.5 at wa, 1.5 at nj: 8.5 ms a round, 117.6 tok/s a token a round.
    assert html.split('id="ring-time">', 1)[1].startswith("8.5 ms per round")
    assert html.split('id="latency-ceiling">', 1)[1].startswith("117.6 tok/s")
    assert "wa → nj" in html and "nj → coordinator" in html


def test_without_a_pinned_key_the_nodes_page_and_metrics_answer_and_say_why(
    app, client, session, monkeypatch
):
    app.config["SWARM"] = f"w{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("SPECPIPE_SWARM_KEY", "s3cret-swarm-key")
    for name in ("SPECPIPE_INSECURE_SHARED_KEY", "SPECPIPE_COORDINATOR_PUB", "SPECPIPE_TLS_DIR"):
        monkeypatch.delenv(name, raising=False)
    gen_ring(session, 2)
    page = client.get("/nodes/")
    assert page.status_code == 200
    html = page.get_data(as_text=True)
    note = html.split('id="inventory-unread">', 1)[1].split("</div>", 1)[0]
    assert note.startswith("The live inventory is not read: this host pins no coordinator key")
    assert "SPECPIPE_INSECURE_SHARED_KEY=1" in note and "s3cret" not in html
    assert 'id="ring-time"' not in html
    assert client.get("/metrics").status_code == 200
