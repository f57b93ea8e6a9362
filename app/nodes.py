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
from specpipe import inventory
from specpipe.inventory import lossy_warning
from specpipe.settings import swarm_keys

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


def ignored_records() -> int | None:
    """How many records in the live inventory fail to verify; None when it cannot be read."""
    keys = swarm_keys()
    if not keys:
        return None
    client = redis.Redis.from_url(current_app.config["REDIS_URL"], socket_connect_timeout=0.5,
                                  socket_timeout=1, retry=Retry(NoBackoff(), 0))  # fmt: skip
    try:
        return inventory.read(client, current_app.config["SWARM"], keys).ignored
    except (redis.RedisError, ValueError):
        return None
    finally:
        client.close()


@bp.get("/")
def index():
    """All nodes in ring order with status and last heartbeat; a node running the test-only
    lossy tail is flagged, and so is the page."""
    nodes = ring_nodes(get_session())
    now = utcnow()
    points = ring_layout(nodes)
    counts = {"online": 0, "stale": 0, "offline": 0}
    for node in nodes:
        counts[node.status(now)] += 1
    ends = [n.layer_end for n in nodes if n.layer_end is not None]
    lossy = [n.host for n in nodes if n.test_lossy_tail]
    return render_template(
        "nodes/index.html",
        nodes=nodes,
        now=now,
        counts=counts,
        layer_total=max(ends) if ends else None,
        memory_total=sum(n.memory_bytes or 0 for n in nodes) or None,
        points=points,
        arrows=ring_arrows(points),
        lossy_warning=lossy_warning(lossy) if lossy else None,
        ignored=ignored_records(),
    )
