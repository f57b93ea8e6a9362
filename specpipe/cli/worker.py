"""`specpipe worker …`: run one process of the swarm (a stage, the coordinator, the nightly
lane, or beat)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from specpipe.cli.checkpoints import ModelInputError
from specpipe.cli.options import compute_options, layer_range, model_option
from specpipe.settings import DEFAULT_HEARTBEAT_S

if TYPE_CHECKING:
    from specpipe.settings import Settings
    from specpipe.swarm.stage.samplers import TailSampling
    from specpipe.swarm.stage.sending import Link, Sender
    from specpipe.swarm.wire import Keyring


# The swarm's workers need nothing of each other over the broker: no gossip (its restart after
# a lost broker connection can end the worker with "Unrecoverable error: AttributeError"), no
# mingle at start, no event heartbeats.
ALONE = ("--without-gossip", "--without-mingle", "--without-heartbeat")


@click.group(name="worker")
def worker() -> None:
    """Run one swarm process: a stage, the coordinator, the nightly lane or the beat scheduler."""


@worker.command(name="stage")
@click.option("--host", required=True, help="This stage's name in the inventory (unique).")
@click.option(
    "--layers",
    required=True,
    callback=layer_range,
    help="Layer range A:B (half-open) this stage serves.",
)
@model_option(dest="model_name")
@click.option(
    "--redis",
    "redis_url",
    default=None,
    help="This host's Redis (its input stream; its record in the inventory gives the address "
    "without user or password); default: REDIS_URL.",
)
@click.option(
    "--registry",
    "registry_url",
    default=None,
    help="The Redis holding the inventory; default: SPECPIPE_REGISTRY_URL, else --redis.",
)
@click.option("--public-ip", default="", help="Public IP to record in the inventory.")
@click.option("--geo", default="", help="Location label to record (e.g. WA).")
@compute_options
@click.option(
    "--heartbeat-s",
    type=click.FloatRange(min=0.1),
    default=DEFAULT_HEARTBEAT_S,
    show_default=True,
    help="Seconds between inventory heartbeats; a coordinator with a spare for this "
    "stage's layers re-routes after three missed beats.",
)
@click.option(
    "--session-idle-s",
    type=click.FloatRange(min=1),
    default=600.0,
    show_default=True,
    help="Free a session's caches after this long without a message.",
)
@click.option(
    "--draft-head",
    default=None,
    metavar="PATH|none",
    help="The tail's draft head: a head file of ours, or a folder holding a released EAGLE-3 "
    "head [default: the one shipped for the model, if any].",
)
def worker_stage(
    host: str,
    layers: tuple[int, int],
    model_name: str,
    redis_url: str | None,
    registry_url: str | None,
    public_ip: str,
    geo: str,
    dtype: str,
    device: str,
    threads: int | None,
    heartbeat_s: float,
    session_idle_s: float,
    draft_head: str | None,
) -> None:
    """Serve one layer range of the model from this host's Redis stream.

    Loads only its own layers, registers in the inventory, heartbeats, and serves rounds until
    Ctrl-C or SIGTERM. One process: nothing that holds the model is forked.

    Example:

        SPECPIPE_SWARM_KEY=... specpipe worker stage --host wa --layers 0:9 --geo WA
    """
    from specpipe import settings

    serve_stage(
        host,
        layers,
        model_name,
        redis_url=redis_url or settings.redis_url(),
        registry_url=registry_url or settings.registry_url(),
        public_ip=public_ip,
        geo=geo,
        dtype=dtype,
        device=device,
        threads=threads,
        heartbeat_s=heartbeat_s,
        session_idle_s=session_idle_s,
        draft_head=draft_head,
    )


def serve_stage(
    host: str,
    layers: tuple[int, int],
    model_name: str,
    *,
    redis_url: str,
    registry_url: str | None,
    public_ip: str = "",
    geo: str = "",
    dtype: str = "float32",
    device: str = "cpu",
    threads: int | None = None,
    heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    session_idle_s: float = 600.0,
    config: Settings | None = None,
    draft_head: str | None = None,
    wrap_sender: Callable[[Sender], Link] | None = None,
) -> None:
    """Load layers `layers` of `model_name`, register as `host` and serve until SIGINT or
    SIGTERM (what `worker stage` and `join` run), sending through what `wrap_sender` wraps the
    stage's `Sender` in, if given. One-line ClickExceptions for what is wrong."""
    import torch

    from specpipe import settings
    from specpipe.drafting.head import DraftHeadError, load_with_head
    from specpipe.swarm import inventory, trust
    from specpipe.swarm.dialing import own_peering
    from specpipe.swarm.stage.worker import WorkerConfig, run
    from specpipe.transformer.errors import ModelError
    from specpipe.transformer.layer_range import load_stage
    from specpipe.transformer.resolve import model_label, open_checkpoint

    config = config or settings.Settings.from_env()
    if not config.swarm_key and config.coordinator_public_key is None:
        raise click.ClickException(
            "no swarm key: set SPECPIPE_SWARM_KEY (or run `specpipe up`, which keeps one)"
        )
    try:
        settings.kv_budget_tokens()
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    configure_logging()
    keys = swarm_keyring(config, host)  # refused here, before anything is loaded or started
    if registry_url:  # another host's registry, dialled as this host's own user there
        registry_url = trust.registry_url(config, host, registry_url)
    for url in {redis_url, registry_url or redis_url}:
        check_reachable(url, "Redis")
    if threads:
        torch.set_num_threads(threads)
    start, end = layers
    try:
        checkpoint = open_checkpoint(model_name)
        label = model_label(model_name)

        def load(**options):
            return [load_stage(checkpoint, start, end, dtype=dtype, device=device, **options)]

        (stage,), head = load_with_head(load, draft_head, label, checkpoint)
    except (ModelError, DraftHeadError) as exc:
        raise ModelInputError(str(exc)) from None
    node = inventory.NodeInfo(
        host=host,
        layer_start=start,
        layer_end=end,
        redis_url=redis_url,
        model=label,
        public_ip=public_ip,
        geo=geo,
        **inventory.hardware(),
    )
    click.echo(f"stage {host}: layers {start}:{end} of {label}, swarm {config.swarm!r}")
    run(
        stage,
        WorkerConfig(
            host=host,
            swarm=config.swarm,
            keys=keys,
            reload_keys=lambda: _reloaded_keyring(config, host),
            redis_url=redis_url,
            registry_url=registry_url,
            heartbeat_s=heartbeat_s,
            session_idle_s=session_idle_s,
            wrap_sender=wrap_sender,
            tail_sampling=tail_sampling(),
            redis_password=config.redis_password,
            tls_ca=config.tls_ca,
            peering=own_peering(config, host),
            keeper_url=keeper_url(config, redis_url, registry_url),
        ),
        node,
        head,
    )


