"""`specpipe bench load`: its options and its report; its driver is
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


@click.command(name="load")
@model_option("Model to serve.")
@click.option(
    "--stages", type=click.IntRange(1, 16), default=4, show_default=True, help="Stage processes."
)
@click.option(
    "--jobs",
    "counts",
    type=click.IntRange(1, 64),
    multiple=True,
    default=(1, 2, 4, 8),
    show_default=True,
    help="Jobs at once; repeat for several.",
)
@hop_delays_option((0.0, 25.0))
@click.option(
    "--tokens",
    type=click.IntRange(4, 4096),
    default=48,
    show_default=True,
    help="New tokens per job.",
)
@click.option("--temp", type=click.FloatRange(min=0), default=0.7, show_default=True)
@click.option(
    "--top-p", type=click.FloatRange(0, 1, min_open=True), default=0.95, show_default=True
)
@click.option(
    "--draft-k",
    type=click.IntRange(0, 64),
    default=4,
    show_default=True,
    help="The most drafts a round sends.",
)
@click.option(
    "--fixed-k",
    is_flag=True,
    help="Every round sends what the drafter has, up to --draft-k, instead of the "
    "draft length the coordinator would choose.",
)
@click.option("--seed", type=SEED, default=1, show_default=True)
@json_option
@model_errors
def bench_load(
    model, stages, counts, delays, tokens, temp, top_p, draft_k, fixed_k, seed, json_path
):
    """Several jobs at once through one ring: aggregate tok/s, time to first token and to done,
    and every job's tokens against its solo run.

    Example:

        specpipe bench load --jobs 1 --jobs 8 --hop-delay-ms 0 --hop-delay-ms 25
    """
    from specpipe.bench import load as loadbench

    counts = sorted(set(counts))
    click.echo(
        f"bench load: {model}, {stages} stages, {tokens} tokens per job, temp {temp}, "
        f"{'fixed' if fixed_k else 'adaptive'} K <= {draft_k}"
    )
    result = loadbench.load(
        model,
        stages,
        counts,
        delays,
        tokens,
        temp,
        top_p,
        draft_k,
        seed,
        click.echo,
        adaptive=not fixed_k,
    )
    write_json(json_path, result)
    if not all(row["identical_to_solo"] for row in result["runs"]):
        raise click.ClickException("a loaded job's tokens differ from its solo run")
