"""Proofs 2 and 3 over a LocalRing: a lossless ring passes, a lossy one is caught."""

import pytest
import torch
from torch.nn import functional as F

from specpipe.core.ring import RoundResult
from specpipe.decoding.local_ring import LocalRing
from specpipe.drafting.head import DraftHead, TailHead, TargetParts
from specpipe.proofs.outputs import run_generation_proof
from specpipe.proofs.report import SwarmProofSummary, format_swarm_summary
from specpipe.proofs.swarm import SwarmProofConfig, in_flight, run_swarm_proof, split_draws
from tests.engine.toy_stages import WIDTH, ToyStage, toy_stages

PROMPTS = [[3, 7, 1, 9, 3, 7, 1, 9], [5, 6, 7, 8]]
SMALL = SwarmProofConfig(stops=5, draws=150, temp=1.0, top_p=1.0, generation_tokens=20)
# The toy stages run chains only: the head's drafts stay chains here (trees: test_tree_rounds).
WITH_HEAD = SwarmProofConfig(
    stops=3, draws=120, temp=1.0, top_p=1.0, generation_tokens=16, draft_head=True, trees=False
)


class LossyRing(LocalRing):
    """A tail that accepts every draft it verifies (and adds the target's first token): lossy."""

    def round(self, r):
        result = super().round(r)
        if r.n_draft:
            return RoundResult(list(r.tokens[len(r.tokens) - r.n_draft :]) + [result[0]])
        return result


class FeatureTail(ToyStage):
    """The toy tail keeping, as a real tail with a draft head does, the rows it sampled from
    as they were before its head."""

    def __init__(self) -> None:
        super().__init__(first=False, last=True)
        self.features: dict[str, torch.Tensor] = {}

    def forward(self, session, inputs, start_pos, last_rows=None):
        self.features[session] = inputs.double()[-(last_rows or len(inputs)) :]
        return super().forward(session, inputs, start_pos, last_rows)


def head_ring(matched: bool, ring_class=LocalRing) -> LocalRing:
    """The toy ring with a draft head at its tail: untrained (its drafts are rarely accepted),
    or `matched`, set by hand to the toy's recurrence h_t = tanh(E[x_t] + 0.9 h_{t-1}), so that
    its drafts often are."""
    first, tail = toy_stages()[0], FeatureTail()
    torch.manual_seed(0)
    head = DraftHead(WIDTH, 16).double()
    if matched:
        eye = torch.eye(WIDTH, dtype=torch.float64)
        with torch.no_grad():  # h enters normed (rms ~ 1); the toy's states have rms ~ 0.6
            head.fc.weight.copy_(torch.cat([0.9 * 0.6 * eye, eye], dim=1))
    parts = TargetParts(
        embed=lambda ids: F.embedding(ids, first.embed),
        norm=torch.tanh if matched else (lambda x: x),
        head=lambda x: (x.double() @ tail.head).float(),
    )
    return ring_class([first, tail], TailHead(head, parts))


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


@pytest.mark.parametrize("matched", [False, True], ids=["untrained-head", "matched-head"])
def test_the_head_on_proof_passes_flags_its_mutant_and_records_what_drew(matched):
    result = run_swarm_proof(head_ring(matched), PROMPTS, WITH_HEAD)
    head = result["proof_2_on_swarm"]
    assert head["verdict"] == "PASS", result["reasons"]
    assert (result["sampler"], result["drafter"], result["law"]) == ("gumbel", "head", "pair")
    assert result["mutant"] == {**result["mutant"], "name": "stale_token_at_stop", "flagged": True}
    assert result["exact_check"] == {"pairs": 360, "identical": 360}
    drafted = result["head"]
    assert drafted["rounds"] == drafted["draws"] == 360 and drafted["drafted"] == 4 * 360
    if matched:  # accepted drafts: the exact check compared several tokens per draw
        assert drafted["first_draft_acceptance"] > 0.5 and drafted["accepted"] > 360
    else:
        assert drafted["first_draft_acceptance"] < 0.1
    for stop in result["per_stop"]:
        # Pairs (x0, x1): more categories than the stop's own tokens.
        pairs = [tuple(map(int, key.split())) for key in stop["spec_histogram"]]
        assert sum(stop["spec_histogram"].values()) == 120
        assert len({x0 for x0, _ in pairs}) < len(pairs)
    text = format_swarm_summary(SwarmProofSummary.from_result(result), "toy", 1.0)
    assert "sampler gumbel, drafts from the tail's draft head" in text
    assert f"{drafted['rounds']}/{drafted['draws']} draws" in text