def keeper_url(config: Settings, redis_url: str, registry_url: str | None) -> str | None:
    """The stage's own Redis as its keeper, who makes the other hosts' users there: where this
    host's instance folder holds a keeper password and the Redis is not the registry (whose
    users host 0 keeps)."""
    from specpipe import settings
    from specpipe.ops.redis_server import KEEPER_USER
    from specpipe.swarm.credentials import with_user
    from specpipe.swarm.redact import without_credentials

    password = settings.keeper_password(config.home)
    bare = without_credentials(redis_url)
    if not password or not registry_url or without_credentials(registry_url) == bare:
        return None
    return with_user(bare, KEEPER_USER, password)


@worker.command(name="coordinator")
@click.option("--queue", help="Celery queue to serve [default: coordinator].")
@click.option("--loglevel", default="INFO", show_default=True, help="Celery log level.")
def worker_coordinator(queue: str | None, loglevel: str) -> None:
    """Run the coordinator: the Celery worker that runs jobs, up to SPECPIPE_MAX_SESSIONS (8)
    at once on threads, each its own session through the ring (JSON messages only).

    Example:

        REDIS_URL=redis://127.0.0.1:6379/0 specpipe worker coordinator
    """
    from specpipe import settings
    from specpipe.swarm.identity import COORDINATOR
    from workers.names import COORDINATOR_QUEUE

    try:
        sessions = settings.max_sessions()
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    celery = _celery_app(signer=COORDINATOR)
    queue = queue or COORDINATOR_QUEUE
    # Threads: a job spends its time waiting on the ring, and the jobs share one tokenizer.
    celery.worker_main(
        [
            "worker",
            "--pool=threads",
            f"--concurrency={sessions}",
            "-Q",
            queue,
            "-n",
            f"{queue}@%h",
            *ALONE,
            f"--loglevel={loglevel}",
        ]
    )


