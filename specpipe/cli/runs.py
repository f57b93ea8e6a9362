"""`specpipe runs`: the stored generation and proof runs, and their JSON run records."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specpipe.cli.options import store_session


def _find_run(session, run_ref: str):
    """A run by its numeric id or its name (the run record's run_id)."""
    from sqlalchemy import select

    from models.runs import Run

    run = session.scalar(select(Run).where(Run.name == run_ref))
    if run is None and run_ref.isdigit() and int(run_ref) < 2**31:
        run = session.get(Run, int(run_ref))
    if run is None:
        raise click.ClickException(f"no run {run_ref!r} (see `specpipe runs list`)")
    return run


def _database_error(exc: Exception) -> click.ClickException:
    return click.ClickException(
        f"cannot read the store: {exc.__class__.__name__}: "
        f"{str(exc).splitlines()[0] if str(exc) else ''}"
    )


@click.group(name="runs", invoke_without_command=True)
@click.pass_context
def runs(ctx: click.Context) -> None:
    """Generation and proof runs (lists them when called bare)."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(runs_list)


@runs.command(name="list")
@click.option(
    "--kind", type=click.Choice(["generation", "proof", "nightly"]), help="Only runs of this kind."
)
@click.option(
    "--limit",
    type=click.IntRange(1, 10_000),
    default=25,
    show_default=True,
    help="How many of the newest runs.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def runs_list(kind: str | None, limit: int, as_json: bool) -> None:
    """The newest runs: id, when, kind, verdict, model.

    Example:

        specpipe runs list --kind nightly --limit 7
    """
    from sqlalchemy import select
    from sqlalchemy.exc import SQLAlchemyError

    from models.db import iso_utc
    from models.runs import Run

    with store_session() as session:
        try:
            query = select(Run).order_by(Run.created_at.desc(), Run.id.desc()).limit(limit)
            if kind:
                query = query.where(Run.kind == kind)
            rows = [
                {
                    "id": r.id,
                    "run_id": r.name,
                    "utc": iso_utc(r.created_at),
                    "kind": r.kind,
                    "verdict": r.verdict,
                    "model": r.model,
                }
                for r in session.scalars(query)
            ]
        except SQLAlchemyError as exc:
            raise _database_error(exc) from None
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no runs yet")
        return
    for r in rows:
        click.echo(
            f"{r['run_id']}\t{r['utc']}\t{r['kind']}\t{r['verdict'] or '-'}\t{r['model'] or '-'}"
        )


@runs.command(name="export")
@click.argument("run_ref", metavar="RUN_ID")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write to this file instead of standard output.",
)
def runs_export(run_ref: str, output: Path | None) -> None:
    """The run record of RUN_ID as JSON (the same document the web app downloads).

    Example:

        specpipe runs export 20261129T030000Z-1a2b3c -o record.json
    """
    from sqlalchemy.exc import SQLAlchemyError

    from models.records import record_of

    with store_session() as session:
        try:
            record = record_of(_find_run(session, run_ref))
        except SQLAlchemyError as exc:
            raise _database_error(exc) from None
    text = json.dumps(record, indent=2) + "\n"
    if output is None:
        click.echo(text, nl=False)
        return
    try:
        output.write_text(text)
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc.strerror}") from None


@runs.command(name="show")
@click.argument("run_ref", metavar="RUN_ID")
def runs_show(run_ref: str) -> None:
    """A readable summary of RUN_ID: its verdict, each proof and the ring it ran on."""
    from sqlalchemy.exc import SQLAlchemyError

    from models.records import record_of

    with store_session() as session:
        try:
            record = record_of(_find_run(session, run_ref))
        except SQLAlchemyError as exc:
            raise _database_error(exc) from None
    click.echo(format_record(record))


def format_record(record: dict) -> str:
    """The run record as a few readable lines."""
    lines = [
        f"run {record['run_id']}  {record['utc']}",
        f"  model     {record['model'] or '-'} ({record['quant'] or '-'})",
        f"  commit    {record['shard_commit'] or '-'}",
    ]
    if record.get("claim"):
        lines.append(f"  claim     {record['claim']}")
    proof1, proof2, proof3 = (
        record.get(k) for k in ("proof_1_local_math", "proof_2_on_swarm", "proof_3_generation")
    )
    if proof1:
        lines.append(
            f"  proof 1   {proof1.get('verdict')}: worst TV "
            f"{proof1.get('worst_tv_committed_vs_target')} over "
            f"{proof1.get('configs_tested')} cases (gate {proof1.get('gate')})"
        )
    if proof2:
        lines.append(
            f"  proof 2   {proof2.get('verdict')}: {proof2.get('stops')} stops × "
            f"{proof2.get('draws_per_mode_per_stop')} draws, mean TV spec/plain "
            f"{proof2.get('mean_tv_spec_vs_plain')}, noise floor "
            f"{proof2.get('mean_tv_noise_floor_plain_vs_plain')}"
        )
    if proof3:
        for mode, entry in proof3.items():
            if isinstance(entry, dict):
                lines.append(
                    f"  proof 3   {mode}: {entry.get('tok_s')} tok/s, "
                    f"{(entry.get('text') or entry.get('title') or '')[:60]!r}"
                )
    for node in record.get("nodes") or []:
        lines.append(
            f"  node      {node['role']} layers {node['layer_range']} "
            f"{node.get('geo') or ''} {node.get('gpu_name') or ''}".rstrip()
        )
    if record.get("topology"):
        lines.append(f"  topology  {record['topology']}")
    return "\n".join(lines)
