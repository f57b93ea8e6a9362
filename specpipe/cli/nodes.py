"""`specpipe nodes`: the swarm's node inventory, in ring order."""

from __future__ import annotations

import json
from dataclasses import asdict

import click


@click.command(name="nodes")
@click.option(
    "--redis",
    "redis_url",
    help="The swarm's registry Redis [default: REDIS_URL, else the one `specpipe up` runs].",
)
@click.option(
    "--swarm",
    default=None,
    help="The swarm's name [default: SPECPIPE_SWARM, else the running swarm's, else `default`].",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print JSON: each node's record, role, status and stage counters, and the "
    "count of ignored records.",
)
def nodes(redis_url: str | None, swarm: str | None, as_json: bool) -> None:
    """List every stage host: role, layers, status by heartbeat, Redis, geo, GPU, clock.

    Heartbeats are dated, and judged, on the registry's clock (swarm time); CLOCK is how far
    each host's own clock is off it (`clock_offset_s` in JSON: the registry's less the host's).

    Records are signed with the swarm key (SPECPIPE_SWARM_KEY, else the one `specpipe up`
    keeps); unsigned, forged, malformed or future-dated ones are left out and counted. Passwords
    in Redis URLs are shown as ***.

    Among live replicas of a range, routing takes the one nearest host 0 as host 0 measures it
    (a PING to its Redis from the coordinator's beat, every 10 s); `host0_rtt_ms` in JSON, and
    a "from host 0" section in the text, give those figures.

    With --json the output is {"swarm", "nodes", "ignored_records"}, and each node also carries
    `stats`, read from its own Redis: rounds processed, the forwards they ran in (several
    sessions' rounds batched are one), messages dropped, replayed, gaps, errors, and running
    means of its forward, of what the hop adds around it and of the rounds per forward
    (`forward_ms`, `hop_ms`, `batch_size`), the prefixes of ended jobs it keeps for later
    ones (`kept_prefixes`, `kept_tokens`) and the jobs that started from one or found theirs
    gone (`prefix_hits`, `prefix_misses`); null where that Redis cannot be reached. Once the
    ring has carried rounds, `ring` gives its latency: per hop the forward, the handling and
    the link to the next hop (half the PING round trip each stage measures at its
    heartbeats), the ring's time per round and the latency ceiling in tok/s at
    one token per round (multiply by a job's tokens per round); the text output ends with the
    same.

    Each node says how its tail samples (`sampler` in JSON): "exact" for the lossless
    samplers. A node that samples with anything else (a test double) gets a last column,
    SAMPLER, in the text output, and a warning naming it goes to stderr: its output is NOT
    lossless.

    Example:

        REDIS_URL=redis://127.0.0.1:6379/0 specpipe nodes --json
    """
    from specpipe import settings
    from specpipe.swarm import inventory

    redis_url = (
        redis_url or settings.configured_redis_url() or settings.swarm_file().get("redis_url")
    )
    swarm = swarm or settings.swarm_name()
    if not redis_url:
        raise click.ClickException("no swarm Redis: set REDIS_URL or pass --redis")
    found = _verified_inventory(redis_url, swarm)
    if warning := inventory.inexact_warning(found.nodes):
        click.echo(f"warning: {warning}", err=True)
    records = _records(found.nodes, swarm, found.now, found.roster)
    stats = {r["host"]: r["stats"] for r in records}
    latency = _latency(found, stats)
    if as_json:
        ring = latency.as_dict() if latency else None
        out = {"swarm": swarm, "nodes": records, "ring": ring, "host0_rtt_ms": found.latency_ms}
        click.echo(json.dumps({**out, "ignored_records": found.ignored}, indent=2))
        return
    for line in _text(found, swarm, latency, stats):
        click.echo(line)


def _verified_inventory(redis_url: str, swarm: str):
    """The swarm's inventory as this host's keyring verifies it; one line when there is no
    key to check it with or the registry cannot be read."""
    import redis

    from specpipe import settings
    from specpipe.swarm import inventory, trust, wire
    from specpipe.swarm.redact import redact_url

    try:
        keys = trust.keyring(settings.Settings.from_env())
    except wire.WireError:
        raise click.ClickException(
            "no swarm key to check the inventory with: set SPECPIPE_SWARM_KEY "
            "(or run `specpipe up`, which keeps one)"
        ) from None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    client = redis.Redis.from_url(redis_url, socket_connect_timeout=3)
    try:
        return inventory.read(client, swarm, keys)
    except redis.RedisError as exc:
        where = redact_url(redis_url)
        raise click.ClickException(f"cannot read the inventory at {where}: {exc}") from None
    finally:
        client.close()


def _text(found, swarm: str, latency, stats: dict) -> list[str]:
    """The table of nodes, the ring's latency under it, what the stages keep of ended jobs,
    and the count of ignored records."""
    from specpipe.swarm import inventory

    lines = (
        inventory.table(found.nodes, found.now) if found.nodes else [f"no nodes in swarm {swarm!r}"]
    )
    if latency:
        lines += inventory.latency_lines(latency)
    if found.latency_ms:
        lines.append("from host 0 (PING round trip; replicas are chosen by it):")
        lines += [f"  {host}: {ms:.2f} ms" for host, ms in sorted(found.latency_ms.items())]
    lines += _kept_lines(stats)
    if found.ignored:
        lines.append(inventory.ignored_note(found.ignored))
    return lines


def _kept_lines(stats: dict) -> list[str]:
    """Per stage that kept any: the prefixes of ended jobs it keeps for later ones, and how
    often a job found its prefix there or not."""
    lines = []
    for host, counts in stats.items():
        if counts and (counts.get("kept_prefixes") or counts.get("prefix_hits")):
            lines.append(
                f"  {host}: keeps {int(counts.get('kept_prefixes', 0))} prefix(es), "
                f"{int(counts.get('kept_tokens', 0))} tokens; started from one "
                f"{int(counts.get('prefix_hits', 0))} time(s), missed "
                f"{int(counts.get('prefix_misses', 0))}"
            )
    return ["kept prefixes:", *lines] if lines else []


def _latency(found, stats: dict):
    """The latency of the ring routing builds from the inventory `found` (None before its
    stages measured it)."""
    from specpipe.swarm import inventory

    ring = inventory.measured_ring(found.nodes, found.now, found.latency_ms)
    return inventory.ring_latency(ring, stats) if ring else None


def _records(found: list, swarm: str, now: float, roster=None) -> list[dict]:
    """The nodes in ring order as JSON-ready dicts, each with its status at `now` (swarm time)
    and stage stats."""
    from specpipe.swarm import inventory, streams
    from specpipe.swarm.redact import redact_url

    nodes = inventory.with_roles(found)
    stats = streams.read_stages_stats([(n.host, n.redis_url) for n in nodes], swarm, roster=roster)
    return [
        {
            **asdict(node),
            "redis_url": redact_url(node.redis_url),
            "status": node.status(now),
            "stats": stats[node.host],
        }
        for node in nodes
    ]
