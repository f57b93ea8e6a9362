"""The draft head at the tail, on the default model with its shipped head: its drafts come back
with each result, the generation uses them, and the committed tokens stay plain sampling's."""

from __future__ import annotations

import pytest

from specpipe.core.sampling import SamplingParams
from specpipe.decoding.generation import Generation
from specpipe.decoding.local_ring import LocalRing
from specpipe.drafting.head import TailHead
from specpipe.drafting.sources import DraftSource, TailDrafter, named_sources
from specpipe.transformer.layer_range import load_stage
from specpipe.transformer.resolve import load_tokenizer, model_label, open_checkpoint

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@pytest.fixture(scope="module")
def ring_parts():
    checkpoint = open_checkpoint("default")
    n = checkpoint.config.n_layers
    first = load_stage(checkpoint, 0, n // 2)
    tail = load_stage(checkpoint, n // 2, n, pack=False)
    head = TailHead.for_stage(tail, None, model_label("default"))
    tail.pack()
    prompt_ids = load_tokenizer(checkpoint).prompt_ids(PROMPT)
    return [first, tail], head, prompt_ids


def _generate(ring_parts, params, drafts_from: str, draft_k: int, head: bool = True):
    stages, tail_head, prompt_ids = ring_parts
    ring = LocalRing(stages, tail_head if head else None)
    sources = named_sources(drafts_from, params)
    generation = Generation(
        ring, "s", prompt_ids, params, max_new_tokens=40, draft_k=draft_k, sources=sources
    )
    return generation.run(), generation.stats


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temp=0.0), SamplingParams(temp=0.7, top_p=0.95, seed=11, sampler="gumbel")],
    ids=["greedy", "gumbel-temp0.7"],
)
def test_head_drafts_are_accepted_and_change_no_token(ring_parts, params):
    plain, _ = _generate(ring_parts, params, "ngram", 0)
    spec, stats = _generate(ring_parts, params, "head", 4)
    assert spec == plain
    assert stats.head_rounds > 0 and stats.accepted > 0
    assert stats.tokens_per_round > 1.0
    # A ring without a head sends no drafts back: the same tokens, one per round.
    alone, alone_stats = _generate(ring_parts, params, "head", 4, head=False)
    assert alone == plain and alone_stats.drafted == 0


def test_the_head_is_a_drafter_at_the_tail_and_named_sources_are_draft_sources(ring_parts):
    assert isinstance(ring_parts[1], TailDrafter)
    for name in ("ngram", "head", "both"):
        sources = named_sources(name, SamplingParams(temp=0.0))
        assert sources and all(isinstance(s, DraftSource) for s in sources)
    assert [s.name for s in named_sources("both", SamplingParams(temp=0.0))] == ["ngram", "head"]
    with pytest.raises(ValueError, match="drafts_from must be one of"):
        named_sources("eagle", SamplingParams(temp=0.0))


def test_the_inverse_cdf_sampler_at_a_temperature_asks_nothing_of_the_head(ring_parts):
    params = SamplingParams(temp=0.7, top_p=0.95, seed=11)  # icdf: the head's noise is not its
    plain, _ = _generate(ring_parts, params, "ngram", 0)
    spec, stats = _generate(ring_parts, params, "head", 4)
    assert spec == plain and stats.head_rounds == 0 and stats.drafted == 0
