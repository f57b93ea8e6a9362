"""`specpipe lab …`: a multi-host swarm on this machine, each host a network namespace."""

from __future__ import annotations

from pathlib import Path

import click

from specpipe.cli.checkpoints import ModelInputError


@click.group(name="lab")
def lab() -> None:
    """A swarm of separate network stacks on this machine (root only)."""


def _home(home: Path | None) -> Path:
    from specpipe import settings

    return home or settings.instance_dir() / "lab"


def link_delays(_ctx, _param, value: str) -> list[float]:
    """A click callback: `11,8,3.4,19` as milliseconds, none negative."""
    try:
        delays = [float(part) for part in value.split(",") if part.strip()] if value else []
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a list of milliseconds (e.g. 11,8,3.4,19)"
        ) from None
    if any(d < 0 for d in delays):
        raise click.BadParameter("a link delay cannot be negative")
    return delays


HOME_OPTION = click.option(
    "--home",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The lab's folder [default: <instance>/lab].",
)


@lab.command(name="up")
@click.option(
    "--hosts",
    type=click.IntRange(1, 32),
    default=4,
    show_default=True,
    help="Hosts serving the model, each an even share of its layers.",
)
@click.option(
    "--idle",
    type=click.IntRange(0, 16),
    default=0,
    show_default=True,
    help="More hosts with nothing running (a place for `specpipe join`).",
)
@click.option(
    "--model",
    "model_name",
    default=None,
    help="Model [default: SPECPIPE_MODEL, else the embedded default].",
)
@click.option(
    "--link-delay-ms",
    "delays",
    default="",
    callback=link_delays,
    help="One-way delay of each serving host's outgoing link, in ring order: one "
    "value for all or one per host (e.g. 11,8,3.4,19).",
)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=8000,
    show_default=True,
    help="Port of the web app on host 0's address.",
)
@HOME_OPTION
def lab_up(
    hosts: int, idle: int, model_name: str | None, delays: list[float], port: int, home: Path | None
) -> None:
    """Bring up the lab and leave it running: per host a network namespace on a bridge with
    its own address, its own Redis (its own user's password each, the peer user's the swarm's
    data-plane password; host 1's TLS only) and its own stage;
    host 0 also runs the registry, the coordinator, beat, the store and the web app.

    Commands reach it with SPECPIPE_HOME set to the lab's folder. `specpipe lab down`
    removes it all.

    Example:

        specpipe lab up --hosts 4 --link-delay-ms 11,8,3.4,19
    """
    from specpipe import settings
    from specpipe.swarm.redact import redact_url

    model_name = model_name or settings.default_model()
    the_lab, layers = bring_up(_home(home), hosts, idle, model_name, delays, port)
    state = the_lab.state
    for host in the_lab.hosts():
        serves = (
            f"layers {layers[host.index][0]}:{layers[host.index][1]}"
            if host.index < len(layers)
            else "idle"
        )
        tls = ", TLS" if host.tls else ""
        redis_url = f"Redis {redact_url(host.redis_url)}{tls}" if host.redis_url else "no Redis"
        click.echo(f"  {host.name}  {host.address}  {serves}  {redis_url}")
    click.echo(f"web {state['web_url']}  (SPECPIPE_HOME={the_lab.home})")


def bring_up(home: Path, hosts: int, idle: int, model_name: str, delays: list[float], port: int):
    """Bring up a lab in `home` serving `model_name` on `hosts` hosts, its store migrated;
    (the Lab, the layer ranges). One-line ClickExceptions, with nothing left up, on failure."""
    from models import migrate as migrations
    from specpipe.ops.lab_hosts import Lab
    from specpipe.ops.lab_network import LabError, check_can_run
    from specpipe.ops.redis_server import RedisUnavailable
    from specpipe.transformer.errors import ModelError
    from specpipe.transformer.resolve import even_split, open_checkpoint

    try:
        check_can_run()
    except (LabError, RedisUnavailable) as exc:
        raise click.ClickException(str(exc)) from None
    try:
        layers = even_split(open_checkpoint(model_name).config.n_layers, hosts)
    except ModelError as exc:
        raise ModelInputError(str(exc)) from None
    the_lab = Lab(home)
    try:
        state = the_lab.up(layers, model_name, idle=idle, link_delays_ms=delays)
        click.echo(f"lab {state['id']}: {hosts + idle} hosts on {state['subnet']}.0/24")
        migrations.upgrade(state["database_url"])
        the_lab.serve(model_name, web_port=port)
    except (LabError, RedisUnavailable) as exc:
        the_lab.down()
        raise click.ClickException(str(exc)) from None
    except BaseException:
        the_lab.down()
        raise
    return the_lab, layers


@lab.command(name="down")
@HOME_OPTION
def lab_down(home: Path | None) -> None:
    """Stop every process of the lab and remove its namespaces, links and bridge (also after
    a crash).

    Example:

        specpipe lab down
    """
    from specpipe.ops.lab_hosts import Lab
    from specpipe.ops.lab_network import LabError, check_can_run
    from specpipe.ops.redis_server import RedisUnavailable

    try:
        check_can_run()
    except (LabError, RedisUnavailable) as exc:
        raise click.ClickException(str(exc)) from None
    removed = Lab(_home(home)).down()
    click.echo(f"lab down: removed {', '.join(removed)}" if removed else "lab down: no lab here")


@lab.command(name="exec", context_settings={"ignore_unknown_options": True})
@click.argument("host")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@HOME_OPTION
def lab_exec(host: str, command: tuple[str, ...], home: Path | None) -> None:
    """Run COMMAND on HOST (h0, h1, …) of the lab: in its namespace, with the lab's
    environment (its Redis as REDIS_URL, host 0's as SPECPIPE_REGISTRY_URL: on another host,
    as host 0's user for other hosts), waiting for it.

    Example:

        specpipe lab exec h4 -- specpipe join --layers auto
    """
    import subprocess

    from specpipe.ops.lab_hosts import Lab

    the_lab = Lab(_home(home))
    found = [h for h in the_lab.hosts() if h.name == host]
    if not found:
        raise click.ClickException(f"no host {host!r} in the lab at {the_lab.home}")
    argv = ["ip", "netns", "exec", found[0].namespace, *command]
    raise SystemExit(subprocess.call(argv, env=the_lab.env(found[0])))
