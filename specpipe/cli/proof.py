"""`specpipe proof …`: the statistical and exact proofs that sampling is lossless."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import click

from specpipe.cli.options import SEED, json_option, sampling_options, write_json
from specpipe.proofs import report
from specpipe.settings import PROOF_IN_FLIGHT

if TYPE_CHECKING:
    from specpipe.core.ring import Ring


def _number_list(kind: type, check, what: str):
    """A click callback parsing a comma-separated list of numbers and checking each."""

    def parse(ctx, param, value):
        if value is None:
            return None
        try:
            items = [kind(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise click.BadParameter(f"expected a comma-separated list of {what}") from None
        if not items:
            raise click.BadParameter("the list is empty")
        for item in items:
            if not check(item):
                raise click.BadParameter(f"{item} is not {what}")
        return tuple(items)

    return parse


def _finish(
    text: str,
    result: dict,
    json_path: Path | None,
    passed: bool,
    stored: dict | None = None,
) -> None:
    """Print the report, write the result document, keep the run in the store (`stored`: what
    `store_proof_run` keeps; None: nothing), and exit 1 unless the proof passed."""
    click.echo(text)
    write_json(json_path, result)
    if stored is not None:
        name = store_proof_run(**stored)
        click.echo(f"stored as run {name} (the web app's Proofs page lists it)")
    if not passed:
        raise SystemExit(1)


def store_option(func: Callable) -> Callable:
    """--store/--no-store: whether the run is kept in the store, as the nightly's are."""
    return click.option(
        "--store/--no-store",
        default=True,
        show_default=True,
        help="Keep the run in the store the web app reads (DATABASE_URL, else this host's), "
        "where its Proofs page and `specpipe runs` list it.",
    )(func)


def _command_line() -> str:
    """The running command with every option's value (defaults included), as it could be typed
    again: how the stored run was made."""
    ctx = click.get_current_context()
    words = ["specpipe", "proof", ctx.command.name]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if not isinstance(param, click.Option) or param.name in ("json_path", "store"):
            continue
        if param.is_flag:
            if value != param.default:
                words.append(param.opts[0] if value else param.secondary_opts[0])
        elif param.multiple:
            for item in value or ():
                words += [param.opts[0], shlex.quote(str(item))]
        elif value is not None:
            text = ",".join(f"{v:g}" for v in value) if isinstance(value, tuple) else str(value)
            words += [param.opts[0], shlex.quote(text)]
    return " ".join(words)


def store_proof_run(
    *,
    local: dict | None = None,
    swarm: dict | None = None,
    generation: dict | None = None,
    target=None,
    ring=None,
    where: str | None = None,
) -> str:
    """Keep the results as one manual proof run and return its name; one line if the store
    cannot take it. A run on the swarm (`ring` routed over its stages) records that ring as the
    nightly does; a run in this process records none."""
    from models.proof_store import save_proof_run
    from specpipe.cli.options import store_error, store_session
    from workers.node_sync import sync_inventory
    from workers.regression import CLAIM, project_commit

    route = [] if ring is None else list(ring.route)  # empty in one process
    session = store_session()
    try:
        if route:
            sync_inventory(session, route)
        run = save_proof_run(
            session,
            local=local,
            swarm=swarm,
            generation=generation,
            ring_snapshot=bool(route),
            shard_commit=project_commit(),
            claim=CLAIM,
            model=None if target is None else target.name,
            quant=None if target is None else target.quant,
            method=_command_line(),
            topology=where,
        )
        session.commit()
        return run.name
    except Exception as exc:  # a store that is missing, unmigrated or unreachable: one line
        raise store_error("store the proof run (--no-store runs without it)", exc) from None
    finally:
        session.close()


@click.group(name="proof")
def proof() -> None:
    """Proofs that speculative sampling is lossless."""


