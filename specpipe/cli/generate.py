"""`specpipe generate`: generate text from a prompt, on the swarm or with every stage here."""

from __future__ import annotations

import json
import sys

import click

from specpipe.cli.model import ModelInputError
from specpipe.cli.options import sampling_options
from specpipe.stopping import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    GenerationText,
    check_stop_strings,
    hold_back_stop_prefix,
)


class StopOptionError(click.ClickException):
    """Stop strings that cannot be used: one line, exit status 2."""

    exit_code = 2


@click.command(name="generate")
@click.argument("prompt")
@click.option("--local", is_flag=True, help="Run every stage in this process (no swarm).")
@click.option("--model", "model_name", default="default", show_default=True,
              help="Model (on the swarm, `default` is the model the swarm serves).")  # fmt: skip
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
    type=click.IntRange(0, 64),
    default=8,
    show_default=True,
    help="Drafted tokens verified per round (0: plain, as --no-spec).",
)
@sampling_options(0.0, 1.0, greedy=True)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed.")
@click.option(
    "--max-new-tokens",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    help="Stop after this many new tokens.",
)
@click.option(
    "--stop",
    "stops",
    multiple=True,
    metavar="TEXT",
    help=f"End the text just before the first appearance of TEXT (repeatable, up to "
    f"{MAX_STOP_STRINGS}, each 1-{MAX_STOP_CHARS} characters).",
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
    stops: tuple[str, ...],
    raw: bool,
    dtype: str,
    device: str,
    threads: int | None,
    row_stable: bool,
    as_json: bool,
) -> None:
    """Generate a reply to PROMPT, streaming it, then report tok/s and tokens per round.

    Without --local the job goes to the running swarm (the one `specpipe up` started, or
    REDIS_URL's) exactly as a job from the web app does, and its text streams as the
    coordinator records it.

    Examples:

        specpipe generate "Why is the sky blue?" --temp 0.8 --seed 1

        specpipe generate --local "Summarise: the cat sat on the mat." --max-new-tokens 64

        specpipe generate --local "List three colours:" --stop "4."
    """
    import torch

    from specpipe.generation import Generation
    from specpipe.model.errors import ModelError
    from specpipe.model.resolve import load_stages, load_tokenizer, open_checkpoint
    from specpipe.ring import LocalRing, SamplingParams
    from specpipe.sampling import check_params

    try:
        check_params(temp, top_p, top_k)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    try:
        stop_strings = check_stop_strings(stops)
    except ValueError as e:
        raise StopOptionError(f"--stop {e}") from None
    if not local:
        if raw:
            raise click.UsageError("--raw needs --local: swarm jobs always use the chat template")
        params = dict(prompt=prompt, max_new_tokens=max_new_tokens, temp=temp, top_p=top_p,
                      top_k=top_k, seed=seed, draft_k=0 if no_spec else draft_k,
                      stop=stop_strings)  # fmt: skip
        generate_on_swarm(params, None if model_name == "default" else model_name, as_json)
        return
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
    output = GenerationText(tokenizer.decode, eos, stop_strings)

    run = Generation(
        ring,
        "local",
        prompt_ids,
        SamplingParams(temp=temp, top_p=top_p, top_k=top_k, seed=seed),
        max_new_tokens=max_new_tokens,
        draft_k=0 if no_spec else draft_k,
        eos_ids=eos,
        should_stop=output.should_stop,
    )
    shown = ""
    for _ in run.rounds():
        if as_json:
            continue
        text = hold_back_stop_prefix(output.cut(run.generated)[0], stop_strings)
        # Hold back an incomplete UTF-8 sequence until its last byte arrives.
        if not text.endswith("\ufffd") and text.startswith(shown):
            click.echo(text[len(shown) :], nl=False)
            sys.stdout.flush()
            shown = text
    stats = run.stats
    text, _ = output.cut(run.generated)
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


def generate_on_swarm(params: dict, model: str | None, as_json: bool) -> None:
    """Submit a job to the running swarm, stream its text as it is recorded, report its stats."""
    import time

    import redis

    from models.db import make_session_factory
    from models.jobs import Job
    from specpipe import inventory, settings
    from workers.queue import QueueUnavailable, make_client, send_generate, submit_job

    url, swarm = settings.redis_url(), settings.swarm_name()
    hint = "start one with `specpipe up`, or set REDIS_URL"
    client = redis.Redis.from_url(url, socket_connect_timeout=3)
    try:
        nodes = inventory.load(client, swarm)
    except redis.RedisError as exc:
        raise click.ClickException(f"no swarm running: cannot reach Redis at {url} ({exc}); "
                                   f"{hint}") from None  # fmt: skip
    finally:
        client.close()
    if not any(n.status() == "online" for n in nodes):
        raise click.ClickException(f"no swarm running: no stage is online in swarm {swarm!r} "
                                   f"at {url}; {hint}")  # fmt: skip

    sessions = make_session_factory(settings.database_url())
    celery = make_client(url)
    with sessions() as session:
        try:
            job = submit_job(
                session, params, model or settings.default_model(),
                lambda job_id: send_generate(celery, job_id),
            )  # fmt: skip
        except QueueUnavailable as exc:
            raise click.ClickException(f"job {exc.job.id}: {exc}") from None
        except Exception as exc:  # e.g. a store that was never migrated
            raise click.ClickException(f"cannot store the job in {settings.database_url()}: "
                                       f"{exc}") from None  # fmt: skip
        job_id = job.id
    shown, warned, queued_since = "", False, time.monotonic()
    try:
        while True:
            with sessions() as session:
                job = session.get(Job, job_id)
            if not as_json:
                # The stored text is cut at a stop string; its ending may begin one not yet whole.
                text = hold_back_stop_prefix(job.output_text or "", job.stop or [])
                if not text.endswith("\ufffd") and text.startswith(shown):
                    click.echo(text[len(shown) :], nl=False)
                    sys.stdout.flush()
                    shown = text
            if job.finished:
                break
            if job.status == "queued" and not warned and time.monotonic() - queued_since > 10:
                click.echo(f"job {job_id} is still queued: is a coordinator running?", err=True)
                warned = True
            time.sleep(0.1)
    except KeyboardInterrupt:
        with sessions() as session:
            session.get(Job, job_id).request_cancel()
            session.commit()
        raise click.ClickException(f"job {job_id}: cancelled") from None
    if job.status != "done":
        raise click.ClickException(f"job {job_id} {job.status}: {job.error or 'no reason given'}")
    tok_s, per_round = job.tok_s or 0.0, job.tokens_per_round or 0.0
    if as_json:
        click.echo(
            json.dumps(
                {
                    "tokens": list(job.output_ids or []),
                    "text": job.output_text,
                    "tok_s": round(tok_s, 3),
                    "rounds": job.rounds,
                    "accepted_per_round": round(per_round, 3),
                }
            )
        )
        return
    rest = job.output_text
    click.echo(rest[len(shown) :] if rest.startswith(shown) else "")
    click.echo(
        f"\njob {job_id}: {job.generated_tokens} tokens, {tok_s:.2f} tok/s, {job.rounds} rounds, "
        f"{per_round:.2f} tokens per round",
        err=True,
    )
