"""`specpipe bench ring`: its options and its report; its driver is
`specpipe.bench.ring_hops`."""

from __future__ import annotations

import click

from specpipe.cli.bench.reporting import model_errors
from specpipe.cli.options import (
    SEED,
    hop_delays_option,
    json_option,
    model_option,
    sampling_options,
    write_json,
)


@click.command(name="ring")
@model_option("Model to serve.")
@click.option(
    "--stages", type=click.IntRange(1, 16), default=4, show_default=True, help="Stage processes."
)
@click.option(
    "--tokens",
    type=click.IntRange(4, 4096),
    default=48,
    show_default=True,
    help="New tokens per generation.",
)
@hop_delays_option((0.0, 10.0, 25.0))
@sampling_options(0.7, 0.95, greedy=True)
@click.option("--seed", type=SEED, default=7, show_default=True)
@click.option("--draft-k", type=click.IntRange(1, 64), default=8, show_default=True)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="torch threads per process.",
)
@click.option(
    "--repeats",
    type=click.IntRange(1, 50),
    default=5,
    show_default=True,
    help="Runs of the overhead measurement; every round of every run counts.",
)
@json_option
@model_errors
def bench_ring(
    model, stages, tokens, delays, temp, top_p, top_k, seed, draft_k, threads, repeats, json_path
):
    """The ring's cost per hop, and speculative vs plain over slow links.

    Starts a private Redis and STAGES `specpipe worker stage` processes of MODEL, measures the
    overhead per hop against the same model in one process, then for each hop delay runs an
    input-grounded and an open-ended prompt speculative and plain.

    Example:

        specpipe bench ring --stages 4 --hop-delay-ms 0 --hop-delay-ms 25
    """
    from specpipe.bench import ring_hops as ringbench

    click.echo(f"bench ring: {model}, {stages} stages, {tokens} tokens, temp {temp}")
    result = {"overhead": ringbench.overhead(model, stages, tokens, threads, click.echo, repeats)}
    o = result["overhead"]
    low, high = o["overhead_per_hop_ms_interval"]
    click.echo(
        f"overhead per hop: {o['overhead_per_hop_ms']:.2f} ms (95% interval {low:.2f} to "
        f"{high:.2f}; target <= 1 ms); ring/local tok/s {o['tok_s_ratio_ring_vs_local']:.2f}; "
        f"same tokens {o['same_tokens']}"
    )
    click.echo(
        f"  per hop: {o['split_per_hop_ms']:.2f} ms from cutting the model into stages, "
        f"{o['slower_forwards_per_hop_ms']:.2f} ms from forwards slower in separate processes, "
        f"{o['transport_per_hop_ms']:.2f} ms transport and message handling"
    )
    from specpipe.transformer.resolve import open_checkpoint

    result["wire"] = ringbench.wire_costs(open_checkpoint(model).config.dim)
    for rows, us in result["wire"].items():
        click.echo(
            f"wire per hop, {rows.split('_')[0]}-row message: sealed and opened "
            f"{us['swarm key']:.0f} us; with the sender's signature and its check "
            f"{us['host identities']:.0f} us (+{us['signature']:.0f} us)"
        )
    params = {"temp": temp, "top_p": top_p, "top_k": top_k, "seed": seed}
    result["latency"] = ringbench.latency(
        model, stages, delays, tokens, params, draft_k, threads, click.echo
    )
    write_json(json_path, result)
