"""`specpipe bench adaptive-k`: its options and its report; its driver is
`specpipe.bench.load`."""

from __future__ import annotations

import click

from specpipe.cli.bench.reporting import model_errors
from specpipe.cli.options import (
    SEED,
    hop_delays_option,
    json_option,
    model_option,
    write_json,
)


@click.command(name="adaptive-k")
@model_option("Model to serve.")
@click.option(
    "--stages", type=click.IntRange(1, 16), default=4, show_default=True, help="Stage processes."
)
@hop_delays_option((0.0, 25.0))
@click.option(
    "--k",
    "fixed",
    type=click.IntRange(1, 64),
    multiple=True,
    default=(2, 4, 8),
    show_default=True,
    help="Fixed draft lengths to compare; repeat for several.",
)
@click.option(
    "--max-k",
    type=click.IntRange(1, 64),
    default=8,
    show_default=True,
    help="The adaptive rule's largest K (a job's draft_k).",
)
@click.option(
    "--tokens",
    type=click.IntRange(4, 4096),
    default=64,
    show_default=True,
    help="New tokens per job.",
)
@click.option("--temp", type=click.FloatRange(min=0), default=0.7, show_default=True)
@click.option(
    "--top-p", type=click.FloatRange(0, 1, min_open=True), default=0.95, show_default=True
)
@click.option("--seed", type=SEED, default=1, show_default=True)
@click.option(
    "--repeats",
    type=click.IntRange(1, 50),
    default=2,
    show_default=True,
    help="Seeds per prompt; each runs every method.",
)
@json_option
@model_errors
def bench_adaptive_k(
    model, stages, delays, fixed, max_k, tokens, temp, top_p, seed, repeats, json_path
):
    """Adaptive draft length against plain decoding and fixed K, on a grounded and a novel
    prompt, at each hop delay: tok/s and the ratios, measured side by side in one run, and
    every method's tokens against plain's.

    Example:

        specpipe bench adaptive-k --hop-delay-ms 0 --hop-delay-ms 25 --k 2 --k 4 --k 8
    """
    from specpipe.bench import load as loadbench

    click.echo(f"bench adaptive-k: {model}, {stages} stages, {tokens} tokens per job, temp {temp}")
    result = loadbench.adaptive_k(
        model, stages, delays, fixed, max_k, tokens, temp, top_p, seed, repeats, click.echo
    )
    write_json(json_path, result)
    if not result["identical_to_plain"]:
        raise click.ClickException("a method's tokens differ from plain decoding's")
