"""`specpipe up`: the whole swarm on this machine, as supervised child processes."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from specpipe.cli.checkpoints import ModelInputError
from specpipe.cli.options import dtype_option, model_option, store_error

if TYPE_CHECKING:
    from specpipe.ops.redis_server import RedisServer
    from specpipe.ops.supervisor import ProcessSpec


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@click.command(name="up")
@click.option(
    "--stages",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Stage workers, each serving an even share of the layers.",
)
@model_option(dest="model_name")
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=8000,
    show_default=True,
    help="Port of the web app (on 127.0.0.1).",
)
@dtype_option("Stages' compute dtype.")
@click.option(
    "--status-every",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="Seconds between status lines (0: only at start and on changes).",
)
def up(stages: int, model_name: str, port: int, dtype: str, status_every: float) -> None:
    """Run the swarm here: Redis, stage workers, coordinator, beat and the web app.

    Without REDIS_URL a private Redis is started on a free port, locked down: a password, and
    only the commands the swarm uses (SPECPIPE_REDIS_MAXMEMORY, default 2gb, bounds its memory).
    The swarm key, SECRET_KEY and the Redis passwords (this host's own, and the data-plane one
    its stages are dialled with) are made on first start and kept in the instance folder
    ($SPECPIPE_HOME, else ./instance), mode 0600; the store is migrated. Every
    process is restarted when it dies; Ctrl-C stops them all. Other commands (`specpipe
    generate`, `specpipe nodes`) find the swarm through instance/swarm.json.

    Example:

        specpipe up --stages 4 --port 8000
    """
    from specpipe import settings
    from specpipe.ops.redis_server import describe
    from specpipe.swarm.redact import redact_url

    home = settings.instance_dir()
    _refuse_a_second_swarm(home)
    split = _layer_split(model_name, stages)
    if not _port_free(port):
        raise click.ClickException(f"port {port} is in use: pass --port")

    home.mkdir(mode=0o700, parents=True, exist_ok=True)  # it holds the secrets
    settings.ensure_swarm_key()  # the children read it here, so `specpipe key rotate` reaches them
    pin = _coordinator_pin()
    secret_key = settings.ensure_secret_key()
    database_url = _migrated_store()
    redis_url, private_redis = _redis(home)

    # The stages' streams go over the private Redis's unix socket where it has one.
    data_url = (private_redis.socket_url if private_redis else None) or redis_url
    swarm = settings.swarm_name(running=False)  # not a name an earlier run recorded
    env = {
        "REDIS_URL": redis_url,
        "SPECPIPE_SWARM": swarm,
        "SECRET_KEY": secret_key,
        "DATABASE_URL": database_url,
        "SPECPIPE_HOME": str(home),
        # Every child pins this swarm's coordinator key, whatever TLS folder or pin the
        # environment `up` was started in names: without one, none would start.
        "SPECPIPE_COORDINATOR_PUB": pin,
        "SPECPIPE_MODEL": model_name,
        "PYTHONUNBUFFERED": "1",
    }
    host = socket.gethostname().split(".")[0] or "local"
    stage_nodes = {
        f"stage{i}": {"host": f"{host}-stage{i}", "layers": [a, b]}
        for i, (a, b) in enumerate(split)
    }
    threads = max(1, (os.cpu_count() or 1) // stages)
    # Its Redis (and registry) from the environment: a URL with a password stays off the
    # command line, which every user of the machine can read.
    specs = _stage_specs(stage_nodes, model_name, dtype, threads, {**env, "REDIS_URL": data_url})
    hosts = [node["host"] for node in stage_nodes.values()]
    specs = [*_redis_specs(private_redis, redis_url, swarm, hosts), *specs]
    specs += _service_specs(env, port)
    web_url = f"http://127.0.0.1:{port}/"
    state = {
        "redis_url": redis_url,
        "web_url": web_url,
        "swarm": swarm,
        "pid": os.getpid(),
        "model": model_name,
        "stages": stages,
        "stage_nodes": stage_nodes,  # each stage process's host and layer range, by name
        "database_url": database_url,
    }
    where = f"{'private ' if private_redis else ''}Redis {redact_url(redis_url)}"
    click.echo(f"specpipe up: {web_url}  ({stages} stages of {model_name}, {where})")
    if private_redis is not None:
        click.echo(f"specpipe up: runs {describe(private_redis.binary)} on loopback")
    _supervise(specs, state, status_every)


PYTHON = [sys.executable, "-m", "specpipe"]
QUIET = ["--loglevel", "WARNING"]


def _refuse_a_second_swarm(home: Path) -> None:
    from specpipe import settings
    from specpipe.ops.supervisor import process_alive

    previous = settings.swarm_file()
    if process_alive(previous.get("pid")) and previous.get("pid") != os.getpid():
        raise click.ClickException(
            f"a swarm already runs from {home} (pid {previous['pid']}, {previous.get('web_url')})"
        )


def _layer_split(model_name: str, stages: int) -> list[tuple[int, int]]:
    """The model's layers in `stages` even ranges; a model that cannot open is one line."""
    from specpipe.transformer.errors import ModelError
    from specpipe.transformer.resolve import even_split, open_checkpoint

    try:
        return even_split(open_checkpoint(model_name).config.n_layers, stages)
    except ModelError as exc:
        raise ModelInputError(str(exc)) from None


