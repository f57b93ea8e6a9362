"""The generation loop over a LocalRing: speculative output equals plain output, token for
token, greedy and sampled; stops, gaps and resumes change nothing."""

from dataclasses import replace

import pytest

from specpipe.core.ring import GapError, Round, RoundResult
from specpipe.core.sampling import SamplingParams
from specpipe.core.tree import DraftTree
from specpipe.decoding.generation import Generation
from specpipe.decoding.local_ring import LocalRing
from specpipe.drafting.sources import NgramSource, TailSource, named_sources
from tests.engine.toy_stages import VOCAB, toy_stages

PROMPT = [3, 7, 1, 9, 3, 7, 1, 9, 3, 7, 1, 9, 3, 7]


def generate(params, draft_k, max_new=40, ring=None, drafts_from="both", **kwargs):
    gen = Generation(
        ring or LocalRing(toy_stages()),
        "s",
        PROMPT,
        params,
        max_new_tokens=max_new,
        draft_k=draft_k,
        sources=named_sources(drafts_from, params),
        **kwargs,
    )
    return gen.run(), gen.stats


def test_greedy_speculative_equals_plain_and_takes_fewer_rounds():
    params = SamplingParams(temp=0.0)
    plain, plain_stats = generate(params, draft_k=0)
    spec, spec_stats = generate(params, draft_k=4)
    assert spec == plain and len(plain) == 40
    assert plain_stats.rounds == 40
    assert spec_stats.rounds < plain_stats.rounds
    assert spec_stats.tokens_per_round > 1
    assert plain_stats.replays == spec_stats.replays == 0


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("temp,top_p,top_k", [(0.7, 0.95, 0), (1.0, 1.0, 0), (1.3, 0.9, 10)])
def test_sampled_speculative_equals_plain(seed, temp, top_p, top_k):
    params = SamplingParams(temp=temp, top_p=top_p, top_k=top_k, seed=seed)
    plain, _ = generate(params, draft_k=0)
    for k in (1, 3, 8):
        spec, stats = generate(params, draft_k=k)
        assert spec == plain, k
        assert stats.drafted >= stats.accepted


def test_different_seeds_give_different_text():
    outputs = {tuple(generate(SamplingParams(temp=1.0, seed=s), draft_k=4)[0]) for s in range(5)}
    assert len(outputs) > 1


def test_stops_at_eos_and_at_the_budget():
    params = SamplingParams(temp=0.0)
    full, _ = generate(params, draft_k=3)
    eos = full[5]
    stopped, _ = generate(params, draft_k=3, eos_ids=[eos])
    assert stopped == full[: full.index(eos) + 1]
    for budget in (1, 2, 7):
        assert generate(params, draft_k=8, max_new=budget)[0] == full[:budget]
    assert generate(params, draft_k=8, max_new=0)[0] == []


def test_should_stop_ends_the_generation_after_the_round_that_satisfies_it():
    params = SamplingParams(temp=0.0)
    full, _ = generate(params, draft_k=0)
    stopped, stats = generate(params, draft_k=0, should_stop=lambda ids: len(ids) >= 6)
    assert stopped == full[:6] and stats.rounds == 6


class RestartingStage:
    """Wraps a stage; loses every session's cache after each of the given numbers of calls."""

    def __init__(self, stage, restart_after, *more):
        self.stage, self.restart_after = stage, {restart_after, *more}
        self.first, self.last = stage.first, stage.last

    def forward(self, session, inputs, start_pos, last_rows=None):
        if self.stage.calls in self.restart_after:
            self.stage.cache.clear()
        return self.stage.forward(session, inputs, start_pos, last_rows)

    def drop(self, session):
        self.stage.drop(session)

    def held_tokens(self):
        return self.stage.held_tokens()


def test_a_stage_restart_is_replayed_without_changing_the_output():
    params = SamplingParams(temp=0.8, seed=42)
    expected, _ = generate(params, draft_k=4)
    first, tail = toy_stages()
    ring = LocalRing([RestartingStage(first, restart_after=5), tail])
    got, stats = generate(params, draft_k=4, ring=ring)
    assert got == expected
    assert stats.replays == 1


def test_a_stage_never_skips_positions():
    first, tail = toy_stages()
    ring = LocalRing([first, tail])
    ring.reset("s", SamplingParams())
    ring.round(Round("s", [1, 2, 3], 0))
    with pytest.raises(GapError):
        ring.round(Round("s", [4], 5))


def test_resuming_from_persisted_tokens_reproduces_the_run():
    params = SamplingParams(temp=1.0, seed=9)
    full, _ = generate(params, draft_k=4)
    resumed, _ = generate(params, draft_k=4, resume=full[:17])
    assert resumed == full


