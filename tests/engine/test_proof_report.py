"""The proofs' typed views and reports: read from a result document, formatted line for line."""

from __future__ import annotations

import copy

import pytest

from specpipe.decoding.local_ring import LocalRing
from specpipe.proofs.outputs import run_generation_proof
from specpipe.proofs.report import (
    GenerationProofSummary,
    LocalProofSummary,
    SwarmProofSummary,
    format_generation,
    format_local_summary,
    format_swarm_summary,
)
from tests.engine.toy_stages import toy_stages


def local_doc() -> dict:
    """A proof 1 document of 2 configs × 2 forms that passes."""
    case = {"form": "coupled", "temp": 0.8, "top_p": 1.0, "top_k": 0, "tv": 0.01, "pass": True}
    return {
        "proof_1_local_math": {
            "draws_per_case": 20_000,
            "vocab": 32,
            "configs_tested": 2,
            "worst_tv_committed_vs_target": 0.0123,
            "gate": 0.02,
            "greedy_temp0_bit_identical_to_argmax": True,
            "verdict": "PASS",
        },
        "chi_square_alpha_per_test": 0.00025,
        "worst_p_value": 0.0412,
        "cases": [dict(case) for _ in range(4)],
        "mutants": [
            {"name": "always_accept", "worst_tv": 0.91, "cases_failed": 4, "caught": True},
            {"name": "accept_iff_argmax", "worst_tv": 0.3, "cases_failed": 2, "caught": True},
        ],
        "multi_position": {
            "exact_enumeration_max_abs_diff": 2.5e-17,
            "coupled": {"tv": 0.0311, "p_value": 0.5, "pass": True},
            "residual": {"tv": 0.0299, "p_value": 0.4, "pass": True},
            "pass": True,
        },
        "greedy": {"rows": 10_000, "temps": [0.0, -1.0], "mismatches": 0},
        "exact_coupling": {"trials": 102_000, "mismatches": 0},
    }


def test_a_passing_local_proof_reads_as_before():
    summary = LocalProofSummary.from_result(local_doc())
    assert summary.passed and summary.forms == 2 and summary.cases_failed == 0
    assert format_local_summary(summary, 3.14).splitlines() == [
        "proof 1: the local math",
        "  cases                     2 × 2 forms, 20,000 draws each, vocab 32",
        "  worst TV vs target        0.0123 (gate 0.02)",
        "  worst chi-square p        0.0412 (alpha 0.00025 per test)",
        "  cases failing             0",
        "  K=3 joint law             exact diff 2.5e-17, TV coupled 0.0311, residual 0.0299, ok",
        "  mutant always_accept      worst TV 0.910, caught",
        "  mutant accept_iff_argmax  worst TV 0.300, caught",
        "  greedy == argmax          10,000 rows, 0 mismatches",
        "  verify == plain           102,000 trials, 0 mismatches",
        "verdict: PASS (3.1 s)",
    ]


def test_a_failing_local_proof_names_what_failed():
    doc = local_doc()
    doc["proof_1_local_math"]["verdict"] = "FAIL"
    doc["cases"][1]["pass"] = False
    doc["mutants"][1]["caught"] = False
    doc["multi_position"]["pass"] = False
    summary = LocalProofSummary.from_result(doc)
    assert not summary.passed
    lines = format_local_summary(summary, 0.04).splitlines()
    assert "  cases failing             1" in lines
    assert lines[5].endswith("residual 0.0299, FAILED")
    assert lines[7] == "  mutant accept_iff_argmax  worst TV 0.300, NOT CAUGHT"
    assert lines[-1] == "verdict: FAIL (0.0 s)"


