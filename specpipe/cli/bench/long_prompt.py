"""`specpipe bench long-prompt`: its options and its report; its driver is
`specpipe.bench.long_prompt`."""

from __future__ import annotations

from pathlib import Path

import click

from specpipe.cli.bench.reporting import model_errors, verdict
from specpipe.cli.options import (
    SEED,
    json_option,
    model_option,
)


@click.command(name="long-prompt")
@model_option("Model to serve.")
@click.option(
    "--stages",
    type=click.IntRange(1, 16),
    default=4,
    show_default=True,
    help="Stages, as `specpipe up` starts them (its default).",
)
@click.option(
    "--prompt-tokens",
    type=click.IntRange(16, 1_000_000),
    default=6000,
    show_default=True,
    help="Tokens in each long prompt.",
)
@click.option(
    "--tokens",
    type=click.IntRange(1, 4096),
    default=32,
    show_default=True,
    help="New tokens per long job.",
)
@click.option("--seed", type=SEED, default=7, show_default=True)
@click.option(
    "--deadline-s",
    type=click.FloatRange(min=10),
    default=1800.0,
    show_default=True,
    help="A job not finished this long counts as stuck.",
)
@json_option
@model_errors
def bench_long_prompt(model, stages, prompt_tokens, tokens, seed, deadline_s, json_path):
    """Long prompts on the stack as `specpipe up` runs it: a prefill, and a replay, of
    --prompt-tokens tokens each, identical to one-process runs.

    A short job runs while the long prompt's prefill passes (the gaps between its rounds before
    and during it are reported); then another long job has a stage killed once it generates, and
    replays everything it holds on the restarted stage. Exits 1 unless all three jobs end
    identical to their references.

    Example:

        specpipe bench long-prompt --prompt-tokens 6000
    """
    import tempfile

    from specpipe.bench import long_prompt as longbench

    click.echo(f"bench long-prompt: {model}, {stages} stages, {prompt_tokens}-token prompts")
    with tempfile.TemporaryDirectory(prefix="specpipe-long-") as workdir:
        result = longbench.run_long_prompt(
            model,
            Path(workdir),
            click.echo,
            stages=stages,
            prompt_tokens=prompt_tokens,
            tokens=tokens,
            seed=seed,
            deadline_s=deadline_s,
        )
    verdict(result, longbench.report(result), json_path)