def test_bad_arguments_are_refused():
    ring = LocalRing(toy_stages())
    with pytest.raises(ValueError):
        Generation(ring, "s", [], SamplingParams(), max_new_tokens=3)
    with pytest.raises(ValueError):
        Generation(ring, "s", [1], SamplingParams(), max_new_tokens=-1)
    with pytest.raises(ValueError):
        LocalRing(list(reversed(toy_stages())))
    assert max(PROMPT) < VOCAB


class HeadRing(LocalRing):
    """A LocalRing whose tail 'head' proposes a fixed token, recording what each round asked."""

    def __init__(self, stages, token: int):
        super().__init__(stages)
        self.token, self.calls = token, []  # (drafts sent, head_k asked)

    def round(self, r):
        self.calls.append((list(r.tokens[len(r.tokens) - r.n_draft :]), r.head_k))
        result = super().round(replace(r, head_k=0, branches=None))
        return RoundResult(result, result.logprobs, [self.token] * r.head_k)


@pytest.mark.parametrize("source", ["head", "both"])
def test_head_drafts_are_used_where_the_ngram_has_none_and_asked_for_only_then(source):
    params = SamplingParams(temp=0.0)
    plain, _ = generate(params, draft_k=0)
    # A token the output never has: a proposal of it can only be the head's.
    ring = HeadRing(toy_stages(), token=next(t for t in range(VOCAB) if t not in plain + PROMPT))
    spec, stats = generate(params, draft_k=3, ring=ring, drafts_from=source)
    assert spec == plain
    for drafts, head_k in ring.calls:
        from_head = bool(drafts) and drafts == [ring.token] * len(drafts)
        from_ngram = bool(drafts) and not from_head
        assert head_k == (0 if from_ngram else 3), (drafts, head_k)
    if source == "head":  # the n-gram is never asked
        assert stats.head_rounds > 0
        assert all(not d or d == [ring.token] * len(d) for d, _ in ring.calls)
    else:  # this prompt repeats itself: the n-gram proposes every round, the head is not asked
        assert stats.head_rounds == 0 and any(d for d, _ in ring.calls)


def test_a_sampled_run_under_the_inverse_cdf_asks_nothing_of_the_head():
    params = SamplingParams(temp=0.8, seed=3)
    plain, _ = generate(params, draft_k=0)
    ring = HeadRing(toy_stages(), token=1)
    spec, stats = generate(params, draft_k=3, ring=ring, drafts_from="head")
    assert spec == plain and stats.head_rounds == 0
    assert all(head_k == 0 for _, head_k in ring.calls)
    gumbel = SamplingParams(temp=0.8, seed=3, sampler="gumbel")
    ring = HeadRing(toy_stages(), token=1)
    assert (
        generate(gumbel, draft_k=3, ring=ring, drafts_from="head")[0]
        == generate(gumbel, draft_k=0)[0]
    )
    assert any(head_k > 0 for _, head_k in ring.calls)


class RecordingRing:
    """A LocalRing that notes how many tokens each round sent."""

    def __init__(self, ring):
        self.ring, self.sent = ring, []
        self.route = ring.route

    def reset(self, session, params, prefix=None):
        self.ring.reset(session, params, prefix)

    def reseed(self, session, params):
        self.ring.reseed(session, params)

    def round(self, r):
        self.sent.append(len(r.tokens) - r.n_draft)
        return self.ring.round(r)

    def drop(self, session, keep=None):
        self.ring.drop(session, keep)

    def close(self):
        self.ring.close()


@pytest.mark.parametrize("draft_k", [0, 4])
def test_a_long_prefix_goes_in_chunks_and_gives_the_same_tokens(draft_k):
    params = SamplingParams(temp=0.9, seed=5)
    whole, _ = generate(params, draft_k, prefill_chunk=0)
    ring = RecordingRing(LocalRing(toy_stages()))
    chunked, stats = generate(params, draft_k, ring=ring, prefill_chunk=4)
    assert chunked == whole
    assert ring.sent[:4] == [4, 4, 4, 2]  # the 14-token prompt: three prefill rounds, then 2
    assert max(ring.sent) <= 4 and stats.rounds == len(ring.sent) - 3


def test_a_replay_after_a_restart_goes_in_chunks_too():
    params = SamplingParams(temp=0.8, seed=42)
    expected, _ = generate(params, draft_k=4)
    first, tail = toy_stages()
    ring = RecordingRing(LocalRing([RestartingStage(first, restart_after=8), tail]))
    got, stats = generate(params, draft_k=4, ring=ring, prefill_chunk=4)
    assert got == expected and stats.replays == 1
    assert max(ring.sent) <= 4  # the replay of 14 + n tokens went in rounds of at most 4


