"""A kept prefix is the cache a prefill of the same tokens builds, bit for bit, however either
was chunked; a session started from it computes what a cold session computes."""

from __future__ import annotations

import pytest
import torch

from specpipe.core.ring import GapError
from specpipe.transformer import kvcache
from specpipe.transformer.checkpoint import SafetensorsCheckpoint
from tests.model.helpers import load_split

FAMILIES = ["llama", "qwen2", "gptoss", "gptoss-mxfp4"]


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed))


def prefill(stages, session: str, tokens: torch.Tensor, chunk: int, pos: int = 0):
    """`tokens` at `pos` on in rounds of at most `chunk`; the last round's last logits."""
    out = None
    for at in range(0, len(tokens), chunk):
        x = tokens[at : at + chunk]
        for stage in stages:
            x = stage.forward(session, x, pos + at, 1 if stage.last else None)
        out = x
    return out


def caches_equal(a, b, length: int) -> bool:
    for layer_a, layer_b in zip(a.layers, b.layers, strict=True):
        lo = max(layer_a.first, layer_b.first)
        ka = layer_a.k[:, lo - layer_a.first : length - layer_a.first]
        kb = layer_b.k[:, lo - layer_b.first : length - layer_b.first]
        va = layer_a.v[:, lo - layer_a.first : length - layer_a.first]
        vb = layer_b.v[:, lo - layer_b.first : length - layer_b.first]
        if not (torch.equal(ka, kb) and torch.equal(va, vb)):
            return False
    return True


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefix_kept_and_continued_gives_a_cold_prefills_numbers(checkpoints, family):
    def stages():
        return load_split(lambda: SafetensorsCheckpoint(checkpoints[family]), [1, 3])

    first_turn, second_turn = ids(45, 1), ids(13, 2)
    shared = 37  # the second prompt starts with the first 37 tokens of the first session
    prompt = torch.cat([first_turn[:shared], second_turn])

    cold = stages()
    want = prefill(cold, "cold", prompt, chunk=len(prompt))

    warm = stages()
    prefill(warm, "turn-1", first_turn, chunk=8)  # chunked otherwise than the cold one
    # Chunking changes nothing in the cache: the same bits as the one-shot prefill's.
    for cold_stage, warm_stage in zip(cold, warm, strict=True):
        held = warm_stage.sessions["turn-1"]
        assert caches_equal(held, cold_stage.sessions["cold"], shared)
    assert [s.keep_prefix("turn-1", "p", len(first_turn)) for s in warm] == [45, 45]
    assert all(s.kept_tokens() == {"p": 45} for s in warm)
    # The session goes on after a keep, writing over positions the prefix holds: the kept
    # copy does not change.
    prefill(warm, "turn-1", ids(20, 5), chunk=7, pos=shared - 7)
    for stage in warm:
        stage.drop("turn-1")

    assert all(s.start_from_prefix("turn-2", "p", shared) for s in warm)
    got = prefill(warm, "turn-2", prompt[shared:], chunk=5, pos=shared)
    assert torch.equal(got, want)
    # Another session may start from the same prefix: the first did not change it.
    assert all(s.start_from_prefix("turn-2b", "p", shared) for s in warm)
    assert torch.equal(prefill(warm, "turn-2b", prompt[shared:], chunk=13, pos=shared), want)
    assert warm[0].kept_tokens() == {"p": 45}


def test_a_prefix_not_kept_starts_the_session_empty_and_its_round_gets_a_gap(checkpoints):
    stages = load_split(lambda: SafetensorsCheckpoint(checkpoints["llama"]), [2, 2])
    tokens = ids(20, 3)
    prefill(stages, "a", tokens, chunk=20)
    assert stages[0].keep_prefix("a", "p", 20) == 20
    assert not stages[0].start_from_prefix("b", "p", 21)  # holds fewer positions
    assert not stages[1].start_from_prefix("b", "missing", 10)
    stages[1].forget_prefix("p")
    for stage in stages:
        with pytest.raises(GapError):
            stage.forward("b", tokens[10:] if stage.first else torch.zeros(10, 64), 10)
    assert stages[0].keep_prefix("never-ran", "q", 5) == 0 and "q" not in stages[0].kept


def test_a_sliding_window_that_forgot_the_prefix_gives_a_gap(checkpoints, monkeypatch):
    monkeypatch.setattr(kvcache, "SLIDING_SLACK", 2)
    monkeypatch.setattr(kvcache, "FORGET_BLOCK", 4)
    stages = load_split(lambda: SafetensorsCheckpoint(checkpoints["gptoss"]), [4])
    (stage,) = stages
    tokens = ids(60, 4)
    prefill(stages, "a", tokens, chunk=1)  # one by one: the window moves on, forgetting
    assert stage.keep_prefix("a", "p", 60) == 60
    assert stage.start_from_prefix("b", "p", 10)  # the sliding layers forgot position 10
    with pytest.raises(GapError, match="sliding-window"):
        stage.forward("b", tokens[10:12], 10)
    assert stage.start_from_prefix("c", "p", 59)  # near the end, the window is held
    stage.forward("c", tokens[59:60], 59)


def generation(ring, session, prompt, draft_k=4, prefix=None):
    from specpipe.core.sampling import SamplingParams
    from specpipe.decoding.generation import Generation

    params = SamplingParams(temp=0.9, top_p=0.95, seed=11)
    return Generation(
        ring, session, prompt, params, max_new_tokens=24, draft_k=draft_k, prefix=prefix
    )


@pytest.mark.parametrize("family", ["llama", "gptoss"])
def test_a_next_turn_from_the_last_ones_kept_cache_commits_the_same_tokens(checkpoints, family):
    """A conversation's next turn starts from the cache the last one kept: the same tokens as a
    cold start, with speculation and without, and only the new tokens go through the ring."""
    from specpipe.core.ring import Prefix
    from specpipe.decoding.local_ring import LocalRing

    def ring():
        stages = load_split(lambda: SafetensorsCheckpoint(checkpoints[family]), [1, 3])
        return LocalRing(stages)

    warm = ring()
    first = generation(warm, "turn-1", ids(40, 5).tolist())
    first.run()
    kept = Prefix("turn-1", first.cached)
    assert first.cached == len(first.tokens) - 1  # all but the last committed token
    warm.drop("turn-1", keep=kept)
    second_prompt = first.tokens + ids(9, 6).tolist()

    cold = generation(ring(), "cold", second_prompt).run()
    for draft_k in (4, 0):  # speculative, then plain
        turn = generation(warm, f"turn-2-{draft_k}", second_prompt, draft_k, prefix=kept)
        assert turn.run() == cold
        assert turn.stats.reused == kept.length and turn.stats.replays == 0
    # A prefix the stages do not keep: a gap at the first round, a full prefill, the same tokens.
    lost = generation(warm, "lost", second_prompt, prefix=Prefix("nowhere", kept.length))
    assert lost.run() == cold and lost.stats.replays == 1 and lost.stats.reused == 0