def gumbel_doc() -> dict:
    """A proof 1 document with the Gumbel form's cases, its checks and the timing."""
    doc = local_doc()
    gumbel_case = {"form": "gumbel", "temp": 0.8, "top_p": 1.0, "top_k": 0, "tv": 0.004}
    doc["cases"] += [
        {**gumbel_case, "draft": "neighbour", "agreement": 0.87, "pass": True},
        {**gumbel_case, "draft": "equal", "agreement": 1.0, "pass": True},
    ]
    doc["mutants"].append(
        {"name": "gumbel_cut_ignored", "worst_tv": 0.287, "cases_failed": 1, "caught": True}
    )
    doc["gumbel"] = {
        "cases": 2,
        "worst_tv": 0.004,
        "agreement_failed": 0,
        "multi_position": {
            "k": 2,
            "tv": 0.0424,
            "p_value": 0.853,
            "plain_marginal_max_abs_diff": 8.3e-17,
            "pass": True,
        },
        "exact_coupling": {"trials": 500, "mismatches": 0, "drafts_accepted": 600},
    }
    doc["timing"] = {
        "seconds": 7.9,
        "reference_grid_cases": 6,
        "reference_grid_seconds": 0.8,
        "ratio": 9.875,
    }
    return doc


def test_the_gumbel_form_and_the_timing_are_reported():
    summary = LocalProofSummary.from_result(gumbel_doc())
    assert summary.forms == 2 and summary.cases == 6
    assert summary.gumbel.drafters == 2 and summary.gumbel.lowest_agreement == 0.87
    lines = format_local_summary(summary, 8.2).splitlines()
    assert lines[1] == "  cases                      2 × 2 forms, 20,000 draws each, vocab 32"
    assert lines[6:8] == [
        "  gumbel form                2 cases (2 drafters q), worst TV 0.0040, agreement out of "
        "bounds 0 (lowest 0.870)",
        "  gumbel K=2 joint law       p 0.853, TV 0.0424, marginals vs plain 8.3e-17, ok",
    ]
    assert "  mutant gumbel_cut_ignored  worst TV 0.287, caught" in lines
    assert lines[-4:] == [
        "  verify == plain            102,000 trials, 0 mismatches",
        "  gumbel verify == plain     500 trials, 0 mismatches",
        "  time                       7.9 s, 9.9× a plain numpy grid of 6 cases (0.80 s)",
        "verdict: PASS (8.2 s)",
    ]


def test_a_failing_gumbel_check_is_named():
    doc = gumbel_doc()
    doc["gumbel"]["multi_position"]["pass"] = False
    doc["gumbel"]["exact_coupling"]["mismatches"] = 3
    doc["gumbel"]["agreement_failed"] = 1
    lines = format_local_summary(LocalProofSummary.from_result(doc), 1.0).splitlines()
    assert any("agreement out of bounds 1" in line for line in lines)
    assert any(
        line.startswith("  gumbel K=2 joint law") and line.endswith("FAILED") for line in lines
    )
    assert "  gumbel verify == plain     500 trials, 3 mismatches" in lines


def swarm_doc() -> dict:
    """A proof 2 document of two stops; the second has a p-value under the per-stop alpha."""

    def stop(index: int, p_value: float, identical: int) -> dict:
        return {
            "stop": index,
            "position": 17 + index,
            "entropy_bits": 1.5 - index,
            "tv_spec_vs_plain": 0.05,
            "tv_plain_vs_plain": 0.04,
            "p_value": p_value,
            "exact_pairs": 100,
            "exact_identical": identical,
        }

    return {
        "proof_2_on_swarm": {
            "temp": 0.7,
            "top_p": 0.95,
            "draws_per_mode_per_stop": 100,
            "stops": 2,
            "high_entropy_stops_ge_1bit": 1,
            "max_entropy_bits": 1.5,
            "mean_tv_spec_vs_plain": 0.05,
            "mean_tv_noise_floor_plain_vs_plain": 0.04,
            "verdict": "FAIL",
        },
        "top_k": 10,
        "draft_k": 4,
        "alpha_per_stop": 0.0005,
        "min_p_value": 1e-6,
        "reasons": ["spec differs from plain at stops [1]", "1 of 200 same-seed draws differ"],
        "mutant": {"stops_flagged": 2, "mean_tv_vs_plain": 0.25, "flagged": True},
        "exact_check": {"pairs": 200, "identical": 199},
        "per_stop": [stop(0, 0.31, 100), stop(1, 1e-6, 99)],
    }


