"""`specpipe bench wan`: its options and its report; its driver is
`specpipe.bench.wan`."""

from __future__ import annotations

from pathlib import Path

import click

from specpipe.cli.bench.reporting import model_errors
from specpipe.cli.options import (
    SEED,
    json_option,
    model_option,
    write_json,
)


@click.command(name="wan")
@model_option("Model to serve.")
@click.option(
    "--link-delay-ms",
    "delays",
    default="11,8,3.4,19",
    show_default=True,
    help="One-way delay of each host's outgoing link, in ring order: one host per "
    "value (the reference run's WA -> MN -> NC -> NJ -> WA).",
)
@click.option(
    "--tokens",
    type=click.IntRange(4, 4096),
    default=64,
    show_default=True,
    help="New tokens per generation.",
)
@click.option(
    "--temp",
    "temps",
    type=click.FloatRange(min=0),
    multiple=True,
    default=(0.0, 0.7),
    show_default=True,
    help="Temperatures; repeat for several.",
)
@click.option("--seed", type=SEED, default=7, show_default=True)
@click.option("--draft-k", type=click.IntRange(1, 64), default=8, show_default=True)
@click.option(
    "--home",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The lab's folder [default: a temporary one].",
)
@json_option
@model_errors
def bench_wan(model, delays, tokens, temps, seed, draft_k, home, json_path):
    """Speculative vs plain on the lab (root only), one host per link delay: tok/s, tokens
    per round and the latency ceiling the stages measured, for an input-grounded and an
    open-ended prompt at each temperature. The lab is taken down afterwards.

    Example:

        specpipe bench wan --link-delay-ms 11,8,3.4,19 --temp 0 --temp 0.7
    """
    import tempfile

    from specpipe.bench import wan as wanbench
    from specpipe.cli.lab import bring_up, link_delays

    ms = link_delays(None, None, delays)
    if not ms:
        raise click.BadParameter("give one delay per host", param_hint="--link-delay-ms")
    with tempfile.TemporaryDirectory(prefix="specpipe-wan-") as scratch:
        folder = home or Path(scratch) / "lab"
        the_lab, _ = bring_up(folder, len(ms), 0, model, ms, 8000)
        try:
            settings = wanbench.lab_settings(the_lab)
            result = wanbench.run(
                settings,
                model,
                tokens=tokens,
                temps=temps,
                seed=seed,
                draft_k=draft_k,
                link_delays_ms=the_lab.link_delays_ms(),
                log=click.echo,
            )
        finally:
            the_lab.down()
    result.update(link_delays_ms=ms, model=model, tokens=tokens, draft_k=draft_k)
    for line in wanbench.table(result):
        click.echo(line)
    write_json(json_path, result)
    if not all(row["identical"] for row in result["rows"]):
        raise click.ClickException("speculative and plain gave different tokens")
