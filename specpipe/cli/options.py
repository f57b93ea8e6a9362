"""Option sets shared by several commands, bundled as decorators, the seed's type, and a JSON
writer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import click

from specpipe.core.sampling import MAX_SEED

# Every --seed takes what the sampler, the web form, the APIs and the store take.
SEED = click.IntRange(0, MAX_SEED)
# The released models whose layout `specpipe.transformer.synth` copies (its `LIKE`), without
# loading it.
RELEASED_LAYOUTS = ("gpt-oss-120b", "gpt-oss-20b")


def model_option(
    help_text: str = "Model.", *, dest: str = "model"
) -> Callable[[Callable], Callable]:
    """--model: a checkpoint's name or path, `default` (the default model) unless given; its
    value goes to the parameter `dest`."""
    return click.option("--model", dest, default="default", show_default=True, help=help_text)


DTYPES = ["float32", "bfloat16", "float16"]


def dtype_option(help_text: str = "Compute dtype.") -> Callable[[Callable], Callable]:
    """--dtype: the dtype a stage computes in."""
    return click.option(
        "--dtype", type=click.Choice(DTYPES), default="float32", show_default=True, help=help_text
    )


def compute_options(func: Callable) -> Callable:
    """--dtype, --device and --threads: where and how a process runs its stages."""
    func = click.option(
        "--threads",
        type=click.IntRange(min=1),
        default=None,
        help="CPU threads for torch (default: torch's choice).",
    )(func)
    func = click.option("--device", default="cpu", show_default=True, help="cpu or cuda[:N].")(func)
    return dtype_option()(func)


def hop_delays_option(default: tuple[float, ...]) -> Callable[[Callable], Callable]:
    """--hop-delay-ms (repeatable), into `delays`: the simulated one-way latencies per hop a
    benchmark runs at, each in turn."""
    return click.option(
        "--hop-delay-ms",
        "delays",
        type=click.FloatRange(0, 10_000),
        multiple=True,
        default=default,
        show_default=True,
        help="Simulated one-way latency per hop; repeat for several.",
    )


def sampling_options(
    temp: float, top_p: float, *, greedy: bool, what: str = ""
) -> Callable[[Callable], Callable]:
    """--temp, --top-p and --top-k with this command's defaults.

    `greedy`: whether temperature 0 (greedy) is allowed; proofs that compare distributions
    need a temperature above 0. `what` names the runs the options apply to, for the help."""
    runs = f" of {what}" if what else ""
    temp_type = click.FloatRange(min=0) if greedy else click.FloatRange(0, 100, min_open=True)
    options = [
        click.option(
            "--temp",
            type=temp_type,
            default=temp,
            show_default=True,
            help=f"Temperature{runs} ({'0: greedy' if greedy else 'above 0'}).",
        ),
        click.option(
            "--top-p",
            type=click.FloatRange(0, 1, min_open=True),
            default=top_p,
            show_default=True,
            help=f"Top-p{runs}, in (0, 1] (1: off).",
        ),
        click.option(
            "--top-k",
            type=click.IntRange(min=0),
            default=0,
            show_default=True,
            help=f"Keep the k most likely tokens{runs} (0: off).",
        ),
    ]

    def decorate(func: Callable) -> Callable:
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


def json_option(func: Callable) -> Callable:
    """--json PATH: where to write the full result document."""
    return click.option(
        "--json",
        "json_path",
        type=click.Path(dir_okay=False, writable=True, path_type=Path),
        help="Write the full result document here.",
    )(func)


def write_json(json_path: Path | None, result: dict) -> None:
    """Write `result` to `json_path` (nothing when None); one-line error if it cannot."""
    if not json_path:
        return
    try:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    except OSError as exc:
        raise click.ClickException(f"cannot write {json_path}: {exc.strerror}") from None
    click.echo(f"wrote {json_path}")


def store_error(action: str, exc: BaseException) -> click.ClickException:
    """One readable line for a store that failed under a command: what could not be done, the
    database's own first line (passwords hidden), and a hint when the schema is missing."""
    from specpipe.swarm.redact import one_line_reason

    reason = one_line_reason(exc)
    if "no such table" in reason or "UndefinedTable" in reason or "does not exist" in reason:
        reason += " (is the database migrated? `specpipe db upgrade`)"
    return click.ClickException(f"could not {action}: {reason}")


def store_session():
    """A session on the store the settings name (the composition root opens it: `specpipe/`
    itself imports nothing of `models/`)."""
    from models.db import make_session_factory
    from specpipe.settings import database_url

    return make_session_factory(database_url())()


def layer_range(_ctx, _param, value: str) -> tuple[int, int]:
    """A click callback: `A:B` as the layer range (A, B), A below B."""
    start, sep, end = value.partition(":")
    if not sep or not start.strip().isdigit() or not end.strip().isdigit():
        raise click.BadParameter(f"{value!r} is not A:B (two layer numbers)")
    a, b = int(start), int(end)
    if a >= b:
        raise click.BadParameter(f"{value!r} is empty or reversed: A must be below B")
    return a, b
