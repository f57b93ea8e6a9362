"""`specpipe bench draft-head`: its options and its report; its driver is
`specpipe.bench.load`."""

from __future__ import annotations

from pathlib import Path

import click

from specpipe.cli.bench.reporting import model_errors
from specpipe.cli.options import (
    hop_delays_option,
    json_option,
    model_option,
    sampling_options,
    write_json,
)


@click.command(name="draft-head")
@model_option("The target model.")
@click.option(
    "--head",
    "head_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The head file (default: the one shipped for the model).",
)
@click.option(
    "--k",
    "draft_k",
    type=click.IntRange(1, 16),
    default=5,
    show_default=True,
    help="Drafts per round (the tail's cost); the largest K on the ring.",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Timings per figure (the median is shown).",
)
@sampling_options(0.7, 0.95, greedy=False, what="the tail's cost")
@click.option(
    "--ring/--no-ring",
    default=True,
    show_default=True,
    help="Also run jobs on real stage processes: head, n-gram and both vs plain.",
)
@click.option(
    "--stages",
    type=click.IntRange(1, 16),
    default=4,
    show_default=True,
    help="Stage processes of the ring.",
)
@hop_delays_option((0.0, 25.0))
@click.option(
    "--tokens",
    type=click.IntRange(4, 4096),
    default=48,
    show_default=True,
    help="New tokens per job on the ring.",
)
@click.option(
    "--seeds",
    type=click.IntRange(1, 50),
    default=4,
    show_default=True,
    help="Jobs per kind of prompt on the ring, each with a seed of its own and the "
    "next of the kind's prompts; each runs every method.",
)
@json_option
@model_errors
def bench_draft_head(
    model: str,
    head_path: Path | None,
    draft_k: int,
    repeats: int,
    temp: float,
    top_p: float,
    top_k: int,
    ring: bool,
    stages: int,
    delays: tuple[float, ...],
    tokens: int,
    seeds: int,
    json_path: Path | None,
) -> None:
    """What a round's tail costs with the draft head (the verify with the inverse-CDF sampler
    and with the Gumbel one, the head's K drafts, the Gumbel noise of one position); then, with
    --ring, jobs on real stage processes whose tail holds the head: tok/s,
    tokens per round and spec/plain for the head, the n-gram drafter and both, greedy and at
    temp 0.7 / top_p 0.95, grounded and novel prompts, each hop delay. Agreement per draft
    position against its ceiling: `specpipe drafter eval`.

    Example:

        specpipe bench draft-head --hop-delay-ms 0 --hop-delay-ms 25
    """
    from specpipe.bench import load as loadbench
    from specpipe.cli.drafter import load_head, open_whole_model
    from specpipe.core.sampling import SamplingParams
    from specpipe.drafting.train import EVAL_PROMPTS, tail_costs

    label, cfg, tokenizer, _, stage = open_whole_model(model, threads=1)
    head, _ = load_head(head_path, label, cfg)
    prompt = tokenizer.prompt_ids(EVAL_PROMPTS[0])
    params = SamplingParams(temp=temp, top_p=top_p, top_k=top_k, seed=1)
    costs = tail_costs(stage, head, prompt, draft_k, params, repeats)
    click.echo(
        f"{label}, K={draft_k}, temp {temp} top_p {top_p} top_k {top_k}, one thread: verify "
        f"{costs['verify_inverse_cdf_ms']:.2f} ms (inverse CDF) vs "
        f"{costs['verify_gumbel_ms']:.2f} ms (Gumbel); "
        f"head drafts {costs['head_drafts_ms']:.2f} ms; "
        f"noise {costs['noise_whole_vocab_ms']:.2f} ms over the vocabulary ({costs['vocab']:.0f}) "
        f"vs {costs['noise_support_ms']:.3f} ms over the support ({costs['support_size']:.0f})"
    )
    result: dict[str, object] = {"tail_costs": costs}
    if ring:
        result["ring"] = loadbench.draft_sources(
            model,
            stages,
            delays,
            draft_k,
            tokens,
            1,
            seeds,
            click.echo,
            None if head_path is None else str(head_path),
        )
    write_json(json_path, result)
    if ring and not result["ring"]["identical_to_plain"]:
        raise click.ClickException("a drafter's tokens differ from plain decoding's")