def test_the_head_on_proof_without_a_head_lets_the_ngram_stand_in():
    result = run_swarm_proof(LocalRing(toy_stages()), PROMPTS, WITH_HEAD)
    assert result["proof_2_on_swarm"]["verdict"] == "PASS", result["reasons"]
    assert result["head"]["rounds"] == 0 and result["head"]["acceptance"] == 0.0
    text = format_swarm_summary(SwarmProofSummary.from_result(result), "toy", 1.0)
    assert "the tail sent no head drafts" in text


def test_a_tail_that_accepts_every_head_draft_fails_the_head_on_proof():
    result = run_swarm_proof(head_ring(False, LossyRing), PROMPTS, WITH_HEAD)
    assert result["proof_2_on_swarm"]["verdict"] == "FAIL"
    assert any("spec differs from plain" in reason for reason in result["reasons"])
    assert result["exact_check"]["identical"] < result["exact_check"]["pairs"]


@pytest.mark.parametrize("with_head", [False, True], ids=["ngram", "head"])
def test_stops_measured_in_flight_say_what_one_lane_says(with_head):
    """Lanes of their own (each a ring with its own stages) measure stops at once; every number
    of the proof is the one-lane run's, since each depends on its stop and seeds alone."""
    cfg = WITH_HEAD if with_head else SMALL

    def ring():
        return head_ring(True) if with_head else LocalRing(toy_stages())

    alone = run_swarm_proof(ring(), PROMPTS, cfg)
    done = []
    together = run_swarm_proof(ring(), PROMPTS, cfg, done.append, [ring() for _ in range(3)])
    assert together == alone
    assert len(done) == cfg.work_units()


@pytest.mark.parametrize(
    ("draws", "stops", "rings", "parts"),
    [(140, 12, 1, 1), (140, 12, 12, 3), (140, 4, 12, 9), (5, 1, 12, 5), (140, 12, 2, 1)],
)
def test_a_stops_draws_are_cut_into_parts_that_cover_each_draw_once(draws, stops, rings, parts):
    cut = split_draws(draws, stops, rings)
    assert len(cut) == parts
    assert [i for part in cut for i in range(draws)[part]] == list(range(draws))


def test_in_flight_keeps_the_items_order_uses_each_ring_once_at_a_time_and_raises():
    import threading
    import time

    rings = ["a", "b", "c"]
    busy: set[str] = set()
    lock = threading.Lock()

    def work(ring, item):
        with lock:
            assert ring not in busy
            busy.add(ring)
        time.sleep(0.01 * (item % 3))
        with lock:
            busy.discard(ring)
        if item == 7:
            raise RuntimeError("stop 7 failed")
        return item * item

    assert in_flight(rings, work, list(range(7))) == [i * i for i in range(7)]
    assert in_flight(rings[:1], work, [3, 1]) == [9, 1]
    with pytest.raises(RuntimeError, match="stop 7 failed"):
        in_flight(rings, work, list(range(12)))


def test_the_head_needs_the_gumbel_sampler():
    with pytest.raises(ValueError, match="gumbel"):
        SwarmProofConfig(draft_head=True, sampler="icdf")
    with pytest.raises(ValueError, match="sampler must be one of"):
        SwarmProofConfig(sampler="nope")
    assert SwarmProofConfig().sampler == "icdf" and SwarmProofConfig().drafter == "ngram"


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
    assert result["sampled_temp0.7_seed7"]["draft_head"] is False
    assert result["sampled_temp0.7_seed7"]["sampler"] == "icdf"
    assert result["sampled_temp0.7_seed7"]["drafts_from"] == "ngram"
    assert result["sampled_temp0.7_seed7"]["text"] != result["sampled_temp0.7_seed99"]["text"]
    assert result["greedy_temp0"]["tok_s"] > 0


def test_generation_proof_with_the_head_samples_with_gumbel_and_uses_its_drafts():
    result = run_generation_proof(
        head_ring(matched=True), PROMPTS[1], str, max_new_tokens=24, draft_head=True
    )
    assert result["verdict"] == "PASS"
    for name in ("greedy_temp0", "sampled_temp0.7_seed7", "sampled_temp0.7_seed99"):
        mode = result[name]
        assert mode["identical"] and mode["draft_head"] and mode["drafts_from"] == "both"
        assert mode["head_rounds"] > 0, name
    assert result["sampled_temp0.7_seed7"]["sampler"] == "gumbel"
    assert result["sampled_temp0.7_seed7"]["draft_acceptance"] > 0


def test_generation_proof_catches_a_lossy_ring():
    result = run_generation_proof(LossyRing(toy_stages()), PROMPTS[0], str, max_new_tokens=24)
    assert result["verdict"] == "FAIL"
