"""Real proof results saved to the store: the run record keeps them, the pages show them."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner
from sqlalchemy import select

import tests.regression.toy_target  # noqa: F401  (the `toy` target)
from models.proof_store import run_verdict, save_proof_run
from models.records import run_record
from models.runs import Run
from specpipe.cli import cli
from specpipe.decoding.local_ring import LocalRing
from specpipe.proofs.local import LocalProofConfig, run_local_proof
from specpipe.proofs.outputs import run_generation_proof
from specpipe.proofs.swarm import SwarmProofConfig, run_swarm_proof
from tests.engine.toy_stages import toy_stages
from tests.factories import gen_ring

LOCAL = LocalProofConfig(
    draws=4_000,
    temps=(0.8,),
    top_ps=(0.9, 1.0),
    top_ks=(0,),
    greedy_rows=100,
    coupling_trials=500,
    sampler_trials=20,
    gate_tv=0.05,
)
SWARM = SwarmProofConfig(stops=3, draws=100, temp=1.0, top_p=1.0, generation_tokens=16)
PROMPTS = [[3, 7, 1, 9, 3, 7, 1, 9], [5, 6, 7, 8]]


def test_real_proofs_saved_exported_and_shown(session, client):
    gen_ring(session, 2)
    local = run_local_proof(LOCAL)
    swarm = run_swarm_proof(LocalRing(toy_stages()), PROMPTS, SWARM)
    generation = run_generation_proof(LocalRing(toy_stages()), PROMPTS[0], str, max_new_tokens=12)
    run = save_proof_run(
        session,
        nightly=True,
        local=local,
        swarm=swarm,
        generation=generation,
        model="toy",
        quant="fp32",
    )
    session.commit()

    record = run_record(session, run.id)
    assert record["proof_1_local_math"] == local["proof_1_local_math"]
    assert record["proof_2_on_swarm"] == swarm["proof_2_on_swarm"]
    greedy = record["proof_3_generation"]["greedy_temp0"]
    assert greedy["text"] == generation["greedy_temp0"]["text"] and "spec" not in greedy
    assert [n["role"] for n in record["nodes"]] == ["stage0", "tail"]
    expected = "pass" if local["proof_1_local_math"]["verdict"] == "PASS" else "fail"
    assert run.proofs[0].verdict == expected
    assert len(run.proofs[0].cases) == len(local["cases"])
    stops = run.proofs[1].cases
    assert len(stops) == 3 and all(sum(c.spec_counts.values()) == 100 for c in stops)

    html = client.get(f"/proofs/{run.id}").get_data(as_text=True)
    assert "Local math" in html and "On swarm" in html and "Generation" in html
    for url in re.findall(r'src="(/proofs/plots/[^"]+\.png)"', html):
        assert client.get(url).status_code == 200
    assert "nightly" in client.get("/proofs/").get_data(as_text=True)


@pytest.mark.parametrize(
    ("proofs", "verdict"),
    [
        (["pass", "pass", "pass"], "pass"),
        (["pass", "fail", "error"], "fail"),
        (["pass", "error"], "error"),
        ([], "error"),
    ],
)
def test_a_run_passes_only_when_every_proof_passes(proofs, verdict):
    assert run_verdict(proofs) == verdict


GENERATION = ["proof", "generation", "--local", "toy", "--max-new-tokens", "12", "--seed", "5"]


def test_a_proof_run_from_the_cli_is_stored_and_listed(session, client, db_url, monkeypatch):
    """`specpipe proof …` keeps its run in the store, as the nightly does, so the Proofs page
    lists it; a run in one process records no ring, whatever the inventory holds."""
    monkeypatch.setenv("DATABASE_URL", db_url)
    gen_ring(session, 2)
    result = CliRunner().invoke(cli, GENERATION)
    assert result.exit_code == 0, result.output
    name = re.search(r"^stored as run (\S+) ", result.stdout, re.M).group(1)

    run = session.scalar(select(Run).where(Run.name == name))
    assert (run.kind, run.verdict, run.model, run.topology) == (
        "proof",
        "pass",
        "toy",
        "local (toy)",
    )
    assert [(p.kind, p.trigger) for p in run.proofs] == [("generation", "manual")]
    assert run.node_snapshots == []
    assert run.method == (
        "specpipe proof generation --local toy --temp 0.7 --top-p 0.95 --top-k 0 --seed 5 "
        "--draft-k 4 --max-new-tokens 12"
    )
    html = client.get("/proofs/").get_data(as_text=True)
    assert name in html and "manual" in html and "No proof runs yet" not in html
    detail = client.get(f"/proofs/{run.id}")
    assert detail.status_code == 200 and name in detail.get_data(as_text=True)

    again = CliRunner().invoke(cli, [*GENERATION, "--no-store"])
    assert again.exit_code == 0 and "stored as run" not in again.output
    assert len(session.scalars(select(Run)).all()) == 1


def test_a_store_that_cannot_take_the_run_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("DATABASE_URL", f"sqlite:///{tmp_path / 'never-migrated.sqlite3'}")
    result = CliRunner().invoke(cli, GENERATION)
    assert result.exit_code == 1
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: could not store the proof run (--no-store runs without it): ")
    assert "specpipe db upgrade" in last and "Traceback" not in result.output


def test_the_empty_proofs_page_says_how_runs_get_there(client):
    html = " ".join(client.get("/proofs/").get_data(as_text=True).split())
    assert "No proof runs yet" in html and "<code>--no-store</code>" in html
    assert "<code>specpipe proof swarm</code>" in html and "nightly" in html