@proof.command(name="local")
@click.option(
    "--draws",
    type=click.IntRange(min=1000),
    default=120_000,
    show_default=True,
    help="Draws per case and form.",
)
@click.option(
    "--vocab",
    type=click.IntRange(4, 4096),
    default=32,
    show_default=True,
    help="Vocabulary size of the synthetic targets.",
)
@click.option(
    "--seed",
    type=SEED,
    default=0,
    show_default=True,
    help="Seed for the synthetic targets and the draws.",
)
@click.option(
    "--temps",
    callback=_number_list(float, lambda t: 0 < t < 1e6, "a temperature > 0"),
    default="0.7,0.8,1.0,1.3",
    show_default=True,
    help="Temperatures to test.",
)
@click.option(
    "--top-ps",
    callback=_number_list(float, lambda p: 0 < p <= 1, "a top-p in (0, 1]"),
    default="0.8,0.9,0.95,1.0",
    show_default=True,
    help="Top-p values to test.",
)
@click.option(
    "--top-ks",
    callback=_number_list(int, lambda k: k >= 0, "a top-k >= 0"),
    default="0,10,20",
    show_default=True,
    help="Top-k values to test (0 = off).",
)
@json_option
@store_option
def proof_local(draws, vocab, seed, temps, top_ps, top_ks, json_path, store) -> None:
    """Proof 1: the verify rule's committed tokens follow the target exactly.

    Runs both verify forms over temperature × top-p × top-k × draft cases, and the Gumbel-max
    form with drafts from a drafter's own q; checks the lossy mutants are caught, greedy is
    argmax, and verify commits what plain sampling draws. Exits 0 only when every gate passes.

    Example:

        specpipe proof local --json proof1.json
    """
    from tqdm import tqdm

    from specpipe.proofs.local import LocalProofConfig, run_local_proof

    cfg = LocalProofConfig(
        draws=draws, vocab=vocab, seed=seed, temps=temps, top_ps=top_ps, top_ks=top_ks
    )
    started = time.perf_counter()
    with tqdm(total=cfg.work_units(), desc="proof local", unit="case", leave=False) as bar:
        result = run_local_proof(cfg, progress=bar.update)
    summary = report.LocalProofSummary.from_result(result)
    text = report.format_local_summary(summary, time.perf_counter() - started)
    keep = {"local": result} if store else None
    _finish(text, result, json_path, summary.passed, keep)


# ---------------------------------------------------------------------------------------------
# Proofs 2 and 3 run on a ring: the live swarm (RedisRing) or the model in this process.


def ring_options(func):
    """--redis / --local / --model, shared by the commands that need a ring."""
    func = click.option(
        "--model",
        help="The model the swarm serves (for its tokenizer and layer count) "
        "[default: SPECPIPE_MODEL, else the default model].",
    )(func)
    func = click.option(
        "--local",
        "local_model",
        metavar="MODEL",
        help="Run in this process on a LocalRing of MODEL's stages instead of the swarm.",
    )(func)
    func = click.option(
        "--redis",
        "redis_option",
        metavar="URL",
        help="The swarm's registry Redis [default: REDIS_URL, else the local Redis].",
    )(func)
    return func


def open_ring(redis_option: str | None, local_model: str | None, model: str | None):
    """(ring, target, description) for the options; ClickException with one line otherwise."""
    from specpipe.decoding.target import open_target
    from specpipe.settings import Settings, default_model
    from specpipe.swarm import inventory
    from specpipe.swarm.inventory import RouteError
    from specpipe.swarm.redis_ring import RedisRing, RingError

    if local_model and (redis_option or model):
        raise click.UsageError("--local runs without the swarm: drop --redis and --model")
    try:
        target = open_target(local_model or model or default_model())
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if local_model:
        if target.load_stages is None:
            raise click.ClickException(f"model {target.name!r} cannot be loaded in-process")
        try:  # the whole model as one stage, with the head shipped for it, as a tail holds it
            return target.local_ring(1), target, f"local ({target.name})"
        except Exception as exc:  # a checkpoint that fails to load: one line
            raise click.ClickException(f"cannot load {target.name!r}: {exc}") from None
    settings = Settings.from_env()
    try:
        ring = RedisRing.from_inventory(
            settings, target.name, target.n_layers, registry_url=redis_option
        )
    except RingError as exc:
        raise click.ClickException(str(exc)) from None
    except RouteError as exc:
        raise click.ClickException(f"no complete ring in swarm {settings.swarm!r}: {exc}") from None
    if warning := inventory.inexact_warning(ring.route):
        click.echo(f"warning: {warning}", err=True)
    return ring, target, " → ".join(hop.host for hop in ring.route)


