"""`specpipe bench …`: the benchmarks behind the speed numbers we quote."""

from __future__ import annotations

import time
from pathlib import Path

import click

from specpipe.cli.options import (
    RELEASED_LAYOUTS,
    SEED,
    hop_delays_option,
    json_option,
    layer_range,
    model_option,
    sampling_options,
    write_json,
)
from specpipe.drafting.tree_size import MAX_SLOTS


@click.group(name="bench")
def bench() -> None:
    """Benchmarks."""


def _verdict(
    result: dict, lines: list[str], json_path: Path | None, say_verdict: bool = True
) -> None:
    """Print a bench's report (and its verdict line), write its JSON, exit 1 unless it passed."""
    for line in lines:
        click.echo(line)
    if say_verdict:
        click.echo(f"verdict {result['verdict']}")
    write_json(json_path, result)
    if result["verdict"] != "PASS":
        raise SystemExit(1)


@bench.command(name="draft")
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


def _model_errors(func):
    """Turn engine errors about the model or Redis into one-line CLI errors."""
    import functools

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        from specpipe.ops.redis_server import RedisUnavailable

        try:
            return func(*args, **kwargs)
        except (ValueError, RedisUnavailable, RuntimeError) as exc:  # ModelError is a ValueError
            raise click.ClickException(str(exc)) from None

    return wrapper


@bench.command(name="ring")
@model_option("Model to serve.")
@click.option(
    "--stages", type=click.IntRange(1, 16), default=4, show_default=True, help="Stage processes."
)
@click.option(
    "--tokens",
    type=click.IntRange(4, 4096),
    default=48,
    show_default=True,
    help="New tokens per generation.",
)
@hop_delays_option((0.0, 10.0, 25.0))
@sampling_options(0.7, 0.95, greedy=True)
@click.option("--seed", type=SEED, default=7, show_default=True)
@click.option("--draft-k", type=click.IntRange(1, 64), default=8, show_default=True)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="torch threads per process.",
)
@click.option(
    "--repeats",
    type=click.IntRange(1, 50),
    default=5,
    show_default=True,
    help="Runs of the overhead measurement; every round of every run counts.",
)
@json_option
@_model_errors
def bench_ring(
    model, stages, tokens, delays, temp, top_p, top_k, seed, draft_k, threads, repeats, json_path
):
    """The ring's cost per hop, and speculative vs plain over slow links.

    Starts a private Redis and STAGES `specpipe worker stage` processes of MODEL, measures the
    overhead per hop against the same model in one process, then for each hop delay runs an
    input-grounded and an open-ended prompt speculative and plain.

    Example:

        specpipe bench ring --stages 4 --hop-delay-ms 0 --hop-delay-ms 25
    """
    from specpipe.bench import ring_hops as ringbench

    click.echo(f"bench ring: {model}, {stages} stages, {tokens} tokens, temp {temp}")
    result = {"overhead": ringbench.overhead(model, stages, tokens, threads, click.echo, repeats)}
    o = result["overhead"]
    low, high = o["overhead_per_hop_ms_interval"]
    click.echo(
        f"overhead per hop: {o['overhead_per_hop_ms']:.2f} ms (95% interval {low:.2f} to "
        f"{high:.2f}; target <= 1 ms); ring/local tok/s {o['tok_s_ratio_ring_vs_local']:.2f}; "
        f"same tokens {o['same_tokens']}"
    )
    click.echo(
        f"  per hop: {o['split_per_hop_ms']:.2f} ms from cutting the model into stages, "
        f"{o['slower_forwards_per_hop_ms']:.2f} ms from forwards slower in separate processes, "
        f"{o['transport_per_hop_ms']:.2f} ms transport and message handling"
    )
    from specpipe.transformer.resolve import open_checkpoint

    result["wire"] = ringbench.wire_costs(open_checkpoint(model).config.dim)
    for rows, us in result["wire"].items():
        click.echo(
            f"wire per hop, {rows.split('_')[0]}-row message: sealed and opened "
            f"{us['swarm key']:.0f} us; with the sender's signature and its check "
            f"{us['host identities']:.0f} us (+{us['signature']:.0f} us)"
        )
    params = {"temp": temp, "top_p": top_p, "top_k": top_k, "seed": seed}
    result["latency"] = ringbench.latency(
        model, stages, delays, tokens, params, draft_k, threads, click.echo
    )
    write_json(json_path, result)


