"""`specpipe regression …`: the nightly lossless regression, on demand."""

from __future__ import annotations

import time

import click

from specpipe.cli.options import store_error


@click.group(name="regression")
def regression() -> None:
    """The nightly lossless regression."""


@regression.command(name="run")
@click.option(
    "--timeout",
    type=click.FloatRange(1, 86_400),
    default=3600,
    show_default=True,
    help="Seconds to wait for the verdict.",
)
def regression_run(timeout: float) -> None:
    """Run the nightly regression now and wait for its verdict.

    Enqueues `workers.regression.nightly` on the `nightly` queue (its worker, `specpipe worker
    nightly`, must be running; `specpipe up` runs one), waits for the run to be stored and
    prints its verdict, read from the store (DATABASE_URL); the last line is the run id. Each
    proof that did not pass is named on stderr, with its error.
    Exits 0 on pass, 1 otherwise.

    Example:

        specpipe regression run --timeout 1800
    """
    import redis

    from models.db import session_scope
    from models.proof_store import night_outcome
    from specpipe.settings import Settings
    from specpipe.swarm.redact import redact_url
    from workers.celery_app import celery
    from workers.names import NIGHTLY_QUEUE, NIGHTLY_TASK, manual_key

    settings = Settings.from_env()
    url = settings.redis_url
    key = manual_key()
    client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=5)
    try:
        client.ping()
        celery.send_task(NIGHTLY_TASK, kwargs={"key": key}, queue=NIGHTLY_QUEUE)
    except redis.RedisError as exc:
        raise click.ClickException(f"cannot reach Redis at {redact_url(url)}: {exc}") from None
    finally:
        client.close()
    click.echo(f"enqueued {NIGHTLY_TASK} ({key}); waiting up to {timeout:g} s", err=True)
    deadline = time.monotonic() + timeout
    outcome = None
    try:
        while outcome is None and time.monotonic() < deadline:
            with session_scope(settings.database_url) as session:
                outcome = night_outcome(session, key)
            if outcome is None:
                time.sleep(0.5)
    except Exception as exc:  # driver errors become one line
        raise store_error("read the run from the store", exc) from exc
    if outcome is None:
        raise click.ClickException(
            f"no verdict within {timeout:g} s (is a nightly worker running?)"
        )
    click.echo(f"verdict: {outcome['verdict']}")
    for kind, why in outcome["failed"].items():
        click.echo(f"  {kind}: {why}", err=True)
    click.echo(outcome["name"])
    if outcome["verdict"] != "pass":
        raise SystemExit(1)
