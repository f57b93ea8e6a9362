"""`specpipe proof …`: the statistical and exact proofs that sampling is lossless."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click


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
    type=click.IntRange(0, 2**63 - 1),
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
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    help="Write the full result document here.",
)
def proof_local(draws, vocab, seed, temps, top_ps, top_ks, json_path) -> None:
    """Proof 1: the verify rule's committed tokens follow the target exactly.

    Runs both verify forms over temperature × top-p × top-k × draft cases, checks three lossy
    mutants are caught, greedy is argmax, and verify commits what plain sampling draws.
    Exits 0 only when every gate passes.

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
    elapsed = time.perf_counter() - started
    click.echo(format_local_summary(result, elapsed))
    if json_path:
        try:
            json_path.write_text(json.dumps(result, indent=2) + "\n")
        except OSError as exc:
            raise click.ClickException(f"cannot write {json_path}: {exc.strerror}") from None
        click.echo(f"wrote {json_path}")
    if result["proof_1_local_math"]["verdict"] != "PASS":
        raise SystemExit(1)


def format_local_summary(result: dict, elapsed: float) -> str:
    """A readable summary of proof 1."""
    head, cases = result["proof_1_local_math"], result["cases"]
    multi, greedy = result["multi_position"], result["greedy"]
    coupling = result["exact_coupling"]
    forms = len(cases) // max(head["configs_tested"], 1)
    rows = [
        (
            "cases",
            f"{head['configs_tested']} × {forms} forms, {head['draws_per_case']:,} draws "
            f"each, vocab {head['vocab']}",
        ),
        ("worst TV vs target", f"{head['worst_tv_committed_vs_target']:.4f} (gate {head['gate']})"),
        (
            "worst chi-square p",
            f"{result['worst_p_value']:.3g} "
            f"(alpha {result['chi_square_alpha_per_test']:.2g} per test)",
        ),
        ("cases failing", str(sum(not c["pass"] for c in cases))),
        (
            "K=3 joint law",
            f"exact diff {multi['exact_enumeration_max_abs_diff']:.1e}, TV coupled "
            f"{multi['coupled']['tv']:.4f}, residual {multi['residual']['tv']:.4f}, "
            f"{'ok' if multi['pass'] else 'FAILED'}",
        ),
    ]
    for m in result["mutants"]:
        verdict = "caught" if m["caught"] else "NOT CAUGHT"
        rows.append((f"mutant {m['name']}", f"worst TV {m['worst_tv']:.3f}, {verdict}"))
    rows.append(("greedy == argmax", f"{greedy['rows']:,} rows, {greedy['mismatches']} mismatches"))
    rows.append(
        ("verify == plain", f"{coupling['trials']:,} trials, {coupling['mismatches']} mismatches")
    )
    width = max(len(name) for name, _ in rows)
    lines = ["proof 1: the local math"] + [f"  {name:<{width}}  {value}" for name, value in rows]
    lines.append(f"verdict: {head['verdict']} ({elapsed:.1f} s)")
    return "\n".join(lines)