@contextmanager
def _closing_ring(ring: Ring, plain_errors: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """Close `ring` on the way out; a failing ring, or one of `plain_errors`, is one line."""
    import redis

    from specpipe.core.ring import GapError
    from specpipe.swarm.redis_ring import RingError

    try:
        yield
    except (RingError, GapError, redis.RedisError) as exc:
        raise click.ClickException(f"the ring failed: {exc}") from None
    except plain_errors as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        ring.close()


@proof.command(name="swarm")
@ring_options
@click.option(
    "--stops",
    type=click.IntRange(1, 1000),
    default=12,
    show_default=True,
    help="Stops (highest-entropy generated positions) to test.",
)
@click.option(
    "--draws",
    type=click.IntRange(10, 100_000),
    default=140,
    show_default=True,
    help="Draws per mode (plain, speculative, plain noise floor) per stop.",
)
@sampling_options(0.7, 0.95, greedy=False)
@click.option(
    "--draft-k",
    type=click.IntRange(1, 32),
    default=4,
    show_default=True,
    help="Drafts verified per round.",
)
@click.option(
    "--seed",
    type=SEED,
    default=0,
    show_default=True,
    help="Base seed; every draw has its own seed derived from it.",
)
@click.option(
    "--prompt",
    "prompts",
    multiple=True,
    help="A prompt to generate stops from (repeatable) [default: built-in prompts].",
)
@click.option(
    "--draft-head/--no-draft-head",
    default=False,
    show_default=True,
    help="Drafts from the tail's draft head, drawn with the Gumbel sampler whose noise it shares.",
)
@click.option(
    "--in-flight",
    type=click.IntRange(1, 64),
    default=PROOF_IN_FLIGHT,
    show_default=True,
    help="Sessions in flight on the swarm, each measuring part of a stop's draws (--local: one).",
)
@json_option
@store_option
def proof_swarm(
    redis_option,
    local_model,
    model,
    stops,
    draws,
    temp,
    top_p,
    top_k,
    draft_k,
    seed,
    prompts,
    draft_head,
    in_flight,
    json_path,
    store,
) -> None:
    """Proof 2: speculative draws on the ring have the plain draws' law, stop by stop.

    Picks high-entropy stops inside real generations, draws plain, speculative and plain
    again at each with their own seeds, and compares them (TV and a two-sample chi-square),
    shows a lossy mutant is flagged, and checks same-seed speculative and plain draws are
    identical. Exits 0 only on PASS.

    Examples:

        specpipe proof swarm --json proof2.json

        specpipe proof swarm --local default --stops 4 --draws 60
    """
    from tqdm import tqdm

    from specpipe.prompts import DEFAULT_PROMPTS
    from specpipe.proofs.swarm import SwarmProofConfig, run_swarm_proof

    texts = [p for p in prompts if p.strip()] or list(DEFAULT_PROMPTS)
    if len(texts) != len(prompts) and prompts:
        raise click.BadParameter("a prompt may not be empty", param_hint="--prompt")
    cfg = SwarmProofConfig(
        stops=stops,
        draws=draws,
        temp=temp,
        top_p=top_p,
        top_k=top_k,
        draft_k=draft_k,
        seed=seed,
        draft_head=draft_head,
    )
    ring, target, where = open_ring(redis_option, local_model, model)
    prompt_ids = [target.prompt_ids(t) for t in texts]
    started = time.perf_counter()
    with (
        _closing_ring(ring, plain_errors=(ValueError,)),
        nullcontext([]) if local_model else ring.twins(in_flight - 1) as lanes,
        tqdm(total=cfg.work_units(), desc="proof swarm", unit="stop", leave=False) as bar,
    ):
        result = run_swarm_proof(ring, prompt_ids, cfg, progress=bar.update, lanes=lanes)
    summary = report.SwarmProofSummary.from_result(result)
    text = report.format_swarm_summary(summary, where, time.perf_counter() - started)
    keep = dict(swarm=result, target=target, ring=ring, where=where) if store else None
    _finish(text, result, json_path, summary.passed, keep)


@proof.command(name="generation")
@ring_options
@click.option("--prompt", help="The prompt [default: a built-in one].")
@sampling_options(0.7, 0.95, greedy=False, what="the sampled runs")
@click.option(
    "--seed",
    "seeds",
    type=SEED,
    multiple=True,
    help="Seeds of the sampled runs (repeatable) [default: 7 and 99].",
)
@click.option(
    "--draft-k",
    type=click.IntRange(1, 32),
    default=4,
    show_default=True,
    help="Drafts verified per round in the speculative runs.",
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(1, 4096),
    default=64,
    show_default=True,
    help="Tokens to generate per run.",
)
@click.option(
    "--draft-head/--no-draft-head",
    default=False,
    show_default=True,
    help="Drafts from the tail's draft head, drawn with the Gumbel sampler whose noise it shares.",
)
@json_option
@store_option
def proof_generation(
    redis_option,
    local_model,
    model,
    prompt,
    temp,
    top_p,
    top_k,
    seeds,
    draft_k,
    max_new_tokens,
    draft_head,
    json_path,
    store,
) -> None:
    """Proof 3: one prompt greedy and sampled, speculative and plain, side by side.

    The speculative and plain texts must be identical (same seed, same tokens); the tok/s
    show what speculation gains. Exits 0 only when every pair is identical.

    Example:

        specpipe proof generation --seed 7 --seed 99
    """
    from specpipe.prompts import DEFAULT_GENERATION_PROMPT
    from specpipe.proofs.outputs import run_generation_proof

    if prompt is not None and not prompt.strip():
        raise click.BadParameter("the prompt is empty", param_hint="--prompt")
    ring, target, where = open_ring(redis_option, local_model, model)
    with _closing_ring(ring):
        result = run_generation_proof(
            ring,
            target.prompt_ids(prompt or DEFAULT_GENERATION_PROMPT),
            target.decode,
            temp=temp,
            top_p=top_p,
            top_k=top_k,
            seeds=seeds or (7, 99),
            draft_k=draft_k,
            max_new_tokens=max_new_tokens,
            eos_ids=target.eos_ids,
            draft_head=draft_head,
        )
    summary = report.GenerationProofSummary.from_result(result)
    keep = dict(generation=result, target=target, ring=ring, where=where) if store else None
    _finish(report.format_generation(summary, where), result, json_path, summary.passed, keep)
