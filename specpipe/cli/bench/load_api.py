"""`specpipe bench load-api`: its options and its report; its driver is
`specpipe.bench.api_load`."""

from __future__ import annotations

from pathlib import Path

import click

from specpipe.cli.bench.reporting import model_errors, verdict
from specpipe.cli.options import (
    json_option,
    model_option,
)


@click.command(name="load-api")
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
@model_errors
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
    verdict(result, apiloadbench.report(result), json_path)
