"""`specpipe bench exact`: its options and its report; its driver is
`specpipe.bench.ring_hops`."""

from __future__ import annotations

import click

from specpipe.cli.bench.reporting import model_errors
from specpipe.cli.options import (
    json_option,
    model_option,
    sampling_options,
    write_json,
)


@click.command(name="exact")
@model_option("Model to serve.")
@click.option("--stages", type=click.IntRange(1, 16), default=4, show_default=True)
@click.option(
    "--pairs",
    type=click.IntRange(1, 1000),
    default=20,
    show_default=True,
    help="(prompt, seed) pairs.",
)
@click.option("--tokens", type=click.IntRange(1, 4096), default=64, show_default=True)
@sampling_options(0.7, 0.95, greedy=True)
@click.option("--draft-k", type=click.IntRange(1, 64), default=8, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True)
@json_option
@model_errors
def bench_exact(model, stages, pairs, tokens, temp, top_p, top_k, draft_k, threads, json_path):
    """Exactness on real stage processes: speculative == plain for every (prompt, seed), and
    greedy through the ring == greedy in one process. Exits 1 on any difference.

    Example:

        specpipe bench exact --pairs 20 --tokens 64
    """
    from specpipe.bench import ring_hops as ringbench

    params = {"temp": temp, "top_p": top_p, "top_k": top_k}
    result = ringbench.exactness(model, stages, pairs, tokens, params, draft_k, threads, click.echo)
    greedy_ok = result["greedy_prompts"] - len(result["greedy_ring_vs_local_mismatches"])
    spec_ok = pairs - len(result["spec_vs_plain_mismatches"])
    click.echo(
        f"spec == plain: {spec_ok}/{pairs} pairs; greedy ring == local: {greedy_ok}/"
        f"{result['greedy_prompts']} prompts; verdict {result['verdict']}"
    )
    write_json(json_path, result)
    if result["verdict"] != "PASS":
        raise SystemExit(1)
