"""`specpipe bench taps`: its options and its report; its driver is
`specpipe.bench.taps`."""

from __future__ import annotations

import click

from specpipe.cli.options import (
    json_option,
    write_json,
)


@click.command(name="taps")
@click.option(
    "--rows",
    type=click.IntRange(1, 512),
    default=5,
    show_default=True,
    help="Rows of a decode round (draft K + 1).",
)
@click.option(
    "--mbit-s",
    type=click.FloatRange(min=0.1),
    default=100.0,
    show_default=True,
    help="A link's bandwidth, to price the bytes the taps add.",
)
@json_option
def bench_taps(rows, mbit_s, json_path):
    """What an EAGLE-3 head's taps add to a round on the wire: sealed round messages of each
    hop, with and without them, for the default model and gpt-oss-120b's shapes.

    Example:

        specpipe bench taps --rows 5 --mbit-s 100
    """
    from specpipe.bench import taps

    result = [taps.measure(shape, rows, mbit_s) for shape in taps.shapes()]
    for line in taps.report(result):
        click.echo(line)
    write_json(json_path, result)
