"""`specpipe bench web`: its options and its report; its driver is
`specpipe.bench.web_load`."""

from __future__ import annotations

from pathlib import Path

import click

from specpipe.cli.options import (
    json_option,
    write_json,
)


@click.command(name="web")
@click.option(
    "--streams",
    type=click.IntRange(0, 500),
    default=50,
    show_default=True,
    help="Streamed /v1 completions held open.",
)
@click.option(
    "--waits",
    type=click.IntRange(0, 500),
    default=20,
    show_default=True,
    help="Non-streamed /v1 completions left waiting.",
)
@click.option(
    "--logins",
    type=click.IntRange(1, 1000),
    default=20,
    show_default=True,
    help="GET /login timed while they are open.",
)
@click.option(
    "--users",
    type=click.IntRange(1, 100),
    default=10,
    show_default=True,
    help="Users the completions are spread over.",
)
@json_option
def bench_web(streams: int, waits: int, logins: int, users: int, json_path: Path | None) -> None:
    """The login page's time while /v1 completions are open: a fresh `specpipe web` (waitress,
    a private Redis, no coordinator, so every job stays queued) holds STREAMS streamed and
    WAITS waiting completions; GET /login must answer within 1 s. Exits 1 when it does not.

    Example:

        specpipe bench web --streams 50 --waits 20
    """
    from specpipe.bench import web_load

    try:
        result = web_load.run(streams, waits, logins, users, log=click.echo)
    except (RuntimeError, OSError) as exc:  # RedisUnavailable is a RuntimeError
        raise click.ClickException(str(exc)) from None
    write_json(json_path, result.to_json())
    opened, asked = result.streams_open + result.waits_open, streams + waits
    if opened < asked:
        raise click.ClickException(
            f"only {opened} of {asked} completions stayed open (SPECPIPE_OPEN_COMPLETIONS and "
            "SPECPIPE_OPEN_COMPLETIONS_PER_USER bound them)"
        )
    if not result.passed:
        raise click.ClickException(
            f"GET /login took up to {result.login_max_ms:.0f} ms "
            f"({result.login_failures} unanswered): over the {web_load.TARGET_MS:.0f} ms target"
        )
