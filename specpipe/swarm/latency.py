"""How far each stage host is, as host 0 measures it: the time a PING to the host's Redis
takes from the coordinator's side (the best of a few), kept on the registry where only host 0
writes (`specpipe:{swarm}:latency`; no stage host's registry user reaches it).

Among live replicas of a range a ring takes the nearest (`inventory.route`), figures within the
same `BUCKET_MS` a tie broken by host name, so two replicas about as near do not take turns. It
is a figure no host can make smaller than it is, unlike anything a host says of itself (its
record's date, its own link measurements): a host can only slow itself out of the choice. A
host not measured yet, or whose figure is older than `FRESH_S`, comes after the measured ones.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Mapping

import redis

from specpipe.swarm.clock import SwarmClock
from specpipe.swarm.dialing import Dialer

log = logging.getLogger(__name__)

PINGS = 3  # a host's figure is the best of these
TIMEOUT_S = 1.0  # a host that does not answer in this long is not measured this time
FRESH_S = 60.0  # figures older than this (swarm time) are not believed
BUCKET_MS = 5.0  # figures in the same bucket are a tie


def latency_key(swarm: str) -> str:
    return f"specpipe:{swarm}:latency"


def ping_ms(url: str, pings: int = PINGS) -> float | None:
    """The best of `pings` PINGs to the Redis at `url`, in milliseconds, once connected; None
    when it cannot be reached in `TIMEOUT_S`."""
    client = redis.Redis.from_url(url, socket_connect_timeout=TIMEOUT_S, socket_timeout=TIMEOUT_S)
    try:
        client.ping()  # the connection (and its TLS handshake) is not the link's latency
        best = math.inf
        for _ in range(pings):
            started = time.perf_counter()
            client.ping()
            best = min(best, (time.perf_counter() - started) * 1000)
        return best
    except (redis.RedisError, OSError):
        return None
    finally:
        client.close()


def measure(addresses: Mapping[str, str], dialer: Dialer) -> dict[str, float]:
    """Each host's figure (host -> its Redis address, as the inventory gives it), dialled as
    this process dials it; hosts that did not answer are left out."""
    table = {}
    for host, address in addresses.items():
        ms = ping_ms(dialer.url(address, host))
        if ms is not None:
            table[host] = round(ms, 3)
    return table


def publish(client: redis.Redis, swarm: str, table: Mapping[str, float]) -> None:
    """Replace the registry's figures with `table`, stamped with swarm time."""
    at = SwarmClock(client).now()
    fields = {host: json.dumps({"ms": ms, "at": at}) for host, ms in table.items()}
    pipe = client.pipeline(transaction=True)
    pipe.delete(latency_key(swarm))
    if fields:
        pipe.hset(latency_key(swarm), mapping=fields)
    pipe.execute()


def read(client: redis.Redis, swarm: str, now: float) -> dict[str, float]:
    """The figures on the registry no older than `FRESH_S` at swarm time `now`. A key of
    another type, or a field that is not a figure, counts as no figure."""
    try:
        raw = client.hgetall(latency_key(swarm))
    except redis.ResponseError:  # retyped: no host can write it, but no job stops for it
        return {}
    table = {}
    for host, value in raw.items():
        try:
            entry = json.loads(value)
            ms, at = float(entry["ms"]), float(entry["at"])
        except (ValueError, KeyError, TypeError):
            continue
        if now - FRESH_S <= at and 0 <= ms < math.inf:
            table[host.decode(errors="replace")] = ms
    return table


def rank(table: Mapping[str, float], host: str) -> float:
    """`host`'s place among replicas: its figure's bucket; unmeasured hosts last."""
    ms = table.get(host)
    return math.inf if ms is None else ms // BUCKET_MS


def refresh(client: redis.Redis, swarm: str, nodes: Iterable, dialer: Dialer) -> dict[str, float]:
    """Measure every node of `nodes` (each with `host` and `redis_url`) and publish the
    figures; the table published."""
    table = measure({node.host: node.redis_url for node in nodes}, dialer)
    publish(client, swarm, table)
    return table
