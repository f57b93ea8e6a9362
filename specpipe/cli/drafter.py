"""`specpipe drafter …`: train a model's draft head offline, and measure it on held-out prompts."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from specpipe.cli.options import SEED, json_option, model_option, write_json


def open_whole_model(model: str, threads: int):
    """(label, config, tokenizer, end-of-sequence ids, the whole model as one stage)."""
    import torch

    from specpipe.transformer.errors import ModelError
    from specpipe.transformer.resolve import (
        load_stage,
        load_tokenizer,
        model_label,
        open_checkpoint,
    )

    torch.set_num_threads(threads)
    try:
        checkpoint = open_checkpoint(model)
        tokenizer = load_tokenizer(checkpoint)
        cfg = checkpoint.config
        # Plain weights (the training reads the head's), one session's rows unpadded.
        stage = load_stage(checkpoint, 0, cfg.n_layers, pack=False, row_stable=False)
    except (ModelError, OSError, ValueError) as exc:
        raise click.ClickException(f"cannot open model {model!r}: {exc}") from None
    eos = set(cfg.eos_token_ids)
    eos_token = getattr(tokenizer, "eos_token", None)
    if eos_token and tokenizer.token_id(eos_token) is not None:
        eos.add(tokenizer.token_id(eos_token))
    return model_label(model), cfg, tokenizer, sorted(eos), stage


def load_head(head_path: Path | None, label: str, cfg):
    """The head at `head_path` (or shipped for `label`) and its metadata, checked against the
    model; a one-line ClickException when it cannot be used."""
    from specpipe.drafting.head import DraftHeadError, open_head

    try:
        return open_head(head_path, label, cfg.dim, cfg.vocab_size)
    except DraftHeadError as exc:
        raise click.ClickException(str(exc)) from None


def _eagle3_drafter(folder: Path, cfg, parts):
    """The EAGLE-3 head in `folder` as the tail drafts with it, and what it records of its
    training; a one-line ClickException when it cannot be used."""
    from specpipe.drafting.eagle3_drafter import Eagle3Drafter
    from specpipe.drafting.eagle3_format import load_eagle3
    from specpipe.drafting.head import DraftHeadError
    from specpipe.drafting.train_eagle3 import head_meta

    try:
        head = load_eagle3(folder, cfg.dim, cfg.vocab_size, cfg.n_layers)
        return Eagle3Drafter(head, parts), head_meta(folder)
    except (DraftHeadError, OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


def _log(line: str) -> None:
    click.echo(line)
    sys.stdout.flush()


@click.group(name="drafter")
def drafter() -> None:
    """The learned draft head: training and evaluation."""


@drafter.command(name="train")
@model_option("The target model.")
@click.option(
    "--tokens",
    type=click.IntRange(min=64),
    default=200_000,
    show_default=True,
    help="Tokens the target generates to train on.",
)
@click.option(
    "--steps", type=click.IntRange(min=1), default=3500, show_default=True, help="Training steps."
)
@click.option(
    "--batch",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Positions per training step.",
)
@click.option(
    "--seed",
    type=SEED,
    default=0,
    show_default=True,
    help="Seed of the sampled data and of the head's initialisation.",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    help="Where to write the head: a file (default: MODEL.safetensors here), or with --eagle3 a "
    "folder (default: MODEL-eagle3 here).",
)
@click.option(
    "--draft-vocab",
    type=click.IntRange(min=0),
    default=8192,
    show_default=True,
    help="Draft only this many tokens, the target's most likely (0: all).",
)
@click.option(
    "--heads",
    type=click.IntRange(min=0),
    help="Attention heads over the session's past (0: none, an MLP head; default: one per 64 "
    "of the model's width).",
)
@click.option(
    "--window",
    type=click.IntRange(min=1),
    help="Past pairs the attention sees, and the length of its training windows (default: 16).",
)
@click.option(
    "--eagle3",
    is_flag=True,
    help="Train an EAGLE-3 head (a folder in the speculators format) by training-time test: "
    "--batch then counts the positions of the whole sequences a step takes.",
)
@click.option(
    "--threads", type=click.IntRange(min=1), default=2, show_default=True, help="Torch threads."
)
def train(
    model: str,
    tokens: int,
    steps: int,
    batch: int,
    seed: int,
    out: Path | None,
    draft_vocab: int,
    heads: int | None,
    window: int | None,
    eagle3: bool,
    threads: int,
) -> None:
    """Train a draft head for MODEL by self-distillation on text the model generates itself.

    The target continues the project's own prompts (sampled at temperatures 0.7 … 1.0 with
    Gumbel draws), and the head learns to predict the target's distribution at each position
    from the previous position's feature and the sampled token. Nothing is downloaded. With
    --eagle3, an EAGLE-3 head learns the same from the states entering three of the target's
    layers, drafting several tokens deep in training as it does at the tail.

    Example:

        specpipe drafter train --model default --seed 0
        specpipe drafter train --model default --eagle3 --out head-eagle3
    """
    from specpipe.drafting import train as dt
    from specpipe.drafting.head_attention import HEAD_DIM, WINDOW

    if eagle3 and (heads is not None or window is not None):
        raise click.UsageError("--heads and --window shape today's head, not an EAGLE-3 head")
    if out is not None and (out.is_file() if eagle3 else out.is_dir()):
        wanted = "a folder" if eagle3 else "a file"
        raise click.BadParameter(f"{out} exists and is not {wanted}", param_hint="--out")
    started = time.perf_counter()
    label, cfg, tokenizer, eos, stage = open_whole_model(model, threads)
    if eagle3:
        _train_eagle3(
            model,
            label,
            cfg,
            tokenizer,
            eos,
            stage,
            tokens,
            steps,
            batch,
            seed,
            out,
            draft_vocab,
            started,
        )
        return
    out = out or Path(f"{label}.safetensors")
    data, described = _generated_data(label, tokenizer, eos, stage, tokens, seed)
    generated_s = time.perf_counter() - started
    _log(f"{data.generated} tokens generated in {generated_s:.0f} s; training {steps} steps")
    parts = dt.training_parts(stage)
    if heads is None:
        heads = cfg.dim // HEAD_DIM
    window = window or WINDOW
    try:
        head, losses = dt.train_head(
            parts,
            data,
            steps,
            batch,
            seed=seed,
            draft_vocab=draft_vocab,
            heads=heads,
            window=window,
            log=_log,
        )
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    command = (
        f"specpipe drafter train --model {model} --tokens {tokens} --steps {steps} "
        f"--batch {batch} --seed {seed} --draft-vocab {draft_vocab} --heads {heads} "
        f"--window {window}"
    )
    meta = {
        "model": label,
        "dim": cfg.dim,
        "vocab": cfg.vocab_size,
        "hidden": head.hidden,
        "heads": head.heads,
        "window": head.window,
        "draft_vocab": 0 if head.vocab is None else len(head.vocab),
        "command": command,
        "seed": seed,
        "data": described,
        "loss_first": losses[0],
        "loss_last_25": sum(losses[-25:]) / len(losses[-25:]),
        "train_seconds": round(time.perf_counter() - started),
    }
    head.save(out, meta)
    _log(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) in {meta['train_seconds']} s")


def _train_eagle3(
    model: str,
    label: str,
    cfg,
    tokenizer,
    eos,
    stage,
    tokens: int,
    steps: int,
    batch: int,
    seed: int,
    out: Path | None,
    draft_vocab: int,
    started: float,
) -> None:
    """`drafter train --eagle3`: an EAGLE-3 head for the model, written as a folder."""
    from specpipe.drafting import train as dt
    from specpipe.drafting import train_eagle3 as e3

    out = out or Path(f"{label}-eagle3")
    settings = e3.head_settings(cfg, draft_vocab)
    data, described = _generated_data(label, tokenizer, eos, stage, tokens, seed, settings.taps)
    generated_s = time.perf_counter() - started
    sequences = max(1, -(-batch // (dt.CONTINUATION_TOKENS + 1)))
    _log(
        f"{data.generated} tokens generated in {generated_s:.0f} s; training {steps} steps of "
        f"{sequences} sequences, {e3.TTT_STEPS} draft depths each"
    )
    try:
        head, losses = e3.train_eagle3(
            settings, dt.training_parts(stage), data, steps, sequences, seed=seed, log=_log
        )
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    meta = {
        "model": label,
        "command": f"specpipe drafter train --model {model} --eagle3 --tokens {tokens} "
        f"--steps {steps} --batch {batch} --seed {seed} --draft-vocab {draft_vocab}",
        "seed": seed,
        "data": described,
        "loss_first": losses[0],
        "loss_last_25": sum(losses[-25:]) / len(losses[-25:]),
        "train_seconds": round(time.perf_counter() - started),
    }
    e3.save_head(head, cfg, out, meta)
    _log(f"wrote {out}/ in {meta['train_seconds']} s")


def _generated_data(
    label: str, tokenizer, eos, stage, tokens: int, seed: int, taps: tuple[int, ...] = ()
):
    """What a head learns from: the target's continuations of the project's own prompts, about
    `tokens` of them at temperatures 0.7 … 1.0 (with the states entering the layers `taps`),
    and a line saying so for the head's metadata."""
    import numpy as np

    from specpipe.core.sampling import offset_seed
    from specpipe.drafting import train as dt

    max_new, temps = dt.CONTINUATION_TOKENS, dt.TRAIN_TEMPS
    n_jobs = -(-tokens // max_new)
    # The prompts in an order of the seed's, so that a short run still sees many kinds.
    order = np.random.default_rng(seed).permutation(len(dt.TRAIN_PROMPTS))
    prompts = [tokenizer.prompt_ids(dt.TRAIN_PROMPTS[i]) for i in order]
    jobs = [
        dt.Continuation(
            prompts[i % len(prompts)], offset_seed(seed * 100_003, i), temps[i % len(temps)]
        )
        for i in range(n_jobs)
    ]
    _log(
        f"{label}: generating {n_jobs} continuations of up to {max_new} tokens "
        f"({len(dt.TRAIN_PROMPTS)} prompts, temperatures {temps}, top_p 0.95)"
    )
    data = dt.generate(stage, jobs, 0.95, max_new, eos_ids=eos, log=_log, taps=taps)
    described = (
        f"{data.generated} tokens the target generated from "
        f"{min(n_jobs, len(prompts))} of the {len(dt.TRAIN_PROMPTS)} TRAIN_PROMPTS of "
        f"specpipe/drafting/train.py in the seed's order, {n_jobs} continuations of up to "
        f"{max_new} tokens, temperatures {list(temps)} (0: greedy), top_p 0.95, "
        "Gumbel draws"
    )
    return data, described


@drafter.command(name="narrow")
@click.option(
    "--head",
    "head_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The head to narrow (default: the one shipped for the model).",
)
@model_option("The target model.")
@click.option(
    "--draft-vocab",
    type=click.IntRange(min=1),
    default=8192,
    show_default=True,
    help="Draft only this many tokens: the target's likeliest.",
)
@click.option(
    "--tokens",
    type=click.IntRange(min=64),
    default=2048,
    show_default=True,
    help="Tokens the target generates to weigh its tokens by.",
)
@click.option(
    "--seed",
    type=SEED,
    default=1,
    show_default=True,
    help="Seed of the generated text.",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Where to write the narrowed head.",
)
@click.option(
    "--threads", type=click.IntRange(min=1), default=2, show_default=True, help="Torch threads."
)
def narrow(
    head_path: Path | None,
    model: str,
    draft_vocab: int,
    tokens: int,
    seed: int,
    out: Path,
    threads: int,
) -> None:
    """Make a trained head draft only the DRAFT_VOCAB tokens the target gives the most mass in
    text it generates: the same weights, reading only those rows of the target's head, so a
    draft step costs a fraction of a full one. Its drafts keep the target's noise for those
    tokens (the coupling is unchanged); a token outside them is one it never agrees on.

    Example:

        specpipe drafter narrow --draft-vocab 8192 --out head.safetensors
    """
    import torch

    from specpipe.drafting.head import DraftHead, frequent_tokens, shipped_head

    label, cfg, tokenizer, eos, stage = open_whole_model(model, threads)
    head, meta = load_head(head_path, label, cfg)
    if head.vocab is not None:
        raise click.ClickException("this head already drafts part of the vocabulary")
    data, described = _generated_data(label, tokenizer, eos, stage, tokens, seed)
    vocab = frequent_tokens(data.top_ids, data.top_probs, cfg.vocab_size, draft_vocab)
    narrowed = DraftHead(head.dim, head.hidden, vocab, head.heads)
    narrowed.load_state_dict(head.state_dict(), strict=True)
    covered = 1.0
    if vocab is not None:  # the share of the target's mass in that text the subset holds
        inside = torch.isin(data.top_ids, vocab).to(torch.float32)
        covered = float((data.top_probs * inside).sum() / data.top_probs.sum())
    meta = {
        **meta,
        "draft_vocab": 0 if vocab is None else len(vocab),
        "narrowed": {
            "command": f"specpipe drafter narrow --model {model} --draft-vocab "
            f"{draft_vocab} --tokens {tokens} --seed {seed}",
            "from": (head_path or shipped_head(label)).name,
            "data": described,
            "mass_covered": round(covered, 4),
        },
    }
    narrowed.save(out, meta)
    _log(
        f"wrote {out}: {meta['draft_vocab']} tokens, {100 * covered:.1f}% of the target's "
        "top-64 mass in the generated text"
    )


@drafter.command(name="eval")
@click.option(
    "--head",
    "head_path",
    type=click.Path(path_type=Path),
    help="The head file, or an EAGLE-3 head's folder (default: the one shipped for the model).",
)
@model_option("The target model.")
@click.option(
    "--k",
    "draft_k",
    type=click.IntRange(1, 16),
    default=5,
    show_default=True,
    help="Draft positions measured.",
)
@click.option(
    "--tokens",
    type=click.IntRange(min=8),
    default=96,
    show_default=True,
    help="Tokens generated per held-out prompt and mode.",
)
@click.option(
    "--seed",
    type=SEED,
    default=1000,
    show_default=True,
    help="Seed of the first prompt's draws (the others follow).",
)
@click.option(
    "--threads", type=click.IntRange(min=1), default=2, show_default=True, help="Torch threads."
)
@json_option
def evaluate(
    head_path: Path | None,
    model: str,
    draft_k: int,
    tokens: int,
    seed: int,
    threads: int,
    json_path: Path | None,
) -> None:
    """Agreement of a draft head with its target on held-out prompts, per draft position.

    For temp 0.7 / top_p 0.95 (Gumbel-coupled drafts) and greedy: how often drafts 1..j all
    equal the target's own tokens, the expected tokens per round for K = 1..k, the head's
    ceiling Σ min(p, q) at draft 1, and the same for the n-gram drafter and for both; then the
    tokens per round of the head's best trees of 4 to 64 drafts and K levels, chosen on half
    the prompts and scored on the others, and of every tree at once (the ceiling of any tree).

    Example:

        specpipe drafter eval --head SmolLM2-135M-Instruct.safetensors
    """
    from specpipe.core.sampling import SamplingParams, offset_seed
    from specpipe.drafting import train as dt
    from specpipe.drafting import train_eagle3 as e3
    from specpipe.drafting.head import shipped_head

    label, cfg, tokenizer, eos, stage = open_whole_model(model, threads)
    parts = dt.training_parts(stage)
    if head_path is not None and head_path.is_dir():
        drafter, meta = _eagle3_drafter(head_path, cfg, parts)
        taps = drafter.taps

        def scored(data, params):
            return e3.evaluate_eagle3(drafter, data, draft_k, params)

    else:
        head, meta = load_head(head_path, label, cfg)
        head_path, taps = head_path or shipped_head(label), ()

        def scored(data, params):
            return dt.evaluate(head, parts, data, draft_k, params)

    prompts = [tokenizer.prompt_ids(p) for p in dt.EVAL_PROMPTS]
    result: dict[str, object] = {
        "model": label,
        "head": str(head_path),
        "k": draft_k,
        "head_meta": meta,
        "modes": {},
    }
    for mode, temp, top_p in (("temp 0.7 top_p 0.95", 0.7, 0.95), ("greedy", 0.0, 1.0)):
        jobs = [dt.Continuation(ids, offset_seed(seed, i), temp) for i, ids in enumerate(prompts)]
        data = dt.generate(stage, jobs, top_p, tokens, eos_ids=eos, taps=taps)
        scores = scored(data, SamplingParams(temp, top_p, 0, 0))
        result["modes"][mode] = scores
        _log(f"{mode}: {scores['rounds']} rounds on {len(prompts)} held-out prompts")
        if "head_ceiling_draft_1" in scores:
            _log(
                f"  draft 1: head ceiling Σ min(p, q) {scores['head_ceiling_draft_1']:.3f}, "
                f"Gumbel agreement {scores['head']['accepted_through'][0]:.3f}, inverse-CDF "
                f"agreement {scores['head_inverse_cdf_draft_1']:.3f}; n-gram proposes at "
                f"{scores['ngram_proposes']:.0%} of rounds"
            )
        for name in ("head", "ngram", "both"):
            s = scores[name]
            _log(
                f"  {name:5}  accept per position "
                f"{' '.join(f'{a:.3f}' for a in s['per_position'])}  tokens/round K=1..{draft_k} "
                f"{' '.join(f'{t:.2f}' for t in s['tokens_per_round'].values())}"
            )
        trees = scores["head_trees"]
        _log(
            f"  head trees of {draft_k} levels, tokens/round by drafts "
            + " ".join(f"{n}: {t:.2f}" for n, t in trees.items() if n != "any")
            + f"; any tree: {trees['any']:.2f}"
        )
    write_json(json_path, result)