@worker.command(name="nightly")
@click.option("--loglevel", default="INFO", show_default=True, help="Celery log level.")
def worker_nightly(loglevel: str) -> None:
    """Run the nightly regression's lane: a Celery worker on queue `nightly`, one run at a time.

    The regression gets its own worker so that it neither waits behind queued jobs nor takes
    a job's session; its sessions share the stages with the jobs'. Run it beside the
    coordinator (`specpipe up` does).

    Example:

        REDIS_URL=redis://127.0.0.1:6379/0 specpipe worker nightly
    """
    from specpipe.swarm.identity import COORDINATOR
    from workers.names import NIGHTLY_QUEUE

    celery = _celery_app(signer=COORDINATOR)
    celery.worker_main(
        [
            "worker",
            "--pool=solo",
            "-Q",
            NIGHTLY_QUEUE,
            "-n",
            f"{NIGHTLY_QUEUE}@%h",
            *ALONE,
            f"--loglevel={loglevel}",
        ]
    )


@worker.command(name="beat")
@click.option("--loglevel", default="INFO", show_default=True, help="Celery log level.")
def worker_beat(loglevel: str) -> None:
    """Run Celery beat: stalled-job recovery, inventory sync and the nightly regression.

    Its schedule file lives in the instance folder.

    Example:

        specpipe worker beat
    """
    from specpipe import settings

    celery = _celery_app()
    home = settings.instance_dir()
    home.mkdir(parents=True, exist_ok=True)
    celery.start(["beat", "-s", str(home / "celerybeat-schedule"), f"--loglevel={loglevel}"])


def _celery_app(signer: str | None = None):
    """The Celery app, once this process's keys pass (`swarm_keyring`, signing as `signer`) and
    its broker answers."""
    from specpipe import settings

    configure_logging()
    swarm_keyring(settings.Settings.from_env(), signer)
    check_reachable(settings.redis_url(), "the broker Redis")
    from workers.celery_app import celery

    return celery


def configure_logging() -> None:
    """A stage process's log: INFO and up, timed, to stderr (a no-op once it is set up)."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")


def check_reachable(url: str, what: str) -> None:
    """A one-line ClickException unless the Redis at `url` answers a ping."""
    import redis

    from specpipe.swarm.redact import redact_url

    client = redis.Redis.from_url(url, socket_connect_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise click.ClickException(f"cannot reach {what} at {redact_url(url)}: {exc}") from None
    finally:
        client.close()


def tail_sampling() -> TailSampling:
    """How a stage worker's tail samples: always the exact samplers each session's parameters
    name. Nothing here swaps them: a test double comes in through `WorkerConfig.tail_sampling`,
    set by the test's own launcher."""
    from specpipe.swarm.stage.samplers import TailSampling

    return TailSampling()


def swarm_keyring(config: Settings, signer: str | None = None) -> Keyring:
    """`trust.keyring` (signing as `signer`), what a swarm process starts with: its refusal (no
    swarm key, no pinned coordinator key without the opt-out) a one-line ClickException."""
    from specpipe.swarm import trust

    try:
        return trust.keyring(config, signer)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


def _reloaded_keyring(config: Settings, host: str) -> Keyring:
    """Stage `host`'s keyring with the swarm keys as they are now (a rotation may have changed
    them), pinning what `config` pins."""
    from dataclasses import replace

    from specpipe import settings
    from specpipe.swarm import trust

    fresh = settings.Settings.from_env()
    keys = replace(config, swarm_key=fresh.swarm_key, old_swarm_keys=fresh.old_swarm_keys)
    return trust.keyring(keys, host)
