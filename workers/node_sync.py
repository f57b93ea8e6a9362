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
from specpipe import settings as settings_module
from specpipe.ops import certificates, invitations, roster
from specpipe.ops.certificates import CA_FOLDER
from specpipe.settings import Settings
from specpipe.swarm import datakeys, inventory, latency, mending, trust
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


def rotate_when_due(client: redis.Redis, settings: Settings) -> None:
    """On host 0 (where the coordinator's key is), a new data key once the current one is
    `SPECPIPE_DATA_KEY_EPOCH_S` old (`specpipe host rotate`); a failure is logged, and the
    inventory is read all the same."""
    every_s = settings_module.data_key_epoch_s()
    if not every_s or not settings_module.coordinator_key_path(settings.home).exists():
        return
    try:
        rotated = roster.rotate(client, settings.swarm, settings.home, every_s=every_s)
    except ValueError as exc:  # a host admitted without a sealing key, a key file unreadable
        log.warning("cannot rotate the data keys: %s", exc)
        return
    if rotated is not None:
        log.info("data key epoch %d, after %g s", rotated.epoch.number, every_s)


def keep_registry_users(client: redis.Redis, settings: Settings) -> None:
    """On host 0, each admitted host's registry user made (again, after a restart of the
    registry) and any other's deleted, and a host over its quota shut out
    (`roster.keep_users`); a failure is logged, and the inventory is read all the same."""
    if not settings_module.coordinator_key_path(settings.home).exists():
        return
    try:
        roster.keep_users(client, settings.swarm, settings.home, settings_module.host_quota_bytes())
    except (ValueError, redis.ResponseError) as exc:
        log.warning("cannot keep the registry's host users: %s", exc)


def answer_invitations(client: redis.Redis, settings: Settings) -> None:
    """On host 0 with a swarm CA, each invitation redeemed since the last beat answered
    (`invitations.answer_pending`): the host admitted and its certificate signed. Nothing
    shared goes with it where the roster's data keys seal (the host's own copies are in the
    roster, and it derives its passwords); only a swarm still sealing with the swarm key (an
    admitted host without a sealing key) hands that out, sealed to the new host. A failure is
    logged; the rest of the beat goes on."""
    ca = certificates.Authority.in_dir(settings.home / CA_FOLDER)
    if not ca.cert.exists() or not settings_module.coordinator_key_path(settings.home).exists():
        return
    try:
        current = roster.current(
            client, settings.swarm, roster.coordinator(settings.home), settings.home
        )
        shared = {}
        if not datakeys.uses_data_keys(current) and settings.swarm_key:
            shared[settings_module.SWARM_KEY_FILE] = settings.swarm_key
        invitations.answer_pending(client, settings.swarm, ca=ca, home=settings.home, shared=shared)
    except (ValueError, OSError, redis.ResponseError) as exc:
        log.warning("cannot answer the invitations: %s", exc)


@shared_task(name=SYNC_NODES_TASK, bind=True)
def sync(self) -> int:
    """Celery beat task: put the registry's keys right (`mending.repair`) and its host users
    (`keep_registry_users`), read the inventory
    from the swarm's Redis and store it, and measure how far each online stage host is."""
    settings = Settings.from_env()
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=3)
    try:
        mending.repair(client, settings.swarm, settings.home)
        rotate_when_due(client, settings)
        keep_registry_users(client, settings)
        answer_invitations(client, settings)
        found = inventory.read(client, settings.swarm, trust.keyring(settings))
        nodes = found.nodes
        online = [node for node in nodes if node.status(found.now) == "online"]
        dialer = Dialer.for_settings(settings)
        dialer.learn(found.roster)  # each host's key, to log in to its Redis as the coordinator
        latency.refresh(client, settings.swarm, online, dialer)
    finally:
        client.close()
    count = sync_inventory(self.session, nodes)
    self.session.commit()
    return count
