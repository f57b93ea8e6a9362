"""The node inventory: records in Redis, status by heartbeat age, and building the ring."""

import json
import time

import pytest
import redis

from specpipe.swarm import inventory
from specpipe.swarm.inventory import NodeInfo, RouteError, route

NOW = 1_000_000.0


def node(host, start, end, age=0.0, **kw):
    return NodeInfo(
        host=host,
        layer_start=start,
        layer_end=end,
        redis_url=f"redis://{host}:6379/0",
        last_heartbeat=NOW - age,
        **kw,
    )


def hosts(chain):
    return [(n.host, n.layers, n.role) for n in chain]


@pytest.mark.parametrize(
    ("age", "status"),
    [(0, "online"), (30, "online"), (30.5, "stale"), (120, "stale"), (121, "offline")],
)
def test_status_by_heartbeat_age(age, status):
    assert node("a", 0, 1, age=age).status(NOW) == status


def test_route_orders_stages_by_layer_and_names_their_roles():
    nodes = [node("nj", 27, 36), node("wa", 0, 9), node("nc", 18, 27), node("mn", 9, 18)]
    chain = route(nodes, 36, now=NOW)
    assert hosts(chain) == [
        ("wa", "0:9", "stage0"),
        ("mn", "9:18", "stage1"),
        ("nc", "18:27", "stage2"),
        ("nj", "27:36", "tail"),
    ]


def test_missing_layers_are_named():
    nodes = [node("wa", 0, 9), node("mn", 9, 18), node("nj", 27, 36)]
    with pytest.raises(RouteError, match="no online stage serves layers 18:27"):
        route(nodes, 36, now=NOW)


def test_stale_and_offline_stages_do_not_count():
    nodes = [node("wa", 0, 9), node("mn", 9, 18), node("nc", 18, 27, age=60), node("nj", 27, 36)]
    with pytest.raises(RouteError, match="layers 18:27"):
        route(nodes, 36, now=NOW)
    nodes[-1] = node("nj", 27, 36, age=500)
    with pytest.raises(RouteError, match="layers 18:36"):
        route(nodes, 36, now=NOW)


def test_missing_tail_and_missing_head():
    with pytest.raises(RouteError, match="layers 18:36"):
        route([node("a", 0, 9), node("b", 9, 18)], 36, now=NOW)
    with pytest.raises(RouteError, match="layers 0:9"):
        route([node("b", 9, 36)], 36, now=NOW)
    with pytest.raises(RouteError, match="layers 0:4"):
        route([], 4, now=NOW)


def test_overlapping_stages_never_serve_a_layer_twice():
    # 0:10 overlaps 9:18; the only exact cover is 0:9 + 9:18 + 18:36.
    nodes = [node("big", 0, 10), node("a", 0, 9), node("b", 9, 18), node("c", 18, 36)]
    assert [n.host for n in route(nodes, 36, now=NOW)] == ["a", "b", "c"]
    with pytest.raises(RouteError, match="layers 10:18"):
        route([node("big", 0, 10), node("b", 9, 18), node("c", 18, 36)], 36, now=NOW)


def test_dead_end_is_backtracked():
    nodes = [node("x", 0, 5), node("a", 0, 3), node("b", 3, 8), node("y", 5, 6)]
    assert [n.host for n in route(nodes, 8, now=NOW)] == ["a", "b"]


def test_between_live_replicas_a_records_freshness_decides_nothing():
    """On main the freshest record won: a spare that dated its record ahead (up to the 2 s
    allowed) took every round through its range, every user's prompt or output with it."""
    for ages in ((20, 1), (1, 20), (0, 0)):
        nodes = [node("b-spare", 0, 2, age=ages[0]), node("a-first", 0, 2, age=ages[1])]
        assert [n.host for n in route([*nodes, node("t", 2, 4)], 4, now=NOW)] == ["a-first", "t"]
    ahead = [node("a-first", 0, 2, age=9), node("b-spare", 0, 2, age=-1.9), node("t", 2, 4)]
    assert [n.host for n in route(ahead, 4, now=NOW)] == ["a-first", "t"]


def test_a_lapsed_replica_loses_to_a_healthy_one_even_a_less_fresh_one():
    # "fast" promised a beat every 0.5 s and missed three; "slow" beats every 10 s and is on time.
    nodes = [node("fast", 2, 4, age=2, heartbeat_s=0.5), node("slow", 2, 4, age=5), node("h", 0, 2)]
    assert nodes[0].lapsed(NOW) and not nodes[1].lapsed(NOW)
    assert [n.host for n in route(nodes, 4, now=NOW)] == ["h", "slow"]
    # Lapsed is not offline: with no one else for its layers, it is still routed.
    assert [n.host for n in route(nodes[::2], 4, now=NOW)] == ["h", "fast"]


