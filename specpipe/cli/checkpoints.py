"""`specpipe model …`: inspect a checkpoint without loading its weights, or make one of a
released model's layout."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specpipe.cli.options import RELEASED_LAYOUTS, SEED, layer_range


class ModelInputError(click.ClickException):
    """A model, file or layer range that cannot be used: one line, exit status 2."""

    exit_code = 2


@click.group(name="model")
def model() -> None:
    """Model checkpoints."""


def _gib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


@model.command(name="info")
@click.argument("model_name", metavar="MODEL")
@click.option(
    "--stages",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Stages to split into.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def model_info(model_name: str, stages: int, as_json: bool) -> None:
    """Architecture, layers, parameters, dtype, bytes per layer and an even split into stages.

    MODEL is `default` (SmolLM2-135M-Instruct), a checkpoint directory or a GGUF file.

    Example:

        specpipe model info default --stages 4
    """
    from specpipe.transformer.errors import ModelError
    from specpipe.transformer.info import model_info as info_of
    from specpipe.transformer.resolve import open_checkpoint

    try:
        checkpoint = open_checkpoint(model_name)
        stages = min(stages, checkpoint.config.n_layers)
        info = info_of(checkpoint, stages)
    except ModelError as e:
        raise ModelInputError(str(e)) from None
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"{info['path']} ({info['format']})")
    click.echo(
        f"architecture {info['architecture']}, {info['layers']} layers, "
        f"hidden {info['hidden_size']}, vocabulary {info['vocab_size']:,}"
        + (f", {info['experts']} experts" if info["experts"] else "")
    )
    click.echo(
        f"parameters {info['parameters']:,}, stored as {info['dtype']}, "
        f"{_gib(info['bytes'])} in all, {_gib(info['bytes_per_layer'])} per layer"
    )
    click.echo(f"even split into {len(info['stages'])} stages:")
    for i, stage in enumerate(info["stages"]):
        a, b = stage["layers"]
        click.echo(f"  stage {i}: layers [{a}, {b}) {_gib(stage['bytes'])}")


@model.command(name="synth")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--like",
    type=click.Choice(RELEASED_LAYOUTS),
    required=True,
    help="The released model whose layout (config, tensor names, dtypes, shapes) to copy.",
)
@click.option(
    "--layers",
    callback=lambda ctx, param, value: value and layer_range(ctx, param, value),
    help="Only the layers A:B (with the embedding from 0, the norm and head to the end) "
    "[default: every layer].",
)
@click.option(
    "--with-embedding",
    is_flag=True,
    help="The embedding table too, whatever the range (a tail with a draft head reads it).",
)
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the random weights.")
def model_synth(
    out: Path, like: str, layers: tuple[int, int] | None, with_embedding: bool, seed: int
) -> None:
    """Write a checkpoint of a released model's layout with random weights to OUT (a new or
    empty directory), for tests and benchmarks at the real size: no download.

    Examples:

        specpipe model synth --like gpt-oss-120b --layers 9:18 /data/oss-9-18

        specpipe model synth --like gpt-oss-20b --layers 0:1 /tmp/one-layer
    """
    from specpipe.transformer.errors import ModelError
    from specpipe.transformer.synth import synthesize

    try:
        made = synthesize(like, out, layers, seed, embedding=with_embedding)
    except ModelError as e:
        raise ModelInputError(str(e)) from None
    except OSError as e:
        raise ModelInputError(f"cannot write {out}: {e.strerror}") from None
    a, b = made.layers
    click.echo(
        f"wrote {made.path}: {like} layers {a}:{b}, {made.tensors} tensors, "
        f"{_gib(made.bytes)} in {made.shards} shard(s)"
    )


@model.command(name="synth-head")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--like",
    type=click.Choice(RELEASED_LAYOUTS),
    required=True,
    help="The released model whose EAGLE-3 heads' shapes to copy.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["eagle", "speculators"]),
    required=True,
    help="The published format: EAGLE / ModelOpt, or speculators.",
)
@click.option(
    "--intermediate",
    type=click.IntRange(min=1),
    default=2880,
    show_default=True,
    help="The head's MLP width (SpecForge's gpt-oss heads: 17280).",
)
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the random weights.")
def model_synth_head(out: Path, like: str, fmt: str, intermediate: int, seed: int) -> None:
    """Write an EAGLE-3 draft head of a released model's shapes, in a published format, with
    random weights to OUT: its config.json and model.safetensors, as released heads lay them
    out (no download).

    Example:

        specpipe model synth-head --like gpt-oss-120b --format eagle /tmp/oss-head
    """
    from specpipe.drafting.eagle3_synth import synthesize_head

    try:
        folder = synthesize_head(like, out, fmt, seed, intermediate)
    except OSError as e:
        raise ModelInputError(f"cannot write {out}: {e.strerror}") from None
    size = sum(p.stat().st_size for p in folder.iterdir())
    click.echo(f"wrote {folder}: an EAGLE-3 head for {like} ({fmt} format), {_gib(size)}")
