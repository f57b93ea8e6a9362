"""`specpipe bench trees`: its options and its report; its driver is
`specpipe.bench.draft_trees`."""

from __future__ import annotations

from pathlib import Path

import click

from specpipe.cli.bench.reporting import model_errors
from specpipe.cli.options import (
    SEED,
    hop_delays_option,
    json_option,
    model_option,
    write_json,
)
from specpipe.drafting.tree_size import MAX_SLOTS


@click.command(name="trees")
@model_option("The target model.")
@click.option(
    "--head",
    "head_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The tail's head file (default: the one shipped for the model).",
)
@click.option(
    "--k",
    "draft_k",
    type=click.IntRange(1, 16),
    default=6,
    show_default=True,
    help="The most drafts a round sends in a chain; the deepest a tree goes.",
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
    default=96,
    show_default=True,
    help="New tokens per job.",
)
@click.option(
    "--seeds",
    type=click.IntRange(1, 50),
    default=4,
    show_default=True,
    help="Jobs per kind of prompt, each with a seed of its own and the next of the kind's "
    "prompts; each runs every method.",
)
@click.option(
    "--at-once",
    type=click.IntRange(0, 64),
    default=8,
    show_default=True,
    help="Then this many jobs together, chains and then trees (0 or 1: none).",
)
@click.option(
    "--fixed-tree",
    "fixed",
    type=click.IntRange(1, MAX_SLOTS),
    multiple=True,
    help="Also trees of this many drafts every round, whatever their rows cost (repeatable).",
)
@click.option("--seed", type=SEED, default=1, show_default=True)
@json_option
@model_errors
def bench_trees(
    model: str,
    head_path: Path | None,
    draft_k: int,
    stages: int,
    delays: tuple[float, ...],
    tokens: int,
    seeds: int,
    at_once: int,
    fixed: tuple[int, ...],
    seed: int,
    json_path: Path | None,
) -> None:
    """Draft trees against chains on real stage processes whose tail holds the draft head:
    plain, chains and trees (n-gram and head, adaptive), greedy and at temp 0.7 / top_p 0.95,
    grounded and novel prompts, each hop delay; tok/s, tokens per round, rows per round,
    accepted depth, the share of tree rounds; then --at-once jobs together. Every job's tokens
    are checked against plain decoding's. With --fixed-tree N, trees of N drafts every round
    run beside them: what a tree that size commits where rows are nearly free, and costs here.

    Example:

        specpipe bench trees --hop-delay-ms 0 --hop-delay-ms 25
    """
    from specpipe.bench.draft_trees import trees

    result = trees(
        model,
        stages,
        delays,
        draft_k,
        tokens,
        seed,
        seeds,
        at_once,
        click.echo,
        None if head_path is None else str(head_path),
        fixed,
    )
    write_json(json_path, result)
    if not result["identical_to_plain"]:
        raise click.ClickException("a method's tokens differ from plain decoding's")