def test_among_live_replicas_a_route_prefers_the_hosts_keeping_a_prefix():
    nodes = [node("a", 0, 2), node("b", 0, 2), node("t1", 2, 4), node("t2", 2, 4)]
    assert [n.host for n in route(nodes, 4, now=NOW)] == ["a", "t1"]
    assert [n.host for n in route(nodes, 4, now=NOW, prefer={"b", "t2"})] == ["b", "t2"]
    # Only where it keeps a range: the other range is chosen by name as ever.
    assert [n.host for n in route(nodes, 4, now=NOW, prefer={"b"})] == ["b", "t1"]
    # A preferred host whose heartbeat lapsed loses to a live one; avoided, it is not routed.
    lapsed = [node("a", 0, 2), node("b", 0, 2, age=2, heartbeat_s=0.5), node("t1", 2, 4)]
    assert [n.host for n in route(lapsed, 4, now=NOW, prefer={"b"})] == ["a", "t1"]
    assert [n.host for n in route(nodes, 4, now=NOW, prefer={"b"}, avoid={"b"})] == ["a", "t1"]


def test_a_route_avoids_the_hosts_it_is_told_to_or_names_what_is_left_uncovered():
    nodes = [node("a", 0, 2), node("t1", 2, 4, age=2), node("t2", 2, 4, age=1)]
    assert [n.host for n in route(nodes, 4, now=NOW)] == ["a", "t1"]
    assert [n.host for n in route(nodes, 4, now=NOW, avoid={"t1"})] == ["a", "t2"]
    with pytest.raises(RouteError, match="layers 2:4"):
        route(nodes, 4, now=NOW, avoid={"t1", "t2"})


def test_restarted_hops_are_those_whose_record_has_another_incarnation():
    from dataclasses import replace

    hops = [replace(node(h, i, i + 1), incarnation="old") for i, h in enumerate("abcd")]
    now = [
        hops[0],  # the same process
        replace(hops[1], incarnation="new"),  # started again
        replace(hops[2], incarnation=""),  # a record from a version without incarnations
    ]  # d is gone: lost, not restarted
    assert inventory.restarted_hops(hops, now) == ["b"]
    record = NodeInfo.from_json(now[1].to_json())
    assert record.incarnation == "new"
    older = json.loads(now[1].to_json())
    del older["incarnation"]
    assert NodeInfo.from_json(json.dumps(older)).incarnation == ""


def test_lost_hops_are_the_lapsed_the_departed_and_the_resplit():
    hops = route([node("a", 0, 1), node("b", 1, 2), node("c", 2, 3), node("d", 3, 4)], 4, now=NOW)
    now = [
        node("a", 0, 1, age=1.4, heartbeat_s=0.5),
        node("b", 1, 2, age=1.6, heartbeat_s=0.5),
        node("c", 2, 4),
    ]
    assert inventory.lost_hops(hops, now, NOW) == ["b", "c", "d"]
    assert inventory.lost_hops(hops[:1], now, NOW) == []


def test_a_new_host_takes_the_first_range_nobody_serves():
    nodes = [node("a", 0, 2), node("c", 5, 8), node("d", 2, 3, age=60)]  # d is stale
    assert inventory.choose_layers(nodes, 8, now=NOW)[:2] == (2, 5)
    assert inventory.choose_layers([], 8, now=NOW)[:2] == (0, 8)
    assert inventory.choose_layers(nodes[:1], 8, now=NOW) == (2, 8, "nobody serves it")


def test_when_all_is_served_a_new_host_spares_the_busiest_range():
    nodes = [node("a", 0, 2), node("b1", 2, 4), node("b2", 2, 4, age=1), node("c", 4, 6)]
    # The ranges with one host each: a's and c's; c has processed more rounds.
    start, end, why = inventory.choose_layers(nodes, 6, load={"a": 10, "c": 30}, now=NOW)
    assert (start, end) == (4, 6) and why.startswith("a spare")
    assert inventory.choose_layers(nodes, 6, now=NOW)[:2] == (0, 2)  # a tie: the first
    # A model the nodes do not serve has everything uncovered.
    assert inventory.choose_layers([node("x", 0, 6, model="m")], 6, model="n", now=NOW)[:2] == (
        0,
        6,
    )


def test_the_promised_heartbeat_round_trips_and_older_records_beat_every_ten_seconds():
    record = node("a", 0, 1, heartbeat_s=0.5)
    assert NodeInfo.from_json(record.to_json()) == record
    old = json.loads(node("a", 0, 1).to_json())
    del old["heartbeat_s"]
    assert NodeInfo.from_json(json.dumps(old)).lapse_s() == 30.0


def test_layers_beyond_the_model_and_other_models_are_ignored():
    nodes = [node("a", 0, 2, model="m"), node("b", 2, 5, model="m"), node("c", 2, 4, model="x")]
    with pytest.raises(RouteError, match="layers 2:4"):
        route(nodes, 4, model="m", now=NOW)
    with pytest.raises(RouteError, match="at least one layer"):
        route(nodes, 0, now=NOW)


