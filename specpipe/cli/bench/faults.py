"""`specpipe bench faults`: its options and its report; its driver is
`specpipe.bench.faults`."""

from __future__ import annotations

from pathlib import Path

import click

from specpipe.cli.bench.reporting import model_errors, verdict
from specpipe.cli.options import (
    SEED,
    json_option,
    model_option,
)


@click.command(name="faults")
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
@model_errors
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
    verdict(result, faultbench.table(result["rows"]), json_path)