@bench.command(name="load")
@model_option("Model to serve.")
@click.option(
    "--stages", type=click.IntRange(1, 16), default=4, show_default=True, help="Stage processes."
)
@click.option(
    "--jobs",
    "counts",
    type=click.IntRange(1, 64),
    multiple=True,
    default=(1, 2, 4, 8),
    show_default=True,
    help="Jobs at once; repeat for several.",
)
@hop_delays_option((0.0, 25.0))
@click.option(
    "--tokens",
    type=click.IntRange(4, 4096),
    default=48,
    show_default=True,
    help="New tokens per job.",
)
@click.option("--temp", type=click.FloatRange(min=0), default=0.7, show_default=True)
@click.option(
    "--top-p", type=click.FloatRange(0, 1, min_open=True), default=0.95, show_default=True
)
@click.option(
    "--draft-k",
    type=click.IntRange(0, 64),
    default=4,
    show_default=True,
    help="The most drafts a round sends.",
)
@click.option(
    "--fixed-k",
    is_flag=True,
    help="Every round sends what the drafter has, up to --draft-k, instead of the "
    "draft length the coordinator would choose.",
)
@click.option("--seed", type=SEED, default=1, show_default=True)
@json_option
@_model_errors
def bench_load(
    model, stages, counts, delays, tokens, temp, top_p, draft_k, fixed_k, seed, json_path
):
    """Several jobs at once through one ring: aggregate tok/s, time to first token and to done,
    and every job's tokens against its solo run.

    Example:

        specpipe bench load --jobs 1 --jobs 8 --hop-delay-ms 0 --hop-delay-ms 25
    """
    from specpipe.bench import load as loadbench

    counts = sorted(set(counts))
    click.echo(
        f"bench load: {model}, {stages} stages, {tokens} tokens per job, temp {temp}, "
        f"{'fixed' if fixed_k else 'adaptive'} K <= {draft_k}"
    )
    result = loadbench.load(
        model,
        stages,
        counts,
        delays,
        tokens,
        temp,
        top_p,
        draft_k,
        seed,
        click.echo,
        adaptive=not fixed_k,
    )
    write_json(json_path, result)
    if not all(row["identical_to_solo"] for row in result["runs"]):
        raise click.ClickException("a loaded job's tokens differ from its solo run")


@bench.command(name="adaptive-k")
@model_option("Model to serve.")
@click.option(
    "--stages", type=click.IntRange(1, 16), default=4, show_default=True, help="Stage processes."
)
@hop_delays_option((0.0, 25.0))
@click.option(
    "--k",
    "fixed",
    type=click.IntRange(1, 64),
    multiple=True,
    default=(2, 4, 8),
    show_default=True,
    help="Fixed draft lengths to compare; repeat for several.",
)
@click.option(
    "--max-k",
    type=click.IntRange(1, 64),
    default=8,
    show_default=True,
    help="The adaptive rule's largest K (a job's draft_k).",
)
@click.option(
    "--tokens",
    type=click.IntRange(4, 4096),
    default=64,
    show_default=True,
    help="New tokens per job.",
)
@click.option("--temp", type=click.FloatRange(min=0), default=0.7, show_default=True)
@click.option(
    "--top-p", type=click.FloatRange(0, 1, min_open=True), default=0.95, show_default=True
)
@click.option("--seed", type=SEED, default=1, show_default=True)
@click.option(
    "--repeats",
    type=click.IntRange(1, 50),
    default=2,
    show_default=True,
    help="Seeds per prompt; each runs every method.",
)
@json_option
@_model_errors
def bench_adaptive_k(
    model, stages, delays, fixed, max_k, tokens, temp, top_p, seed, repeats, json_path
):
    """Adaptive draft length against plain decoding and fixed K, on a grounded and a novel
    prompt, at each hop delay: tok/s and the ratios, measured side by side in one run, and
    every method's tokens against plain's.

    Example:

        specpipe bench adaptive-k --hop-delay-ms 0 --hop-delay-ms 25 --k 2 --k 4 --k 8
    """
    from specpipe.bench import load as loadbench

    click.echo(f"bench adaptive-k: {model}, {stages} stages, {tokens} tokens per job, temp {temp}")
    result = loadbench.adaptive_k(
        model, stages, delays, fixed, max_k, tokens, temp, top_p, seed, repeats, click.echo
    )
    write_json(json_path, result)
    if not result["identical_to_plain"]:
        raise click.ClickException("a method's tokens differ from plain decoding's")