def test_a_restart_during_a_replays_chunks_replays_again():
    """A long prefix's replay is several rounds; a stage lost while they pass (here after the
    replay's second chunk) is replayed again, and the output does not change."""
    params = SamplingParams(temp=0.8, seed=42)
    expected, _ = generate(params, draft_k=4)
    first, tail = toy_stages()
    ring = LocalRing([RestartingStage(first, 8, 11), tail])
    got, stats = generate(params, draft_k=4, ring=ring, prefill_chunk=4)
    assert got == expected and stats.replays == 2


def test_a_stage_that_keeps_losing_its_cache_ends_the_generation():
    params = SamplingParams(temp=0.8, seed=42)
    first, tail = toy_stages()
    ring = LocalRing([RestartingStage(first, *range(8, 200)), tail])
    with pytest.raises(GapError):
        generate(params, draft_k=4, ring=ring, prefill_chunk=4)


class Matching(NgramSource):
    """An n-gram that has a match every round: fives."""

    def propose(self, k):
        return DraftTree.chain([5] * k)


def offering(drafts, adaptive=True):
    """A generation whose n-gram matches every round and whose tail sent back `drafts`."""
    ngram, tail = Matching(), TailSource()
    gen = Generation(
        LocalRing(toy_stages()),
        "s",
        PROMPT,
        SamplingParams(temp=0.0),
        max_new_tokens=8,
        draft_k=3,
        adaptive=adaptive,
        sources=[ngram, tail],
    )
    tail.proposal, tail.wanted = DraftTree.chain(drafts), len(drafts)
    return gen, ngram, tail


def test_the_source_measured_likelier_to_be_accepted_goes_first():
    gen, ngram, tail = offering([6, 6, 6])
    length = gen.draft_length
    for _ in range(10):  # the n-gram's drafts miss, the tail's are taken
        length.score([5, 5, 5], [1, 2, 3, 4], "ngram")
        length.score([1, 2, 3], [1, 2, 3, 4], "head")
    proposal, source = gen._propose(3)
    assert source is tail and proposal.tokens == (6, 6, 6)
    assert {name: t.main_branch() for name, t in gen.offers.items()} == {
        "ngram": [5, 5, 5],
        "head": [6, 6, 6],
    }
    # The tail is asked for the next round even while the n-gram's chain goes out.
    assert gen._ask_tail(ngram)[1] > 0 and tail.wanted > 0
    for _ in range(30):  # text that copies: now the n-gram leads
        length.score([1, 2, 3], [1, 2, 3, 4], "ngram")
        length.score([6, 6, 6], [1, 2, 3, 4], "head")
    proposal, source = gen._propose(3)
    assert source is ngram and proposal.tokens == (5, 5, 5)
    assert gen._ask_tail(ngram) == (None, 0) and tail.wanted == 0
    assert gen._propose(3) == (DraftTree.chain([5, 5, 5]), ngram)  # the tail offers nothing now
    # Without adaptive lengths there is nothing measured: the first source's match goes first.
    fixed, ngram, _ = offering([6, 6, 6], adaptive=False)
    assert fixed._propose(3) == (DraftTree.chain([5, 5, 5]), ngram)


def test_each_source_learns_every_commit_and_forgets_the_session_at_the_end():
    params = SamplingParams(temp=0.0)
    ngram, tail = NgramSource(), TailSource()
    gen = Generation(
        HeadRing(toy_stages(), token=1),
        "s",
        PROMPT,
        params,
        max_new_tokens=12,
        draft_k=3,
        sources=[ngram, tail],
    )
    seen = []
    for _ in gen.rounds():
        seen.append(list(ngram.drafter.tokens))
    assert seen[-1] == PROMPT + gen.generated  # the prompt first, then every round's tokens
    assert len(gen.generated) == 12
    assert ngram.drafter.tokens == [] and tail.proposal.tokens == () and tail.wanted == 0


@pytest.mark.parametrize("temp", [0.0, 0.9])
def test_a_run_with_both_sources_scored_each_round_equals_plain(temp):
    params = SamplingParams(temp=temp, seed=4, sampler="gumbel")
    plain, _ = generate(params, draft_k=0)
    ring = HeadRing(toy_stages(), token=1)
    spec, stats = generate(params, draft_k=3, ring=ring, adaptive=True)
    assert spec == plain and stats.rounds < len(plain)
