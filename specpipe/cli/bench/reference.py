"""`specpipe bench reference`: its options and its report; its driver is
`specpipe.bench.reference`."""

from __future__ import annotations

import click

from specpipe.cli.options import (
    json_option,
    write_json,
)


def _forward_points(_ctx, _param, value: str | None) -> dict[int, float] | None:
    """`ROWS=MS,ROWS=MS` as {rows: ms}."""
    if not value:
        return None
    try:
        points = {int(r): float(ms) for r, ms in (p.split("=") for p in value.split(","))}
    except ValueError:
        raise click.BadParameter(f"{value!r} is not ROWS=MS[,ROWS=MS…]") from None
    if any(r < 1 or ms <= 0 for r, ms in points.items()):
        raise click.BadParameter(f"{value!r}: rows and milliseconds must be positive")
    return points


@click.command(name="reference")
@click.option(
    "--forward-ms",
    callback=_forward_points,
    help="One 9-layer stage's forward on the hosts' GPUs, ROWS=MS for 1 row and draft-k + 1 "
    "rows (e.g. 1=40,5=42) [default: one real-shape layer timed here, times 9].",
)
@click.option(
    "--draft-k",
    type=click.IntRange(1, 16),
    default=4,
    show_default=True,
    help="Drafts a speculative round verifies.",
)
@click.option(
    "--spec-tokens-per-round",
    type=click.FloatRange(min=1.0),
    default=1.4,
    show_default=True,
    help="Tokens a speculative round commits (the default model's real jobs at draft K 4, "
    "temp 0.7, head and n-gram).",
)
@click.option(
    "--handling-ms",
    type=click.FloatRange(min=0),
    default=2.0,
    show_default=True,
    help="Each hop's handling (bench ring's overhead per hop here).",
)
@click.option(
    "--eagle3-tokens-per-round",
    type=click.FloatRange(min=1.0),
    default=2.41,
    show_default=True,
    help="Tokens a round commits with an EAGLE-3 head (a published head's mean accepted "
    "length, or a measured one): specdrift's gpt-oss-120b head at temp 0.7, chains of 3.",
)
@click.option(
    "--eagle3-drafts",
    type=click.IntRange(1, 16),
    default=3,
    show_default=True,
    help="Drafts an EAGLE-3 round verifies.",
)
@click.option(
    "--mbit-s",
    type=click.FloatRange(min=0),
    default=100.0,
    show_default=True,
    help="Each link's bandwidth, to price a round's bytes, the taps' included (0: bytes free).",
)
@json_option
def bench_reference(
    forward_ms,
    draft_k,
    spec_tokens_per_round,
    handling_ms,
    eagle3_tokens_per_round,
    eagle3_drafts,
    mbit_s,
    json_path,
):
    """Predict the reference deployment's tok/s (gpt-oss-120b, 4 × 9 layers, WA → MN → NC →
    NJ, one way 11, 8, 3.4 and 19 ms) from a cost model of a round, beside the reference run's
    4.6 tok/s and the links' ceiling: plain decoding, today's speculation, and an EAGLE-3 head
    whose taps ride the round.

    Examples:

        specpipe bench reference                         # forwards timed on this machine

        specpipe bench reference --forward-ms 1=40,4=41,5=42  # a GPU's forward of one stage
    """
    from specpipe.bench import reference
    from specpipe.drafting.eagle3 import default_taps

    rows = sorted({1, draft_k + 1, eagle3_drafts + 1})
    if forward_ms is None:
        layer = reference.measure_layer_forward(rows)
        forward_ms = {n: ms * reference.LAYERS_PER_STAGE for n, ms in layer.items()}
        source = "one real-shape layer timed here × 9: " + ", ".join(
            f"{n} row(s) {ms:.1f} ms" for n, ms in layer.items()
        )
    else:
        missing = [n for n in rows if n not in forward_ms]
        if outside := [n for n in missing if not min(forward_ms) < n < max(forward_ms)]:
            raise click.BadParameter(f"no time for {outside} rows", param_hint="--forward-ms")
        forward_ms = {**forward_ms, **reference.interpolated(forward_ms, missing)}
        source = "--forward-ms" + (f" ({missing} rows interpolated)" if missing else "")
    taps = default_taps(reference.LAYERS_PER_STAGE * len(reference.HOSTS))
    modes = [
        reference.Mode("plain", 1.0, 1),
        reference.Mode("spec", spec_tokens_per_round, draft_k + 1),
        reference.Mode("eagle3", eagle3_tokens_per_round, eagle3_drafts + 1, taps),
    ]
    result = reference.predict(forward_ms, modes, handling_ms=handling_ms, mbit_s=mbit_s or None)
    result["forward_from"] = source
    for line in reference.format_report(result):
        click.echo(line)
    write_json(json_path, result)
