"""Proof 1: it passes the real rule, fails lossy ones, and its CLI reports and exits right."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from specpipe.cli import cli
from specpipe.proofs import local as proofs
from specpipe.proofs.local import LocalProofConfig, run_local_proof
from specpipe.proofs.stats import chi_square_p_value, total_variation

SMALL = dict(
    draws=20_000,
    temps=(0.8, 1.3),
    top_ps=(0.9, 1.0),
    top_ks=(0, 10),
    greedy_rows=500,
    coupling_trials=3_200,
    sampler_trials=100,
)


def test_the_real_rule_passes_and_every_mutant_is_caught():
    result = run_local_proof(LocalProofConfig(**SMALL))
    head = result["proof_1_local_math"]
    assert head["verdict"] == "PASS"
    assert head["configs_tested"] == 2 * 2 * 2 * 3
    assert len(result["cases"]) == 2 * head["configs_tested"]
    assert {c["form"] for c in result["cases"]} == {"coupled", "residual"}
    assert head["worst_tv_committed_vs_target"] <= 0.02
    assert all(m["caught"] for m in result["mutants"])
    assert {m["name"] for m in result["mutants"]} == set(proofs.MUTANTS)
    assert result["exact_coupling"] == {"trials": 3_300, "mismatches": 0}
    assert result["greedy"]["mismatches"] == 0
    assert result["multi_position"]["pass"]


def test_a_lossy_form_fails_the_proof(monkeypatch):
    monkeypatch.setitem(proofs.FORMS, "coupled", proofs.mutant_no_removal)
    result = run_local_proof(LocalProofConfig(**SMALL))
    assert result["proof_1_local_math"]["verdict"] == "FAIL"
    assert any(not c["pass"] for c in result["cases"] if c["form"] == "coupled")
    assert all(c["pass"] for c in result["cases"] if c["form"] == "residual")


def test_a_subtle_bias_is_detected_by_the_chi_square_test():
    # 120k draws from a target whose two most likely tokens swap 1% of mass: TV 0.01 passes
    # the TV gate, so it is the goodness-of-fit test that must catch it.
    rng = np.random.default_rng(0)
    probs = np.full(32, 1 / 32)
    biased = probs.copy()
    biased[0] += 0.01
    biased[1] -= 0.01
    counts = np.bincount(rng.choice(32, size=120_000, p=biased), minlength=32).astype(float)
    assert total_variation(counts, probs) <= 0.02
    assert chi_square_p_value(counts, probs) < 0.001 / 288


def test_mass_outside_the_support_has_p_value_zero():
    assert chi_square_p_value(np.array([5.0, 5.0, 1.0]), np.array([0.5, 0.5, 0.0])) == 0.0


def test_cli_writes_the_reference_fields(tmp_path):
    out = tmp_path / "proof.json"
    args = [
        "proof",
        "local",
        "--draws",
        "20000",
        "--temps",
        "0.8,1.3",
        "--top-ps",
        "0.9,1",
        "--top-ks",
        "0,10",
        "--json",
        str(out),
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "verdict: PASS" in result.output
    doc = json.loads(out.read_text())
    assert set(doc["proof_1_local_math"]) == {
        "draws_per_case",
        "vocab",
        "configs_tested",
        "worst_tv_committed_vs_target",
        "gate",
        "greedy_temp0_bit_identical_to_argmax",
        "verdict",
    }
    assert doc["proof_1_local_math"]["configs_tested"] == 24
    assert doc["exact_coupling"]["mismatches"] == 0
    assert {"name", "worst_tv", "caught"} <= set(doc["mutants"][0])
    assert {"form", "tv", "p_value", "pass"} <= set(doc["cases"][0])


def test_cli_exits_1_when_the_proof_fails(monkeypatch):
    monkeypatch.setitem(proofs.FORMS, "residual", proofs.mutant_always_accept)
    result = CliRunner().invoke(
        cli,
        ["proof", "local", "--draws", "5000", "--temps", "1.0", "--top-ps", "1.0", "--top-ks", "0"],
    )
    assert result.exit_code == 1
    assert "verdict: FAIL" in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["--draws", "-5"],
        ["--draws", "abc"],
        ["--vocab", "1"],
        ["--temps", "0.7,x"],
        ["--temps", "0"],
        ["--top-ps", "1.5"],
        ["--top-ps", ""],
        ["--top-ks", "-1"],
        ["--top-ks", "2.5"],
        ["--seed", "-1"],
    ],
)
def test_cli_bad_values_exit_2_with_one_line(args):
    result = CliRunner().invoke(cli, ["proof", "local", *args])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert "Error: Invalid value" in result.output
