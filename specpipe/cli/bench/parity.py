"""`specpipe bench parity`: its options and its report; its driver is
`specpipe.bench.parity`."""

from __future__ import annotations

import click

from specpipe.cli.bench.reporting import verdict
from specpipe.cli.options import (
    RELEASED_LAYOUTS,
    json_option,
)


@click.command(name="parity")
@click.option(
    "--like",
    type=click.Choice(RELEASED_LAYOUTS),
    default="gpt-oss-20b",
    show_default=True,
    help="The released layout, cut to its first layers (the 20b's layers have the 120b's "
    "shapes, with 32 experts instead of 128).",
)
@click.option("--n-layers", type=click.IntRange(1, 36), default=2, show_default=True)
@click.option("--tokens", type=click.IntRange(1, 512), default=12, show_default=True)
@click.option(
    "--steps",
    type=click.IntRange(0, 256),
    default=8,
    show_default=True,
    help="Greedy tokens decoded one at a time after the prompt.",
)
@json_option
def bench_parity(like, n_layers, tokens, steps, json_path):
    """Our stages against transformers' GptOss at gpt-oss's real shapes, on the CPU: logits of
    a prompt within the tiny fixtures' tolerance, and the same greedy tokens (random MXFP4
    weights; needs transformers, as `make install` puts it). Two layers of gpt-oss-20b's
    shapes took 21 GB of memory at the peak, and about two minutes.

    Example:

        specpipe bench parity --like gpt-oss-20b --n-layers 2
    """
    try:
        from specpipe.bench import parity
    except ImportError as exc:  # transformers is a test dependency
        raise click.ClickException(f"bench parity needs transformers: {exc}") from None
    result = parity.run(like, n_layers, tokens, steps)
    lines = [
        f"{like} cut to {n_layers} layers ({result['checkpoint_bytes'] / 2**30:.2f} GiB), "
        f"{tokens} prompt tokens: max |ours - transformers| {result['max_abs_diff']:.2e} "
        f"(tolerance {result['tolerance']:g}, logits up to {result['logits_scale']:.2f}), "
        f"argmax identical: {result['argmax_identical']}",
        f"greedy {steps} tokens: ours {result['greedy_ours']}, transformers "
        f"{result['greedy_transformers']}",
        f"seconds: {result['seconds']}",
    ]
    verdict(result, lines, json_path)
