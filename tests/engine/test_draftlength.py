"""The adaptive draft length: the expected-tokens rule, the acceptance scored against what was
committed whatever K was sent, the cost line, and a generation whose tokens do not depend on it."""

import time

import pytest

from specpipe.core.sampling import SamplingParams
from specpipe.decoding.generation import Generation
from specpipe.decoding.local_ring import LocalRing
from specpipe.drafting.length import DraftLength, expected_tokens
from tests.engine.toy_stages import toy_stages


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 8) == 1.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == 5.0


def feed(
    rule: DraftLength, rounds: int, *, hit: bool, base_s: float, per_draft_s: float, sent=None
) -> None:
    """Rounds whose whole proposal [1..8] is committed (hit) or missed at its first token, each
    timed base_s + per_draft_s per draft sent."""
    for i in range(rounds):
        k = rule.choose(8) if sent is None else sent[i % len(sent)]
        committed = [1, 2, 3, 4, 5, 6, 7, 8, 9][: k + 1] if hit else [0]
        rule.observe(list(range(1, 9)), committed, k, base_s + k * per_draft_s)


def test_drafts_that_always_miss_bring_k_down_to_plain():
    rule = DraftLength(8)
    assert rule.choose(8) > 0  # the prior believes in drafts at first
    feed(rule, 30, hit=False, base_s=0.1, per_draft_s=0.003)
    assert rule.acceptance() < 0.1
    assert rule.choose(8) == 0


def test_drafts_that_always_hit_take_the_largest_k():
    rule = DraftLength(6)
    feed(rule, 30, hit=True, base_s=0.1, per_draft_s=0.003)
    assert rule.acceptance() > 0.9
    assert rule.choose(8) == 6
    assert rule.choose(2) == 2  # never more than the drafter offers


def test_a_miss_is_seen_even_when_no_draft_was_sent():
    """With K = 0 the round commits the target's token, which is the proposal's first draft
    exactly when that draft would have been accepted (the coupled verify)."""
    rule = DraftLength(4)
    before = rule.acceptance()
    for _ in range(10):
        rule.observe([5, 6, 7], [9], 0, 0.1)
    assert rule.acceptance() < before / 3
    hit = DraftLength(4)
    for _ in range(10):
        hit.observe([5, 6, 7], [5], 0, 0.1)
    assert hit.acceptance() > 0.9


def test_each_source_of_drafts_has_its_own_acceptance():
    """The n-gram's hits in copied text do not make the head's misses look good, and the
    head's misses do not stop the n-gram's drafts; the round's cost is one line for both."""
    rule = DraftLength(6)
    for _ in range(30):
        rule.observe(list(range(1, 7)), [1, 2, 3, 4, 5, 6, 7], 6, 0.1 + 6 * 0.003)
        rule.observe([5, 6, 7, 8, 9, 10], [0], 1, 0.1 + 0.003, source="head")
    assert rule.acceptance() > 0.9 and rule.acceptance("head") < 0.1
    assert rule.choose(6) == 6 and rule.choose(6, "head") == 0
    assert DraftLength(6).acceptance("head") == DraftLength(6).acceptance()  # the same prior


def test_the_cost_line_is_measured_and_k_follows_the_ring():
    """Middling acceptance: on a slow ring (drafts nearly free) it drafts; on a ring where a
    draft row costs a whole round, it does not."""
    slow, fast = DraftLength(8), DraftLength(8)
    for rule, per_draft in ((slow, 0.001), (fast, 0.1)):
        for i in range(200):
            k = (0, 2, 4, 8)[i % 4]
            proposal = [1, 2, 3, 4, 5, 6, 7, 8]
            committed = [1, 9] if i % 2 else [0]  # half the first drafts hit, then a miss
            rule.observe(proposal, committed, k, 0.1 + k * per_draft)
    # The prior (3 % of a round per draft, 0.003 s here) still weighs a little in each.
    base, slope = slow.cost()
    assert base == pytest.approx(0.1, rel=0.05) and 0.001 <= slope < 0.002
    base, slope = fast.cost()
    assert 0.1 <= base < 0.2 and 0.07 < slope <= 0.1
    assert slow.choose(8) >= 1
    assert fast.choose(8) == 0


def test_prefill_and_replay_rounds_do_not_count_as_costs():
    rule = DraftLength(4)
    rule.observe([1], [1], 0, 50.0, steady=False)
    assert rule.cost() == (1.0, 0.03)  # still the prior: nothing was measured


class SlowRing(LocalRing):
    """A ring whose round costs a fixed time plus a lot per draft row: drafting does not pay."""

    def round(self, r):
        time.sleep(0.002 + 0.002 * r.n_draft)
        return super().round(r)


@pytest.mark.parametrize("seed", range(4))
def test_an_adaptive_generation_commits_the_tokens_of_plain_decoding(seed):
    prompt = [3, 7, 1, 9, 3, 7, 1, 9, 3, 7, 1, 9, 3, 7]
    params = SamplingParams(temp=0.9, seed=seed)
    out = {}
    for name, k, adaptive in (("plain", 0, False), ("fixed", 8, False), ("adaptive", 8, True)):
        gen = Generation(
            SlowRing(toy_stages()),
            "s",
            prompt,
            params,
            max_new_tokens=40,
            draft_k=k,
            adaptive=adaptive,
        )
        out[name] = (gen.run(), gen.stats)
    assert out["adaptive"][0] == out["plain"][0] == out["fixed"][0]
    # It sent fewer drafts than the fixed K whose drafts mostly miss here.
    assert out["adaptive"][1].drafted < out["fixed"][1].drafted