@bench.command(name="exact")
@model_option("Model to serve.")
@click.option("--stages", type=click.IntRange(1, 16), default=4, show_default=True)
@click.option(
    "--pairs",
    type=click.IntRange(1, 1000),
    default=20,
    show_default=True,
    help="(prompt, seed) pairs.",
)
@click.option("--tokens", type=click.IntRange(1, 4096), default=64, show_default=True)
@sampling_options(0.7, 0.95, greedy=True)
@click.option("--draft-k", type=click.IntRange(1, 64), default=8, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True)
@json_option
@_model_errors
def bench_exact(model, stages, pairs, tokens, temp, top_p, top_k, draft_k, threads, json_path):
    """Exactness on real stage processes: speculative == plain for every (prompt, seed), and
    greedy through the ring == greedy in one process. Exits 1 on any difference.

    Example:

        specpipe bench exact --pairs 20 --tokens 64
    """
    from specpipe.bench import ring_hops as ringbench

    params = {"temp": temp, "top_p": top_p, "top_k": top_k}
    result = ringbench.exactness(model, stages, pairs, tokens, params, draft_k, threads, click.echo)
    greedy_ok = result["greedy_prompts"] - len(result["greedy_ring_vs_local_mismatches"])
    spec_ok = pairs - len(result["spec_vs_plain_mismatches"])
    click.echo(
        f"spec == plain: {spec_ok}/{pairs} pairs; greedy ring == local: {greedy_ok}/"
        f"{result['greedy_prompts']} prompts; verdict {result['verdict']}"
    )
    write_json(json_path, result)
    if result["verdict"] != "PASS":
        raise SystemExit(1)


@bench.command(name="faults")
@model_option("Model to serve.")
@click.option(
    "--stages",
    type=click.IntRange(3, 16),
    default=3,
    show_default=True,
    help="Stage processes (stage 0, the middle ones, the tail).",
)
@click.option(
    "--tokens",
    type=click.IntRange(8, 4096),
    default=48,
    show_default=True,
    help="New tokens per job.",
)
@click.option(
    "--stage-kills",
    type=click.IntRange(min=0),
    default=5,
    show_default=True,
    help="SIGKILLs of stage 0, of a middle stage and of the tail, each.",
)
@click.option(
    "--coordinator-kills",
    type=click.IntRange(min=0),
    default=5,
    show_default=True,
    help="SIGKILLs of the coordinator.",
)
@click.option(
    "--redis-kills",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="SIGKILLs of Redis, with a job running and two queued.",
)
@click.option(
    "--stops",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="SIGSTOPs of a middle stage, each for --stop-s.",
)
@click.option("--stop-s", type=click.FloatRange(min=0), default=30.0, show_default=True)
@click.option(
    "--db-outages",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="Times the database goes away, each for --db-down-s.",
)
@click.option("--db-down-s", type=click.FloatRange(min=0), default=10.0, show_default=True)
@click.option(
    "--postgres",
    metavar="URL",
    help="A PostgreSQL server for the database outages (a database is created there and "
    "dropped after); without it the SQLite store's write lock is held.",
)
@click.option(
    "--resplits",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="Restarts of a middle stage with another layer range.",
)
@click.option(
    "--deadline-s",
    type=click.FloatRange(min=10),
    default=300.0,
    show_default=True,
    help="A job not finished this long after its fault counts as stuck.",
)
@click.option(
    "--seed",
    type=SEED,
    default=0,
    show_default=True,
    help="Seeds the jobs, the rounds hit and the job seeds.",
)
@json_option
@_model_errors
def bench_faults(
    model,
    stages,
    tokens,
    stage_kills,
    coordinator_kills,
    redis_kills,
    stops,
    stop_s,
    db_outages,
    db_down_s,
    postgres,
    resplits,
    deadline_s,
    seed,
    json_path,
):
    """The fault matrix: faults injected into the running stack, and what became of each job.

    Runs the stack as `specpipe up` does (private Redis, supervisor) in a temporary folder,
    submits jobs and, at a random round of a running job, kills a stage, the coordinator or
    Redis, stops a stage, takes the database away, or restarts a stage with another layer
    range. Every job must end identical to its reference run (the same job in one process) or
    failed with a reason: none lost, none stuck, none different. Exits 1 otherwise.

    Example:

        specpipe bench faults --stage-kills 5 --postgres postgresql://127.0.0.1/test
    """
    import tempfile
    from pathlib import Path

    from specpipe.bench import faults as faultbench

    counts = {
        "kill-stage0": stage_kills,
        "kill-middle": stage_kills,
        "kill-tail": stage_kills,
        "kill-coordinator": coordinator_kills,
        "kill-redis": redis_kills,
        "stop-stage": stops,
        "db-down": db_outages,
        "resplit": resplits,
    }
    counts = {fault: n for fault, n in counts.items() if n}
    click.echo(f"bench faults: {model}, {stages} stages, {tokens} tokens per job")
    with tempfile.TemporaryDirectory(prefix="specpipe-faults-") as workdir:
        result = faultbench.run_matrix(
            model,
            counts,
            Path(workdir),
            click.echo,
            stages=stages,
            tokens=tokens,
            postgres=postgres,
            stop_s=stop_s,
            db_down_s=db_down_s,
            deadline_s=deadline_s,
            seed=seed,
        )
    _verdict(result, faultbench.table(result["rows"]), json_path)