def test_a_failing_swarm_proof_shows_its_stops_and_reasons():
    summary = SwarmProofSummary.from_result(swarm_doc())
    assert not summary.passed
    assert [s.passed for s in summary.per_stop] == [True, False]
    assert format_swarm_summary(summary, "wa → nj", 12.0).splitlines() == [
        "proof 2: speculative vs plain on the ring (wa → nj)",
        "  stop    pos   entropy  TV spec/plain  TV plain/plain    p-value  same seed",
        "     1     17    1.50 b         0.0500          0.0400       0.31   100/100 ",
        "     2     18    0.50 b         0.0500          0.0400      1e-06    99/100 ",
        "  temp / top_p / top_k     0.7 / 0.95 / 10",
        "  draws per mode per stop  100",
        "  stops                    2 (1 with >= 1 bit, max 1.50 bits)",
        "  mean TV spec vs plain    0.0500",
        "  mean TV plain vs plain   0.0400 (noise floor)",
        "  min p-value              1e-06 (alpha 0.0005 per stop)",
        "  lossy mutant             TV 0.2500, flagged at 2 stops",
        "  same-seed draws          199/200 identical",
        "  reason: spec differs from plain at stops [1]",
        "  reason: 1 of 200 same-seed draws differ",
        "verdict: FAIL (12.0 s)",
    ]


def test_a_passing_swarm_proof_has_no_reasons():
    doc = swarm_doc()
    doc["proof_2_on_swarm"]["verdict"], doc["reasons"] = "PASS", []
    summary = SwarmProofSummary.from_result(doc)
    lines = format_swarm_summary(summary, "local (toy)", 1.0).splitlines()
    assert summary.passed and not any("reason:" in line for line in lines)
    assert lines[-1] == "verdict: PASS (1.0 s)"


def generation_doc() -> dict:
    def mode(text: str, plain: str, speedup: float | None) -> dict:
        return {
            "text": text,
            "tok_s": 12.34,
            "plain_tok_s": 6.0,
            "speedup": speedup,
            "tokens_per_round": 2.1,
            "identical": text == plain,
            "spec": {"text": text},
            "plain": {"text": plain},
        }

    return {
        "greedy_temp0": mode("The cat sat.", "The cat sat.", 2.0567),
        "sampled_temp0.7_seed7": mode("A dog ran.", "A dog sat.", None),
        "verdict": "FAIL",
    }


def test_generation_shows_the_plain_text_only_where_it_differs():
    summary = GenerationProofSummary.from_result(generation_doc())
    assert not summary.passed
    assert [m.name for m in summary.modes] == ["greedy_temp0", "sampled_temp0.7_seed7"]
    assert format_generation(summary, "wa → nj").splitlines() == [
        "proof 3: generation, speculative vs plain (wa → nj)",
        "",
        "[greedy_temp0] speculative 12.3 tok/s, plain 6.0 tok/s (2.06×), texts identical",
        "  speculative: 'The cat sat.'",
        "",
        "[sampled_temp0.7_seed7] speculative 12.3 tok/s, plain 6.0 tok/s (—), texts DIFFERENT",
        "  speculative: 'A dog ran.'",
        "  plain:       'A dog sat.'",
        "",
        "verdict: FAIL",
    ]


@pytest.mark.parametrize(
    ("view", "doc", "section"),
    [
        (LocalProofSummary, local_doc(), "proof_1_local_math"),
        (SwarmProofSummary, swarm_doc(), "proof_2_on_swarm"),
    ],
)
def test_a_document_without_a_field_the_report_reads_is_a_key_error(view, doc, section):
    doc = copy.deepcopy(doc)
    del doc[section]["verdict"]
    with pytest.raises(KeyError, match="verdict"):
        view.from_result(doc)


def test_the_view_of_a_real_generation_proof():
    doc = run_generation_proof(LocalRing(toy_stages()), [3, 7, 1, 9], str, max_new_tokens=8)
    summary = GenerationProofSummary.from_result(doc)
    assert [m.name for m in summary.modes] == [k for k in doc if k != "verdict"]
    assert summary.passed == (doc["verdict"] == "PASS") and all(m.identical for m in summary.modes)
    assert summary.modes[0].text == doc["greedy_temp0"]["text"]
