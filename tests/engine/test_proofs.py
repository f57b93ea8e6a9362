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
    gumbel_sampler_trials=100,
)


@pytest.fixture(scope="module")
def small_result() -> dict:
    return run_local_proof(LocalProofConfig(**SMALL))


def test_the_real_rule_passes_and_every_mutant_is_caught(small_result):
    result = small_result
    head = result["proof_1_local_math"]
    assert head["verdict"] == "PASS"
    assert head["configs_tested"] == 2 * 2 * 2 * 3
    gumbel_cases = 2 * 2 * 2 * len(LocalProofConfig.drafters)
    assert len(result["cases"]) == 2 * head["configs_tested"] + gumbel_cases
    assert {c["form"] for c in result["cases"]} == {"coupled", "residual", "gumbel"}
    assert head["worst_tv_committed_vs_target"] <= 0.02
    assert all(m["caught"] for m in result["mutants"])
    assert {m["name"] for m in result["mutants"]} == set(proofs.MUTANTS) | set(
        proofs.GUMBEL_MUTANTS
    )
    assert result["exact_coupling"] == {"trials": 3_300, "mismatches": 0}
    assert result["greedy"]["mismatches"] == 0
    assert result["multi_position"]["pass"]


def test_gumbel_cases_pass_with_agreement_between_its_bounds(small_result):
    rows = [c for c in small_result["cases"] if c["form"] == "gumbel"]
    assert len(rows) == small_result["gumbel"]["cases"] == 24
    assert all(row["pass"] and row["agreement_ok"] for row in rows)
    assert small_result["gumbel"]["agreement_failed"] == 0
    for row in rows:
        slack = 5 * np.sqrt(0.25 / row["trials"])
        assert row["agreement_floor"] - slack <= row["agreement"]
        assert row["agreement"] <= row["agreement_ceiling"] + slack
        assert abs(row["agreement"] - row["agreement_exact"]) <= slack
        if row["draft"] == "equal":
            assert row["agreement"] == 1.0
        else:  # a drafter that is not the target (nor a point mass) agrees less than always
            assert row["tv_drafter_vs_target"] > 0 and row["agreement"] < 1.0


def test_gumbel_multi_position_law_and_exact_coupling_pass(small_result):
    gumbel = small_result["gumbel"]
    multi = gumbel["multi_position"]
    assert multi["pass"] and multi["k"] == 2
    assert multi["plain_marginal_max_abs_diff"] < 1e-12 and abs(multi["law_mass"] - 1) < 1e-12
    assert 1 < multi["mean_committed"] < 3  # drafts are accepted, not always
    assert gumbel["exact_coupling"]["trials"] == SMALL["gumbel_sampler_trials"]
    assert gumbel["exact_coupling"]["mismatches"] == 0
    assert gumbel["exact_coupling"]["drafts_accepted"] > 0


def test_the_proof_reports_its_time_against_a_numpy_grid(small_result):
    timing = small_result["timing"]
    assert timing["reference_grid_cases"] == len(small_result["cases"])
    assert timing["seconds"] > 0 and timing["reference_grid_seconds"] > 0
    assert timing["ratio"] == pytest.approx(timing["seconds"] / timing["reference_grid_seconds"])


@pytest.mark.parametrize("mutant", list(proofs.GUMBEL_MUTANTS))
def test_a_lossy_gumbel_form_fails_the_proof(monkeypatch, mutant):
    monkeypatch.setitem(proofs.GUMBEL_FORMS, "gumbel", proofs.GUMBEL_MUTANTS[mutant])
    result = run_local_proof(LocalProofConfig(**SMALL))
    assert result["proof_1_local_math"]["verdict"] == "FAIL"
    assert any(not c["pass"] for c in result["cases"] if c["form"] == "gumbel")
    assert all(c["pass"] for c in result["cases"] if c["form"] != "gumbel")


def test_gumbel_sampler_verify_at_the_wrong_position_is_caught(monkeypatch):
    accept = proofs.GumbelSampler.accept
    monkeypatch.setattr(
        proofs.GumbelSampler, "accept", lambda self, z, d, start: accept(self, z, d, start + 1)
    )
    result = proofs.gumbel_coupling_check(LocalProofConfig(**SMALL))
    assert result["mismatches"] > 0


def test_noise_shared_across_positions_fails_the_joint_law():
    cfg = LocalProofConfig(**SMALL)
    targets = proofs.gumbel_multi_targets(cfg)
    bank = next(proofs.gumbel_banks(cfg))
    right = proofs.gumbel_multi_results(*targets, bank)
    bank[1] = bank[0]  # position t+1 reuses position t's noise: the draws are correlated
    wrong = proofs.gumbel_multi_results(*targets, bank)
    assert proofs.gumbel_multi_position_check(cfg, right, 0.001)["pass"]
    assert not proofs.gumbel_multi_position_check(cfg, wrong, 0.001)["pass"]


def test_gumbel_trials_in_chunks_count_the_same(monkeypatch):
    cfg = LocalProofConfig(**{**SMALL, "draws": 3_000, "temps": (0.8,), "top_ks": (10,)})
    rules = proofs.GUMBEL_FORMS | proofs.GUMBEL_MUTANTS
    whole = proofs.run_gumbel(cfg, rules, lambda _: None)
    monkeypatch.setattr(proofs, "BANK_BYTES", 3 * cfg.vocab * 8 * 700)  # 700 trials a chunk
    assert sum(1 for _ in proofs.gumbel_banks(cfg)) == 5
    chunked = proofs.run_gumbel(cfg, rules, lambda _: None)
    assert chunked[0] == whole[0]
    assert np.array_equal(chunked[1], whole[1])


def test_gumbel_agreement_is_the_exponential_race():
    p, q = np.array([0.2, 0.4, 0.4, 0.0]), np.array([0.0, 0.2, 0.4, 0.4])
    assert proofs.gumbel_agreement(p, q) == pytest.approx(1 / 5.5 + 1 / 3.5, abs=1e-12)
    assert proofs.gumbel_agreement(p, p) == pytest.approx(1.0, abs=1e-12)


def test_the_coupled_prefix_law_has_plain_marginals():
    rng = np.random.default_rng(3)
    probs = rng.dirichlet(np.ones(6), size=3)
    drafter = rng.dirichlet(np.ones(6), size=2)
    law = proofs.coupled_prefix_law(probs, drafter)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    assert proofs.plain_marginal_gap(law, probs) < 1e-12
    # A law with the drafts' own mass where they agree is not plain sampling's.
    skewed = {
        seq: mass * (1.5 if len(seq) > 1 and seq[0] == 0 else 1.0) for seq, mass in law.items()
    }
    assert proofs.plain_marginal_gap(skewed, probs) > 1e-3


def test_agreement_outside_its_bounds_fails_the_case():
    row = {
        "pass": True,
        "trials": 100_000,
        "agreement": 0.5,
        "agreement_exact": 0.62,
        "agreement_floor": 0.6,
        "agreement_ceiling": 0.7,
    }
    proofs.judge_agreement([row], 0.001)
    assert not row["agreement_ok"] and not row["pass"]
    row.update({"pass": True, "agreement": 0.621})
    proofs.judge_agreement([row], 0.001)
    assert row["agreement_ok"] and row["pass"]


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
        "--no-store",
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
        [
            "proof",
            "local",
            "--draws",
            "5000",
            "--temps",
            "1.0",
            "--top-ps",
            "1.0",
            "--top-ks",
            "0",
            "--no-store",
        ],
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