@bench.command(name="soak")
@model_option("Model to serve.")
@click.option(
    "--minutes",
    type=click.FloatRange(min=0.1),
    default=20.0,
    show_default=True,
    help="How long users submit jobs and faults are injected (every kind at least once).",
)
@click.option("--users", type=click.IntRange(1, 64), default=3, show_default=True)
@click.option(
    "--jobs-per-user",
    type=click.IntRange(1, 16),
    default=2,
    show_default=True,
    help="Jobs each user has in flight at once (a wave: the next once they have all ended).",
)
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seeds the chaos schedule.")
@click.option(
    "--tokens",
    type=click.IntRange(4, 4096),
    default=48,
    show_default=True,
    help="New tokens per job.",
)
@click.option(
    "--link-delay-ms",
    "delays",
    default="11,8,3.4,19",
    show_default=True,
    help="One-way delay of each of the four stage hosts' links, in ring order (the spare "
    "has its copied host's).",
)
@click.option(
    "--pause-s",
    type=click.FloatRange(min=0),
    default=20.0,
    show_default=True,
    help="Seconds between one fault's recovery and the next fault.",
)
@click.option(
    "--hold-s",
    type=(click.FloatRange(min=0, max=20), click.FloatRange(min=0, max=20)),
    default=(3.0, 8.0),
    show_default=True,
    help="The range a held fault's length is drawn from (a stalled or full Redis, a skewed "
    "clock; link cuts last 5, 30 or 90 s by kind): 20 s at most, well under a round's wait, "
    "so that no job need fail of one.",
)
@click.option(
    "--kinds",
    default="all",
    show_default=True,
    help="The fault kinds to inject, comma-separated (`specpipe/bench/soak.py` lists them).",
)
@click.option(
    "--overlap",
    type=click.FloatRange(0, 1),
    default=0.25,
    show_default=True,
    help="The share of faults during which a second one starts, on another host.",
)
@click.option(
    "--cut-stall-s",
    type=click.FloatRange(min=0),
    default=3.0,
    show_default=True,
    help="The most a link cut on a host with a spare may cost a running job (the time from "
    "the cut to its next stored round).",
)
@click.option(
    "--deadline-s",
    type=click.FloatRange(min=10),
    default=600.0,
    show_default=True,
    help="A job not ended this long after the time is up counts as stuck.",
)
@click.option(
    "--warm-up-s",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="Seconds of the users' load, before the first fault, after which each process's "
    "memory is its size after warm-up.",
)
@click.option(
    "--home",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The lab's folder [default: a temporary one].",
)
@json_option
@_model_errors
def bench_soak(
    model,
    minutes,
    users,
    jobs_per_user,
    seed,
    tokens,
    delays,
    pause_s,
    hold_s,
    kinds,
    overlap,
    cut_stall_s,
    deadline_s,
    warm_up_s,
    home,
    json_path,
):
    """A WAN soak on the lab (root only): users submit jobs through the JSON API for
    --minutes while a seeded chaos schedule cuts stage hosts' links for 5, 30 and 90 s,
    stalls and fills their Redis, kills their stages (and OOM-kills them in a memory cgroup)
    and skews their clocks, on hosts with a spare and without; on host 0 it kills the
    coordinator, kills, stalls and fills the registry's Redis and skews the coordinator's
    clock; some faults overlap. Reports each job's end (against its solo run), per fault
    kind the jobs it touched and its recovery, stall and takeover times, tokens per minute
    and every lab process's memory. Exits 1 on a lost, stuck or different job, a failed one
    where recovery was possible, a lab process that died of a fault that did not kill it, a
    link cut with a spare that cost a job over --cut-stall-s, or a process whose memory grew
    over 10 % after warm-up.

    Example:

        specpipe bench soak --minutes 20 --users 3 --seed 1
    """
    import tempfile

    from specpipe.bench import soak as soakbench
    from specpipe.cli.lab import link_delays
    from specpipe.ops.lab_hosts import LabError, check_can_run

    ms = link_delays(None, None, delays)
    if len(ms) != soakbench.STAGES:
        raise click.BadParameter(
            f"give {soakbench.STAGES} delays, one per stage host", param_hint="--link-delay-ms"
        )
    chosen = soakbench.KINDS if kinds == "all" else [k.strip() for k in kinds.split(",")]
    unknown = [k for k in chosen if k not in soakbench.KINDS]
    if unknown or not chosen:
        raise click.BadParameter(
            f"no such kind: {', '.join(unknown) or '(none)'}; the kinds are "
            f"{', '.join(soakbench.KINDS)}",
            param_hint="--kinds",
        )
    try:
        check_can_run()
    except LabError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"bench soak: {model}, {minutes:g} min, {users} users, seed {seed}")
    with tempfile.TemporaryDirectory(prefix="specpipe-soak-") as scratch:
        result = soakbench.run_soak(
            model,
            home or Path(scratch) / "lab",
            click.echo,
            minutes=minutes,
            users=users,
            jobs_per_user=jobs_per_user,
            seed=seed,
            tokens=tokens,
            pause_s=pause_s,
            hold_s=hold_s,
            deadline_s=deadline_s,
            warm_up_s=warm_up_s,
            delays=ms,
            kinds=chosen,
            overlap=overlap,
            cut_stall_s=cut_stall_s,
        )
    _verdict(result, soakbench.report(result), json_path, say_verdict=False)


