"""`specpipe bench draft`: its options, the measurement and its report."""

from __future__ import annotations

import time

import click


@click.command(name="draft")
@click.option(
    "--context",
    type=click.IntRange(min=16),
    default=4096,
    show_default=True,
    help="Committed tokens in the context.",
)
@click.option(
    "--k",
    "draft_k",
    type=click.IntRange(1, 64),
    default=8,
    show_default=True,
    help="Tokens per proposal.",
)
@click.option(
    "--vocab",
    type=click.IntRange(min=2),
    default=49152,
    show_default=True,
    help="Vocabulary the synthetic text draws from.",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=2000,
    show_default=True,
    help="Proposals timed.",
)
def bench_draft(context: int, draft_k: int, vocab: int, repeats: int) -> None:
    """Cost of one n-gram proposal (and one commit) at a given context length.

    The synthetic text repeats phrases, as real text does, so most proposals find a match.

    Example:

        specpipe bench draft --context 4096 --k 8
    """
    import numpy as np

    from specpipe.drafting.ngram import NgramDrafter

    rng = np.random.default_rng(0)
    phrases = rng.integers(0, vocab, size=(64, 12))
    text = np.concatenate([phrases[i] for i in rng.integers(0, 64, size=context // 12 + 2)])
    tokens = text[:context].tolist()
    drafter = NgramDrafter()
    drafter.extend(tokens)
    hits = 0
    started = time.perf_counter()
    for _ in range(repeats):
        hits += bool(drafter.propose(draft_k))
    propose_us = (time.perf_counter() - started) / repeats * 1e6
    extra = text[:repeats].tolist()
    started = time.perf_counter()
    for token in extra:
        drafter.extend([token])
    extend_us = (time.perf_counter() - started) / len(extra) * 1e6
    click.echo(
        f"context {context:,} tokens, K={draft_k}: propose {propose_us:.1f} µs "
        f"(target ≤ 50 µs), commit one token {extend_us:.1f} µs, "
        f"{hits / repeats:.0%} of proposals non-empty"
    )
