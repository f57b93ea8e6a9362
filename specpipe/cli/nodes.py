"""`specpipe nodes`: the swarm's node inventory, in ring order."""

from __future__ import annotations

import click


@click.command(name="nodes")
@click.option("--redis", "redis_url", envvar="REDIS_URL",
              help="The swarm's registry Redis (default: the one `specpipe up` runs).")  # fmt: skip
@click.option("--swarm", envvar="SPECPIPE_SWARM", default=None,
              help="The swarm's name (default: the running swarm's, else `default`).")  # fmt: skip
def nodes(redis_url: str | None, swarm: str | None) -> None:
    """List every stage host: role, layers, status by heartbeat, Redis, geo, GPU.

    Example:

        REDIS_URL=redis://127.0.0.1:6379/0 specpipe nodes
    """
    import redis

    from specpipe import inventory, settings

    redis_url = redis_url or settings.swarm_file().get("redis_url")
    swarm = swarm or settings.swarm_name()
    if not redis_url:
        raise click.ClickException("no swarm Redis: set REDIS_URL or pass --redis")
    client = redis.Redis.from_url(redis_url, socket_connect_timeout=3)
    try:
        found = inventory.load(client, swarm)
    except redis.RedisError as exc:
        raise click.ClickException(f"cannot read the inventory at {redis_url}: {exc}") from None
    finally:
        client.close()
    if not found:
        click.echo(f"no nodes in swarm {swarm!r}")
        return
    for line in inventory.table(found):
        click.echo(line)