@bench.command(name="long-prompt")
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
@_model_errors
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
    _verdict(result, longbench.report(result), json_path)


@bench.command(name="load-api")
@model_option("Model to serve.")
@click.option("--stages", type=click.IntRange(1, 16), default=3, show_default=True)
@click.option(
    "--users",
    type=click.IntRange(1, 1000),
    default=8,
    show_default=True,
    help="Users, each with an API token of their own.",
)
@click.option(
    "--jobs",
    type=click.IntRange(1, 100_000),
    default=200,
    show_default=True,
    help="Jobs submitted, the users taking turns.",
)
@click.option(
    "--within-s",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="The submissions are spread evenly over this many seconds.",
)
@click.option(
    "--tokens",
    type=click.IntRange(1, 4096),
    default=16,
    show_default=True,
    help="New tokens per job.",
)
@click.option(
    "--deadline-s",
    type=click.FloatRange(min=10),
    default=1800.0,
    show_default=True,
    help="A job not finished this long after submitting counts as stuck.",
)
@json_option
@_model_errors
def bench_load_api(model, stages, users, jobs, within_s, tokens, deadline_s, json_path):
    """The JSON API under load: --jobs jobs from --users users through POST /api/v1/jobs.

    Runs the stack as `specpipe up` does in a temporary folder, makes the users and their
    tokens in its store, submits the jobs over --within-s seconds and waits for every one.
    Reports 429s (the per-user limits: SPECPIPE_SUBMIT_RATE, SPECPIPE_MAX_ACTIVE_JOBS), time
    to done (p50, p95), 5xx answers, and every process's memory before and after. Exits 1 when
    a job is lost or stuck, a request got a 5xx or no answer.

    Example:

        specpipe bench load-api --users 8 --jobs 200 --within-s 60
    """
    import tempfile
    from pathlib import Path

    from specpipe.bench import api_load as apiloadbench

    click.echo(f"bench load-api: {model}, {stages} stages, {jobs} jobs from {users} users")
    with tempfile.TemporaryDirectory(prefix="specpipe-load-") as workdir:
        result = apiloadbench.run_load(
            model,
            Path(workdir),
            click.echo,
            stages=stages,
            users=users,
            jobs=jobs,
            within_s=within_s,
            tokens=tokens,
            deadline_s=deadline_s,
        )
    _verdict(result, apiloadbench.report(result), json_path)


@bench.command(name="wan")
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
@_model_errors
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


