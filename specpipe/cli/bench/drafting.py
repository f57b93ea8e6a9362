"""`specpipe bench drafting`: its options and its report; its driver is
`specpipe.bench.drafting`."""

from __future__ import annotations

import click

from specpipe.cli.options import (
    json_option,
    model_option,
    write_json,
)


@click.command(name="drafting")
@model_option("The target model (one that ships a draft head).")
@click.option(
    "--drafts",
    "sizes",
    type=click.IntRange(1, 32),
    multiple=True,
    default=(4, 8, 16),
    show_default=True,
    help="Tree sizes to time (repeat the option).",
)
@click.option(
    "--context",
    type=click.IntRange(1, 4096),
    default=256,
    show_default=True,
    help="Tokens of the session before the drafting.",
)
@click.option("--repeats", type=click.IntRange(1, 1000), default=20, show_default=True)
@click.option(
    "--temp",
    "temps",
    type=click.FloatRange(min=0.0),
    multiple=True,
    default=(0.0, 0.7),
    show_default=True,
    help="Temperatures (repeat the option); top-p 0.95 when sampled.",
)
@json_option
def bench_drafting(model, sizes, context, repeats, temps, json_path):
    """The tail's drafting time per round: the model's shipped head against an EAGLE-3 head
    of the model's shapes, the same trees for both, side by side in one run.

    Example:

        specpipe bench drafting --drafts 4 --drafts 8 --drafts 16
    """
    from specpipe.bench import drafting
    from specpipe.core.sampling import SamplingParams

    results = []
    for temp in temps:
        params = SamplingParams(temp=temp, top_p=0.95 if temp > 0 else 1.0, seed=0)
        try:
            result = drafting.measure(model, sizes, context, repeats, params)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
        results.append(result)
        for line in drafting.report(result):
            click.echo(line)
    write_json(json_path, results)
