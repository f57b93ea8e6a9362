"""Real proof results saved to the store: the run record keeps them, the pages show them."""

from __future__ import annotations

import re

import pytest

from models.proof_store import run_verdict, save_proof_run
from models.records import run_record
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