@bench.command(name="draft-head")
@model_option("The target model.")
@click.option(
    "--head",
    "head_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The head file (default: the one shipped for the model).",
)
@click.option(
    "--k",
    "draft_k",
    type=click.IntRange(1, 16),
    default=5,
    show_default=True,
    help="Drafts per round (the tail's cost); the largest K on the ring.",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Timings per figure (the median is shown).",
)
@sampling_options(0.7, 0.95, greedy=False, what="the tail's cost")
@click.option(
    "--ring/--no-ring",
    default=True,
    show_default=True,
    help="Also run jobs on real stage processes: head, n-gram and both vs plain.",
)
@click.option(
    "--stages",
    type=click.IntRange(1, 16),
    default=4,
    show_default=True,
    help="Stage processes of the ring.",
)
@hop_delays_option((0.0, 25.0))
@click.option(
    "--tokens",
    type=click.IntRange(4, 4096),
    default=48,
    show_default=True,
    help="New tokens per job on the ring.",
)
@click.option(
    "--seeds",
    type=click.IntRange(1, 50),
    default=4,
    show_default=True,
    help="Jobs per kind of prompt on the ring, each with a seed of its own and the "
    "next of the kind's prompts; each runs every method.",
)
@json_option
@_model_errors
def bench_draft_head(
    model: str,
    head_path: Path | None,
    draft_k: int,
    repeats: int,
    temp: float,
    top_p: float,
    top_k: int,
    ring: bool,
    stages: int,
    delays: tuple[float, ...],
    tokens: int,
    seeds: int,
    json_path: Path | None,
) -> None:
    """What a round's tail costs with the draft head (the verify with the inverse-CDF sampler
    and with the Gumbel one, the head's K drafts, the Gumbel noise of one position); then, with
    --ring, jobs on real stage processes whose tail holds the head: tok/s,
    tokens per round and spec/plain for the head, the n-gram drafter and both, greedy and at
    temp 0.7 / top_p 0.95, grounded and novel prompts, each hop delay. Agreement per draft
    position against its ceiling: `specpipe drafter eval`.

    Example:

        specpipe bench draft-head --hop-delay-ms 0 --hop-delay-ms 25
    """
    from specpipe.bench import load as loadbench
    from specpipe.cli.drafter import load_head, open_whole_model
    from specpipe.core.sampling import SamplingParams
    from specpipe.drafting.train import EVAL_PROMPTS, tail_costs

    label, cfg, tokenizer, _, stage = open_whole_model(model, threads=1)
    head, _ = load_head(head_path, label, cfg)
    prompt = tokenizer.prompt_ids(EVAL_PROMPTS[0])
    params = SamplingParams(temp=temp, top_p=top_p, top_k=top_k, seed=1)
    costs = tail_costs(stage, head, prompt, draft_k, params, repeats)
    click.echo(
        f"{label}, K={draft_k}, temp {temp} top_p {top_p} top_k {top_k}, one thread: verify "
        f"{costs['verify_inverse_cdf_ms']:.2f} ms (inverse CDF) vs "
        f"{costs['verify_gumbel_ms']:.2f} ms (Gumbel); "
        f"head drafts {costs['head_drafts_ms']:.2f} ms; "
        f"noise {costs['noise_whole_vocab_ms']:.2f} ms over the vocabulary ({costs['vocab']:.0f}) "
        f"vs {costs['noise_support_ms']:.3f} ms over the support ({costs['support_size']:.0f})"
    )
    result: dict[str, object] = {"tail_costs": costs}
    if ring:
        result["ring"] = loadbench.draft_sources(
            model,
            stages,
            delays,
            draft_k,
            tokens,
            1,
            seeds,
            click.echo,
            None if head_path is None else str(head_path),
        )
    write_json(json_path, result)
    if ring and not result["ring"]["identical_to_plain"]:
        raise click.ClickException("a drafter's tokens differ from plain decoding's")


