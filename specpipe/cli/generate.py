"""`specpipe generate`: generate text from a prompt, here with every stage in this process."""

from __future__ import annotations

import json
import sys

import click

from specpipe.cli.model import ModelInputError


@click.command(name="generate")
@click.argument("prompt")
@click.option("--local", is_flag=True, help="Run every stage in this process (no swarm).")
@click.option("--model", "model_name", default="default", show_default=True, help="Model.")
@click.option(
    "--stages",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Split the model into this many stages (still one process).",
)
@click.option("--no-spec", is_flag=True, help="Plain decoding: one token per round, no drafts.")
@click.option(
    "--draft-k",
    type=click.IntRange(1, 64),
    default=8,
    show_default=True,
    help="Drafted tokens verified per round.",
)
@click.option(
    "--temp",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Temperature (0: greedy).",
)
@click.option(
    "--top-p",
    type=click.FloatRange(0, 1, min_open=True),
    default=1.0,
    show_default=True,
    help="Nucleus mass.",
)
@click.option(
    "--top-k",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Keep the k most likely tokens (0: off).",
)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed.")
@click.option(
    "--max-new-tokens",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    help="Stop after this many new tokens.",
)
@click.option("--raw", is_flag=True, help="Do not apply the model's chat template.")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default="float32",
    show_default=True,
    help="Compute dtype.",
)
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda[:N].")
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="CPU threads for torch (default: torch's choice).",
)
@click.option(
    "--row-stable/--no-row-stable",
    default=True,
    show_default=True,
    help="Make each position's logits independent of how many positions share a forward "
    "(speculative == plain exactly); off is faster per plain step on CPU.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def generate(
    prompt: str,
    local: bool,
    model_name: str,
    stages: int,
    no_spec: bool,
    draft_k: int,
    temp: float,
    top_p: float,
    top_k: int,
    seed: int,
    max_new_tokens: int,
    raw: bool,
    dtype: str,
    device: str,
    threads: int | None,
    row_stable: bool,
    as_json: bool,
) -> None:
    """Generate a reply to PROMPT, streaming it, then report tok/s and tokens per round.

    Example:

        specpipe generate --local "Summarise: the cat sat on the mat." --max-new-tokens 64
    """
    import torch

    from specpipe.generation import Generation
    from specpipe.model.errors import ModelError
    from specpipe.model.resolve import load_stages, load_tokenizer, open_checkpoint
    from specpipe.ring import LocalRing, SamplingParams
    from specpipe.sampling import check_params

    if not local:
        raise click.UsageError("only --local generation is available from this command")
    try:
        check_params(temp, top_p, top_k)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if threads:
        torch.set_num_threads(threads)
    try:
        checkpoint = open_checkpoint(model_name)
        tokenizer = load_tokenizer(checkpoint)
        n_stages = min(stages, checkpoint.config.n_layers)
        ring = LocalRing(
            load_stages(model_name, n_stages, dtype=dtype, device=device, row_stable=row_stable)
        )
        prompt_ids = tokenizer.prompt_ids(prompt, raw=raw)
    except ModelError as e:
        raise ModelInputError(str(e)) from None
    eos = set(checkpoint.config.eos_token_ids)
    if tokenizer.eos_token and tokenizer.token_id(tokenizer.eos_token) is not None:
        eos.add(tokenizer.token_id(tokenizer.eos_token))
    run = Generation(
        ring,
        "local",
        prompt_ids,
        SamplingParams(temp=temp, top_p=top_p, top_k=top_k, seed=seed),
        max_new_tokens=max_new_tokens,
        draft_k=0 if no_spec else draft_k,
        eos_ids=eos,
    )
    shown = ""
    for _ in run.rounds():
        if as_json:
            continue
        text = tokenizer.decode([t for t in run.generated if t not in eos])
        # Hold back an incomplete UTF-8 sequence until its last byte arrives.
        if not text.endswith("\ufffd") and text.startswith(shown):
            click.echo(text[len(shown) :], nl=False)
            sys.stdout.flush()
            shown = text
    stats = run.stats
    shown_ids = run.generated
    if shown_ids and shown_ids[-1] in eos:  # the end marker is not part of the text
        shown_ids = shown_ids[:-1]
    text = tokenizer.decode(shown_ids)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "tokens": run.generated,
                    "text": text,
                    "tok_s": round(stats.tok_s, 3),
                    "rounds": stats.rounds,
                    "accepted_per_round": round(stats.accepted_per_round, 3),
                }
            )
        )
        return
    click.echo(text[len(shown) :] if text.startswith(shown) else "")
    click.echo(
        f"\n{stats.generated} tokens in {stats.seconds:.2f} s: {stats.tok_s:.2f} tok/s, "
        f"{stats.rounds} rounds, {stats.accepted_per_round:.2f} tokens per round",
        err=True,
    )
