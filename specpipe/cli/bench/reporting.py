"""What every `specpipe bench` command does with its result: print the report and the verdict,
write the JSON, exit 1 unless it passed; and engine errors as one-line CLI errors."""

from __future__ import annotations

from pathlib import Path

import click

from specpipe.cli.options import write_json


def verdict(
    result: dict, lines: list[str], json_path: Path | None, say_verdict: bool = True
) -> None:
    """Print a bench's report (and its verdict line), write its JSON, exit 1 unless it passed."""
    for line in lines:
        click.echo(line)
    if say_verdict:
        click.echo(f"verdict {result['verdict']}")
    write_json(json_path, result)
    if result["verdict"] != "PASS":
        raise SystemExit(1)


def model_errors(func):
    """Turn engine errors about the model or Redis into one-line CLI errors."""
    import functools

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        from specpipe.ops.redis_server import RedisUnavailable

        try:
            return func(*args, **kwargs)
        except (ValueError, RedisUnavailable, RuntimeError) as exc:  # ModelError is a ValueError
            raise click.ClickException(str(exc)) from None

    return wrapper