@bench.command(name="trees")
@model_option("The target model.")
@click.option(
    "--head",
    "head_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The tail's head file (default: the one shipped for the model).",
)
@click.option(
    "--k",
    "draft_k",
    type=click.IntRange(1, 16),
    default=6,
    show_default=True,
    help="The most drafts a round sends in a chain; the deepest a tree goes.",
)
@click.option(
    "--stages",
    type=click.IntRange(1, 16),
    default=4,
    show_default=True,
    help="Stage processes of the ring.",
)
@hop_delays_option((0.0, 25.0))
@click.option(
    "--tokens",
    type=click.IntRange(4, 4096),
    default=96,
    show_default=True,
    help="New tokens per job.",
)
@click.option(
    "--seeds",
    type=click.IntRange(1, 50),
    default=4,
    show_default=True,
    help="Jobs per kind of prompt, each with a seed of its own and the next of the kind's "
    "prompts; each runs every method.",
)
@click.option(
    "--at-once",
    type=click.IntRange(0, 64),
    default=8,
    show_default=True,
    help="Then this many jobs together, chains and then trees (0 or 1: none).",
)
@click.option(
    "--fixed-tree",
    "fixed",
    type=click.IntRange(1, MAX_SLOTS),
    multiple=True,
    help="Also trees of this many drafts every round, whatever their rows cost (repeatable).",
)
@click.option("--seed", type=SEED, default=1, show_default=True)
@json_option
@_model_errors
def bench_trees(
    model: str,
    head_path: Path | None,
    draft_k: int,
    stages: int,
    delays: tuple[float, ...],
    tokens: int,
    seeds: int,
    at_once: int,
    fixed: tuple[int, ...],
    seed: int,
    json_path: Path | None,
) -> None:
    """Draft trees against chains on real stage processes whose tail holds the draft head:
    plain, chains and trees (n-gram and head, adaptive), greedy and at temp 0.7 / top_p 0.95,
    grounded and novel prompts, each hop delay; tok/s, tokens per round, rows per round,
    accepted depth, the share of tree rounds; then --at-once jobs together. Every job's tokens
    are checked against plain decoding's. With --fixed-tree N, trees of N drafts every round
    run beside them: what a tree that size commits where rows are nearly free, and costs here.

    Example:

        specpipe bench trees --hop-delay-ms 0 --hop-delay-ms 25
    """
    from specpipe.bench.draft_trees import trees

    result = trees(
        model,
        stages,
        delays,
        draft_k,
        tokens,
        seed,
        seeds,
        at_once,
        click.echo,
        None if head_path is None else str(head_path),
        fixed,
    )
    write_json(json_path, result)
    if not result["identical_to_plain"]:
        raise click.ClickException("a method's tokens differ from plain decoding's")


@bench.command(name="stage-memory")
@click.option(
    "--like",
    type=click.Choice(RELEASED_LAYOUTS),
    default="gpt-oss-120b",
    show_default=True,
    help="The released model whose stages to make and load (random weights, its layout).",
)
@click.option(
    "--layers",
    "ranges",
    multiple=True,
    callback=lambda ctx, param, values: tuple(layer_range(ctx, param, v) for v in values),
    help="A stage's layers A:B (repeatable) [default: 0:9, 9:18 and 27:36].",
)
@click.option("--card-gib", type=click.FloatRange(min=1), default=24.0, show_default=True)
@click.option(
    "--reserve-gib",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="Memory of the card kept for activations and the runtime.",
)
@click.option(
    "--sessions",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Sessions sharing the KV budget.",
)
@click.option(
    "--dir",
    "workdir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the checkpoints are made (they take the stages' size on disk) [default: a "
    "temporary folder].",
)
@click.option("--keep", is_flag=True, help="Keep the checkpoints made (a later run reuses them).")
@json_option
def bench_stage_memory(like, ranges, card_gib, reserve_gib, sessions, workdir, keep, json_path):
    """What one stage of a real-size model holds: weights, RSS, load time, KV per token, and
    the context it leaves on a card, range by range (the tail with a draft head).

    Makes each range's checkpoint with `specpipe model synth` (no download; gpt-oss-120b's 9
    layers take about 15 GiB of disk) and loads it in a child process in bf16 as a GPU would
    hold it. PASS when every stage fits the card.

    Example:

        specpipe bench stage-memory --like gpt-oss-120b --card-gib 24 --sessions 8
    """
    from specpipe.bench import stage_memory

    result = stage_memory.run(
        like,
        ranges or stage_memory.RANGES,
        card_gib=card_gib,
        reserve_gib=reserve_gib,
        sessions=sessions,
        workdir=workdir,
        keep=keep,
        progress=click.echo,
    )
    result["verdict"] = "PASS" if all(r["budget"]["fits"] for r in result["stages"]) else "FAIL"
    _verdict(result, [], json_path)


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


@bench.command(name="reference")
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


