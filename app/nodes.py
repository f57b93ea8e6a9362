"""The nodes page: the inventory with heartbeat status, and the ring as a diagram."""

from __future__ import annotations

import math

import redis
from flask import Blueprint, current_app, render_template
from redis.backoff import NoBackoff
from redis.retry import Retry

from app.db import get_session
from models.db import utcnow
from models.nodes import Node, ring_nodes
from specpipe.swarm import inventory, streams
from specpipe.swarm.trust import reading_keyring
from specpipe.swarm.wire import Keyring

bp = Blueprint("nodes", __name__, url_prefix="/nodes")


def ring_layout(nodes: list[Node], size: int = 420) -> list[dict]:
    """Positions on a circle for the ring diagram, stage 0 at the top, clockwise."""
    centre, radius = size / 2, size / 2 - 80
    count = max(len(nodes), 1)
    points = []
    for i, node in enumerate(nodes):
        angle = -math.pi / 2 + 2 * math.pi * i / count
        points.append(
            {
                "node": node,
                "x": centre + radius * math.cos(angle),
                "y": centre + radius * math.sin(angle),
            }
        )
    return points


def ring_arrows(points: list[dict], node_radius: float = 34) -> list[dict]:
    """Arrow segments from each node to the next, shortened to stop at the circles."""
    arrows = []
    if len(points) < 2:
        return arrows
    for a, b in zip(points, points[1:] + points[:1], strict=True):
        dx, dy = b["x"] - a["x"], b["y"] - a["y"]
        length = math.hypot(dx, dy) or 1
        ux, uy = dx / length, dy / length
        arrows.append(
            {
                "x1": a["x"] + ux * node_radius,
                "y1": a["y"] + uy * node_radius,
                "x2": b["x"] - ux * (node_radius + 6),
                "y2": b["y"] - uy * (node_radius + 6),
            }
        )
    return arrows


def quick_redis(url: str) -> redis.Redis:
    """A client for what a page reads from Redis: it gives up within a second, without
    retrying, so a Redis that does not answer slows a page down rather than hanging it."""
    return redis.Redis.from_url(
        url, socket_connect_timeout=0.5, socket_timeout=1, retry=Retry(NoBackoff(), 0)
    )


def live_keys() -> tuple[Keyring | None, str | None]:
    """The keyring the live inventory is read with, or None and the one line saying why this
    process has none (no swarm key, no pinned coordinator key): the page says it."""
    try:
        return reading_keyring(), None
    except ValueError as exc:
        return None, f"The live inventory is not read: {exc}."


def live_inventory(keys: Keyring) -> tuple[int | None, inventory.RingLatency | None]:
    """From the live inventory: how many records fail to verify (None when it cannot be read)
    and the ring's latency, with each stage's timings from its own Redis (None until the
    stages have measured their links)."""
    client = quick_redis(current_app.config["REDIS_URL"])
    try:
        found = inventory.read(client, current_app.config["SWARM"], keys)
    except (redis.RedisError, ValueError):
        return None, None
    finally:
        client.close()
    ring = inventory.measured_ring(found.nodes, found.now, found.latency_ms)
    if ring is None:
        return found.ignored, None
    stats = streams.read_stages_stats(
        [(n.host, n.redis_url) for n in ring],
        current_app.config["SWARM"],
        timeout_s=1.0,
        roster=found.roster,
    )
    return found.ignored, inventory.ring_latency(ring, stats)


@bp.get("/")
def index():
    """All nodes in ring order with status and last heartbeat."""
    nodes = ring_nodes(get_session())
    now = utcnow()
    points = ring_layout(nodes)
    counts = {"online": 0, "stale": 0, "offline": 0}
    for node in nodes:
        counts[node.status(now)] += 1
    ends = [n.layer_end for n in nodes if n.layer_end is not None]
    keys, unread = live_keys()
    ignored, latency = live_inventory(keys) if keys else (None, None)
    return render_template(
        "nodes/index.html",
        nodes=nodes,
        now=now,
        counts=counts,
        layer_total=max(ends) if ends else None,
        memory_total=sum(n.memory_bytes or 0 for n in nodes) or None,
        points=points,
        arrows=ring_arrows(points),
        ignored=ignored,
        latency=latency,
        unread=unread,
    )