def _migrated_store() -> str:
    """The store's URL, migrated to the newest schema; an unreachable one is one line."""
    from models import migrate as migrations
    from specpipe import settings

    database_url = settings.database_url()
    try:
        migrations.upgrade(database_url)
    except Exception as exc:  # an unreachable or broken database is one line
        raise store_error("migrate the database", exc) from exc
    return database_url


def _redis(home: Path) -> tuple[str, RedisServer | None]:
    """The swarm's Redis: REDIS_URL's, checked, or a private one to start (its URL, and the
    server to supervise)."""
    from specpipe import settings
    from specpipe.ops.redis_server import RedisServer, RedisUnavailable, check_redis

    try:
        if settings.configured_redis_url():
            return check_redis(settings.configured_redis_url()), None
        # Supervised like the other processes, with its data in the instance folder: a Redis
        # that dies is started again on the same port and password, with what was queued.
        private_redis = RedisServer(
            data_dir=home / "redis",
            password=settings.ensure_local_redis_password(),
            maxmemory=settings.redis_maxmemory(),
            peer_password=settings.ensure_redis_password(),
            keeper_password=settings.ensure_keeper_password(),
        )
        return private_redis.url, private_redis
    except (RedisUnavailable, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


def _stage_specs(
    stage_nodes: dict[str, dict], model_name: str, dtype: str, threads: int, env: dict[str, str]
) -> list[ProcessSpec]:
    from specpipe.ops.supervisor import ProcessSpec

    return [
        ProcessSpec(
            name,
            [
                *PYTHON,
                "worker",
                "stage",
                "--host",
                node["host"],
                "--layers",
                "{}:{}".format(*node["layers"]),
                "--model",
                model_name,
                "--dtype",
                dtype,
                "--threads",
                str(threads),
            ],
            env,
        )
        for name, node in stage_nodes.items()
    ]


def _redis_specs(
    private_redis: RedisServer | None, redis_url: str, swarm: str, hosts: list[str]
) -> list[ProcessSpec]:
    """The private Redis's process (ready once it answers and every stage host is admitted
    under its own key), or none once the roster is published on the configured one (`up` is
    host 0 and its own operator: the keys and the roster live in its instance folder)."""
    from specpipe.ops.supervisor import ProcessSpec
    from specpipe.swarm.redact import redact_url

    if private_redis is None:
        if not _admit_own_hosts(redis_url, swarm, hosts):
            where = redact_url(redis_url)
            raise click.ClickException(f"cannot publish the hosts' roster at {where}")
        return []
    return [
        ProcessSpec(
            "redis",
            private_redis.argv(),
            ready=lambda: private_redis.answers() and _admit_own_hosts(redis_url, swarm, hosts),
            stop_last=True,
        )
    ]


def _service_specs(env: dict[str, str], port: int) -> list[ProcessSpec]:
    from specpipe.ops.supervisor import ProcessSpec

    return [
        ProcessSpec("coordinator", [*PYTHON, "worker", "coordinator", *QUIET], env),
        ProcessSpec("nightly", [*PYTHON, "worker", "nightly", *QUIET], env),
        ProcessSpec("beat", [*PYTHON, "worker", "beat", *QUIET], env),
        ProcessSpec("web", [*PYTHON, "web", "--port", str(port), "--no-migrate"], env),
    ]


def _supervise(specs: list[ProcessSpec], state: dict, status_every: float) -> None:
    """Record the swarm in the instance folder and run its processes until Ctrl-C (Redis
    starts first and stops last); the records go when they stop."""
    from specpipe import settings
    from specpipe.ops.supervisor import Supervisor

    home = settings.instance_dir()
    state_file = home / settings.SWARM_FILE
    # Owner-only: the Redis URL carries its password, the database URL may.
    settings.write_private(state_file, json.dumps(state, indent=2) + "\n")
    processes_file = home / settings.PROCESSES_FILE
    supervisor = Supervisor(
        specs,
        out=lambda line: click.echo(line),
        on_change=lambda pids: settings.write_private(processes_file, json.dumps(pids) + "\n"),
    )
    try:
        supervisor.run(status_every_s=status_every)
    finally:
        if settings.swarm_file().get("pid") == os.getpid():
            state_file.unlink(missing_ok=True)
            processes_file.unlink(missing_ok=True)
        click.echo("specpipe up: stopped")


def _coordinator_pin() -> str:
    """The public keys of the coordinator `up` keeps in its instance folder (made there on
    first start, with `coordinator.pub` beside it), as that file holds them; a file that cannot
    be read is one line."""
    from specpipe.ops import roster
    from specpipe.swarm import identity

    try:
        return identity.pin_text(roster.init_coordinator())
    except ValueError as exc:  # names the file, never what it holds
        raise click.ClickException(f"cannot read the coordinator's key: {exc}") from None


def _admit_own_hosts(redis_url: str, swarm: str, hosts: list[str]) -> bool:
    """`roster.admit_own_hosts` on the Redis at `redis_url`; False while it does not answer.
    A key or roster file in the instance folder that cannot be read is one line."""
    import redis

    from specpipe.ops import roster

    client = redis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=5)
    try:
        roster.admit_own_hosts(client, swarm, hosts)
    except redis.RedisError:
        return False
    except ValueError as exc:  # names the file, never what it holds
        raise click.ClickException(f"cannot admit the stages' keys: {exc}") from None
    finally:
        client.close()
    return True
