"""Copying the live node inventory (heartbeats in Redis) into the store's nodes table, so the
web app, the metrics and each run's node snapshot see the ring as it is; and measuring, from
here, how far each stage host is (`swarm.latency`), which routing chooses replicas by."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import redis
from celery import shared_task
from sqlalchemy.orm import Session

from models.nodes import NODE_FIELDS, upsert_node
from specpipe.settings import Settings
from specpipe.swarm import inventory, latency, mending, trust
from specpipe.swarm.dialing import Dialer
from specpipe.swarm.redact import redact_url
from workers.names import SYNC_NODES_TASK

log = logging.getLogger(__name__)


def sync_inventory(session: Session, nodes: list[inventory.NodeInfo]) -> int:
    """Upsert every node's record; return how many were written. The caller commits."""
    for node in inventory.with_roles(nodes):
        fields = {name: getattr(node, name) for name in NODE_FIELDS}
        fields["last_heartbeat"] = datetime.fromtimestamp(node.last_heartbeat, UTC)
        fields["redis_url"] = redact_url(node.redis_url)  # the store never holds a password
        if node.gpu_name == "cpu" and node.cpu_model:
            fields["gpu_name"] = f"cpu ({node.cpu_model})"
        upsert_node(session, node.host, **fields)
    return len(nodes)


@shared_task(name=SYNC_NODES_TASK, bind=True)
def sync(self) -> int:
    """Celery beat task: put the registry's keys right (`mending.repair`), read the inventory
    from the swarm's Redis and store it, and measure how far each online stage host is."""
    settings = Settings.from_env()
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=3)
    try:
        mending.repair(client, settings.swarm, settings.home)
        found = inventory.read(client, settings.swarm, trust.keyring(settings))
        nodes = found.nodes
        online = [node for node in nodes if node.status(found.now) == "online"]
        latency.refresh(client, settings.swarm, online, Dialer.for_settings(settings))
    finally:
        client.close()
    count = sync_inventory(self.session, nodes)
    self.session.commit()
    return count
