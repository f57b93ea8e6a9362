"""`specpipe bench conversation`: its options and its report; its driver is
`specpipe.bench.conversation`."""

from __future__ import annotations

import click

from specpipe.cli.bench.reporting import model_errors, verdict
from specpipe.cli.options import (
    SEED,
    hop_delays_option,
    json_option,
    model_option,
    sampling_options,
)
from specpipe.settings import JOB_DEFAULTS


@click.command(name="conversation")
@model_option("Model to serve.")
@click.option(
    "--stages", type=click.IntRange(1, 16), default=4, show_default=True, help="Stage processes."
)
@hop_delays_option((0.0, 25.0))
@click.option(
    "--turns", type=click.IntRange(2, 64), default=6, show_default=True, help="Turns of the chat."
)
@click.option(
    "--context-tokens",
    type=click.IntRange(16, 1_000_000),
    default=3000,
    show_default=True,
    help="The first turn's context at least: a long document and a question about it.",
)
@click.option(
    "--tokens",
    type=click.IntRange(1, 4096),
    default=48,
    show_default=True,
    help="New tokens per turn at most.",
)
@sampling_options(JOB_DEFAULTS["temp"], JOB_DEFAULTS["top_p"], greedy=True)
@click.option(
    "--draft-k",
    type=click.IntRange(0, 64),
    default=JOB_DEFAULTS["draft_k"],
    show_default=True,
    help="The most drafts a round sends (each round's K is chosen, as a job's).",
)
@click.option("--seed", type=SEED, default=1, show_default=True)
@click.option(
    "--target-ratio",
    type=click.FloatRange(0, min_open=True),
    default=0.25,
    show_default=True,
    help="From turn 2 on, the most a warm turn's time to first token may be of the cold one's.",
)
@json_option
@model_errors
def bench_conversation(
    model,
    stages,
    delays,
    turns,
    context_tokens,
    tokens,
    temp,
    top_p,
    top_k,
    draft_k,
    seed,
    target_ratio,
    json_path,
):
    """A chat whose first turn carries a long document, each turn with prefix reuse and
    without, side by side: time to first token and total time per turn, at each link delay.

    Every turn runs cold (its whole context prefilled) and warm (from the cache the last warm
    turn kept, found in the prefix directory as the coordinator finds it), with the same seed.
    Exits 1 unless both commit the same tokens at every turn, every later turn reused a prefix,
    and from turn 2 on the warm turn's time to first token is at most --target-ratio of the
    cold one's at every delay.

    Example:

        specpipe bench conversation --hop-delay-ms 0 --hop-delay-ms 25 --json conversation.json
    """
    from specpipe.bench import conversation as conversationbench
    from specpipe.core.sampling import SamplingParams

    params = SamplingParams(
        temp=temp, top_p=top_p, top_k=top_k, seed=seed, sampler=JOB_DEFAULTS["sampler"]
    )
    plan = conversationbench.Plan(turns, context_tokens, tokens, params, draft_k)
    click.echo(
        f"bench conversation: {model}, {stages} stages, {turns} turns, at "
        + ", ".join(f"{d:g}" for d in delays)
        + " ms per hop"
    )
    result = conversationbench.conversation(model, stages, delays, plan, target_ratio, click.echo)
    verdict(result, conversationbench.report(result), json_path)
