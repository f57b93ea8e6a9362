"""`specpipe bench stage-memory`: its options and its report; its driver is
`specpipe.bench.stage_memory`."""

from __future__ import annotations

from pathlib import Path

import click

from specpipe.cli.bench.reporting import verdict
from specpipe.cli.options import (
    RELEASED_LAYOUTS,
    json_option,
    layer_range,
)


@click.command(name="stage-memory")
@click.option(
    "--like",
    type=click.Choice(RELEASED_LAYOUTS),
    default="gpt-oss-120b",
    show_default=True,
    help="The released model whose stages to make and load (random weights, its layout).",
)
@click.option(
    "--layers",
    "ranges",
    multiple=True,
    callback=lambda ctx, param, values: tuple(layer_range(ctx, param, v) for v in values),
    help="A stage's layers A:B (repeatable) [default: 0:9, 9:18 and 27:36].",
)
@click.option("--card-gib", type=click.FloatRange(min=1), default=24.0, show_default=True)
@click.option(
    "--reserve-gib",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="Memory of the card kept for activations and the runtime.",
)
@click.option(
    "--sessions",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Sessions sharing the KV budget.",
)
@click.option(
    "--dir",
    "workdir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the checkpoints are made (they take the stages' size on disk) [default: a "
    "temporary folder].",
)
@click.option("--keep", is_flag=True, help="Keep the checkpoints made (a later run reuses them).")
@json_option
def bench_stage_memory(like, ranges, card_gib, reserve_gib, sessions, workdir, keep, json_path):
    """What one stage of a real-size model holds: weights, RSS, load time, KV per token, and
    the context it leaves on a card, range by range (the tail with a draft head).

    Makes each range's checkpoint with `specpipe model synth` (no download; gpt-oss-120b's 9
    layers take about 15 GiB of disk) and loads it in a child process in bf16 as a GPU would
    hold it. PASS when every stage fits the card.

    Example:

        specpipe bench stage-memory --like gpt-oss-120b --card-gib 24 --sessions 8
    """
    from specpipe.bench import stage_memory

    result = stage_memory.run(
        like,
        ranges or stage_memory.RANGES,
        card_gib=card_gib,
        reserve_gib=reserve_gib,
        sessions=sessions,
        workdir=workdir,
        keep=keep,
        progress=click.echo,
    )
    result["verdict"] = "PASS" if all(r["budget"]["fits"] for r in result["stages"]) else "FAIL"
    verdict(result, [], json_path)