@bench.command(name="taps")
@click.option(
    "--rows",
    type=click.IntRange(1, 512),
    default=5,
    show_default=True,
    help="Rows of a decode round (draft K + 1).",
)
@click.option(
    "--mbit-s",
    type=click.FloatRange(min=0.1),
    default=100.0,
    show_default=True,
    help="A link's bandwidth, to price the bytes the taps add.",
)
@json_option
def bench_taps(rows, mbit_s, json_path):
    """What an EAGLE-3 head's taps add to a round on the wire: sealed round messages of each
    hop, with and without them, for the default model and gpt-oss-120b's shapes.

    Example:

        specpipe bench taps --rows 5 --mbit-s 100
    """
    from specpipe.bench import taps

    result = [taps.measure(shape, rows, mbit_s) for shape in taps.shapes()]
    for line in taps.report(result):
        click.echo(line)
    write_json(json_path, result)


@bench.command(name="drafting")
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


@bench.command(name="parity")
@click.option(
    "--like",
    type=click.Choice(RELEASED_LAYOUTS),
    default="gpt-oss-20b",
    show_default=True,
    help="The released layout, cut to its first layers (the 20b's layers have the 120b's "
    "shapes, with 32 experts instead of 128).",
)
@click.option("--n-layers", type=click.IntRange(1, 36), default=2, show_default=True)
@click.option("--tokens", type=click.IntRange(1, 512), default=12, show_default=True)
@click.option(
    "--steps",
    type=click.IntRange(0, 256),
    default=8,
    show_default=True,
    help="Greedy tokens decoded one at a time after the prompt.",
)
@json_option
def bench_parity(like, n_layers, tokens, steps, json_path):
    """Our stages against transformers' GptOss at gpt-oss's real shapes, on the CPU: logits of
    a prompt within the tiny fixtures' tolerance, and the same greedy tokens (random MXFP4
    weights; needs transformers, as `make install` puts it). Two layers of gpt-oss-20b's
    shapes took 21 GB of memory at the peak, and about two minutes.

    Example:

        specpipe bench parity --like gpt-oss-20b --n-layers 2
    """
    try:
        from specpipe.bench import parity
    except ImportError as exc:  # transformers is a test dependency
        raise click.ClickException(f"bench parity needs transformers: {exc}") from None
    result = parity.run(like, n_layers, tokens, steps)
    lines = [
        f"{like} cut to {n_layers} layers ({result['checkpoint_bytes'] / 2**30:.2f} GiB), "
        f"{tokens} prompt tokens: max |ours - transformers| {result['max_abs_diff']:.2e} "
        f"(tolerance {result['tolerance']:g}, logits up to {result['logits_scale']:.2f}), "
        f"argmax identical: {result['argmax_identical']}",
        f"greedy {steps} tokens: ours {result['greedy_ours']}, transformers "
        f"{result['greedy_transformers']}",
        f"seconds: {result['seconds']}",
    ]
    _verdict(result, lines, json_path)


@bench.command(name="web")
@click.option(
    "--streams",
    type=click.IntRange(0, 500),
    default=50,
    show_default=True,
    help="Streamed /v1 completions held open.",
)
@click.option(
    "--waits",
    type=click.IntRange(0, 500),
    default=20,
    show_default=True,
    help="Non-streamed /v1 completions left waiting.",
)
@click.option(
    "--logins",
    type=click.IntRange(1, 1000),
    default=20,
    show_default=True,
    help="GET /login timed while they are open.",
)
@click.option(
    "--users",
    type=click.IntRange(1, 100),
    default=10,
    show_default=True,
    help="Users the completions are spread over.",
)
@json_option
def bench_web(streams: int, waits: int, logins: int, users: int, json_path: Path | None) -> None:
    """The login page's time while /v1 completions are open: a fresh `specpipe web` (waitress,
    a private Redis, no coordinator, so every job stays queued) holds STREAMS streamed and
    WAITS waiting completions; GET /login must answer within 1 s. Exits 1 when it does not.

    Example:

        specpipe bench web --streams 50 --waits 20
    """
    from specpipe.bench import web_load

    try:
        result = web_load.run(streams, waits, logins, users, log=click.echo)
    except (RuntimeError, OSError) as exc:  # RedisUnavailable is a RuntimeError
        raise click.ClickException(str(exc)) from None
    write_json(json_path, result.to_json())
    opened, asked = result.streams_open + result.waits_open, streams + waits
    if opened < asked:
        raise click.ClickException(
            f"only {opened} of {asked} completions stayed open (SPECPIPE_OPEN_COMPLETIONS and "
            "SPECPIPE_OPEN_COMPLETIONS_PER_USER bound them)"
        )
    if not result.passed:
        raise click.ClickException(
            f"GET /login took up to {result.login_max_ms:.0f} ms "
            f"({result.login_failures} unanswered): over the {web_load.TARGET_MS:.0f} ms target"
        )
