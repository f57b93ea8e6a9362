"""Proofs 2 and 3 over a LocalRing: a lossless ring passes, a lossy one is caught."""

from specpipe.proofs.generation import run_generation_proof
from specpipe.proofs.swarm import SwarmProofConfig, run_swarm_proof
from specpipe.ring import LocalRing
from tests.engine.toy_stages import toy_stages

PROMPTS = [[3, 7, 1, 9, 3, 7, 1, 9], [5, 6, 7, 8]]
SMALL = SwarmProofConfig(stops=5, draws=150, temp=1.0, top_p=1.0, generation_tokens=20)


class LossyRing(LocalRing):
    """A tail that accepts every draft it verifies (and adds the target's first token): lossy."""

    def round(self, session, tokens, start_pos, n_draft, head_k=0):
        result = super().round(session, tokens, start_pos, n_draft, head_k)
        if n_draft:
            return list(tokens[len(tokens) - n_draft :]) + [result[0]]
        return result


def test_a_lossless_ring_passes_with_shown_power():
    result = run_swarm_proof(LocalRing(toy_stages()), PROMPTS, SMALL)
    head = result["proof_2_on_swarm"]
    assert head["verdict"] == "PASS", result["reasons"]
    assert head["stops"] == 5 and head["draws_per_mode_per_stop"] == 150
    assert head["max_entropy_bits"] > 1
    assert result["mutant"]["flagged"]
    assert result["exact_check"] == {"pairs": 750, "identical": 750}
    for stop in result["per_stop"]:
        assert stop["position"] > min(len(p) for p in PROMPTS)  # never inside a prompt
        assert sum(stop["spec_histogram"].values()) == 150


def test_a_lossy_ring_fails():
    result = run_swarm_proof(LossyRing(toy_stages()), PROMPTS, SMALL)
    assert result["proof_2_on_swarm"]["verdict"] == "FAIL"
    assert result["exact_check"]["identical"] < result["exact_check"]["pairs"]
    assert any("spec differs from plain" in reason for reason in result["reasons"])


def test_generation_proof_shows_identical_texts():
    result = run_generation_proof(
        LocalRing(toy_stages()), PROMPTS[0], lambda ids: str(ids), max_new_tokens=24
    )
    assert result["verdict"] == "PASS"
    assert set(result) == {
        "greedy_temp0",
        "sampled_temp0.7_seed7",
        "sampled_temp0.7_seed99",
        "verdict",
    }
    assert result["sampled_temp0.7_seed7"]["text"] != result["sampled_temp0.7_seed99"]["text"]
    assert result["greedy_temp0"]["tok_s"] > 0


def test_generation_proof_catches_a_lossy_ring():
    result = run_generation_proof(LossyRing(toy_stages()), PROMPTS[0], str, max_new_tokens=24)
    assert result["verdict"] == "FAIL"
