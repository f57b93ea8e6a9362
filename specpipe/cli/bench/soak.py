"""`specpipe bench soak`: its options and its report; its driver is
`specpipe.bench.soak`."""

from __future__ import annotations

from pathlib import Path

import click

from specpipe.cli.bench.reporting import model_errors, verdict
from specpipe.cli.options import (
    SEED,
    json_option,
    model_option,
)


@click.command(name="soak")
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
@model_errors
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
    from specpipe.ops.lab_network import LabError, check_can_run

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
    verdict(result, soakbench.report(result), json_path, say_verdict=False)