def test_publish_load_and_remove_in_redis(swarm, redis_url, key):
    client = redis.Redis.from_url(redis_url)
    before = time.time()
    inventory.publish(
        client, swarm, NodeInfo("b", 2, 4, redis_url, geo="MN", public_ip="10.0.0.2"), key
    )
    inventory.publish(client, swarm, NodeInfo("a", 0, 2, redis_url, geo="WA"), key)
    client.set(inventory.node_key(swarm, "junk"), "{not json")
    loaded = inventory.load(client, swarm, key)
    assert [(n.host, n.geo) for n in loaded] == [("a", "WA"), ("b", "MN")]
    assert loaded[1].public_ip == "10.0.0.2"
    # Dated in swarm time: the registry's clock (this host's here), estimated within half a
    # round trip to it.
    slack = 0.05
    assert all(before - slack <= n.last_heartbeat <= time.time() + slack for n in loaded)
    assert [n.host for n in route(loaded, 4)] == ["a", "b"]
    inventory.remove(client, swarm, "a")
    with pytest.raises(RouteError, match="layers 0:2"):
        route(inventory.load(client, swarm, key), 4)
    client.close()


def test_hardware_describes_this_machine_without_a_gpu():
    info = inventory.hardware()
    import torch

    if torch.cuda.is_available():
        assert info["gpu_name"] != "cpu" and info["gpu_uuid"]
    else:
        assert info["gpu_name"] == "cpu" and info["gpu_uuid"] == "cpu"
        assert info["cpu_model"]
    assert info["memory_bytes"] > 2**20


def test_records_from_a_newer_version_still_load():
    text = NodeInfo("a", 0, 1, "redis://x").to_json().replace('{"', '{"future_field": 1, "', 1)
    assert NodeInfo.from_json(text).host == "a"


def test_the_sampler_round_trips_and_older_records_read_as_exact():
    flagged = node("nj", 2, 4, sampler="lossy")
    assert NodeInfo.from_json(flagged.to_json()).sampler == "lossy"
    assert NodeInfo.from_json(node("wa", 0, 2).to_json()).sampler == inventory.EXACT_SAMPLER
    older = json.loads(flagged.to_json())
    del older["sampler"]  # a record from before the field
    assert NodeInfo.from_json(json.dumps(older)).sampler == "exact"


def test_the_inexact_nodes_are_named_with_their_samplers_in_one_warning():
    nodes = [node("wa", 0, 2, sampler="lossy"), node("mn", 2, 3), node("nj", 3, 4, sampler="x")]
    assert [n.host for n in inventory.inexact_nodes(nodes)] == ["wa", "nj"]
    assert inventory.inexact_nodes(nodes[1:2]) == []
    warning = inventory.inexact_warning(nodes)
    assert warning.startswith("not the exact sampler on wa ('lossy'), nj ('x'): ")
    assert "NOT lossless" in warning and "mn" not in warning
    assert inventory.inexact_warning(nodes[1:2]) == ""


def test_table_names_the_samplers_in_a_last_column_when_one_is_not_exact():
    plain = inventory.table([node("wa", 0, 2), node("nj", 2, 4)], now=NOW)
    assert "SAMPLER" not in plain[0] and "exact" not in "\n".join(plain)
    header, wa, nj = inventory.table([node("nj", 2, 4, sampler="lossy"), node("wa", 0, 2)], now=NOW)
    assert header.split()[-1] == "SAMPLER"
    assert nj.startswith("nj ") and nj.split()[-1] == "lossy"
    assert wa.startswith("wa ") and wa.split()[-1] == "exact"


def test_table_lists_nodes_in_ring_order_with_status():
    nodes = [
        node("nj", 27, 36, age=200, role="tail", geo="NJ"),
        node(
            "wa",
            0,
            9,
            age=3,
            role="stage0",
            geo="WA",
            public_ip="203.0.113.5",
            gpu_name="NVIDIA GeForce RTX 4090",
            memory_bytes=24 * 2**30,
        ),
    ]
    header, first, second = inventory.table(nodes, now=NOW)
    assert header.split()[:4] == ["HOST", "ROLE", "LAYERS", "STATUS"]
    assert first.split()[:5] == ["wa", "stage0", "0:9", "online", "3s"]
    assert "203.0.113.5" in first and "RTX 4090" in first and "24.0 GiB" in first
    assert second.split()[:4] == ["nj", "tail", "27:36", "offline"]


def test_roles_follow_the_layer_order_unless_published():
    nodes = [
        inventory.NodeInfo(host="c", layer_start=20, layer_end=30, redis_url="redis://c"),
        inventory.NodeInfo(host="a", layer_start=0, layer_end=10, redis_url="redis://a"),
        inventory.NodeInfo(
            host="b", layer_start=10, layer_end=20, redis_url="redis://b", role="middle"
        ),
    ]
    assert [(n.host, n.role) for n in inventory.with_roles(nodes)] == [
        ("a", "stage0"),
        ("b", "middle"),
        ("c", "tail"),
    ]
    assert inventory.with_roles([]) == []
