"""Several sessions' rounds in one forward give each session exactly the numbers it gets alone:
prefills, single steps and verifies of different lengths side by side, on every family, packed
and plain."""

from __future__ import annotations

import pytest
import torch

from specpipe.core.ring import GapError, Request
from specpipe.transformer.checkpoint import SafetensorsCheckpoint
from tests.model.helpers import load_split

FAMILIES = ["llama", "qwen2", "gptoss", "gptoss-mxfp4"]


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed))


def run_alone(stages, session: str, tokens: torch.Tensor, pos: int, last_rows=None):
    x = tokens
    for stage in stages:
        x = stage.forward(session, x, pos, last_rows if stage.last else None)
    return x


def run_together(stages, rounds):
    """`rounds`: (session, tokens, pos, last_rows); every stage runs them as one forward."""
    xs = [tokens for _, tokens, _, _ in rounds]
    for stage in stages:
        requests = [
            Request(session, x, pos, last_rows if stage.last else None)
            for (session, _, pos, last_rows), x in zip(rounds, xs, strict=True)
        ]
        xs = stage.forward_many(requests)
        assert not any(isinstance(x, BaseException) for x in xs), xs
    return xs


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "blas"])
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_rounds_equal_each_session_alone_bit_for_bit(checkpoints, family, pack):
    def stages():
        return load_split(lambda: SafetensorsCheckpoint(checkpoints[family]), [1, 3], pack=pack)

    alone, together = stages(), stages()
    prompts = {"a": ids(23, 1), "b": ids(5, 2), "c": ids(9, 3)}
    # Round 1: three prefills of different lengths side by side.
    first = run_together(together, [(s, p, 0, 1) for s, p in prompts.items()])
    for (s, p), got in zip(prompts.items(), first, strict=True):
        assert torch.equal(got, run_alone(alone, s, p, 0, 1))
    # Round 2: a single step, a verify of four, and a session just joining with its prefill.
    rounds = [("a", ids(1, 4), 23, 1), ("b", ids(4, 5), 5, 4), ("d", ids(30, 6), 0, 1)]
    for (s, tokens, pos, last), got in zip(rounds, run_together(together, rounds), strict=True):
        assert torch.equal(got, run_alone(alone, s, tokens, pos, last)), s
    # Round 3: "c" left (dropped); "b" rolls back two rejected drafts and steps again.
    for stage in together + alone:
        stage.drop("c")
    rounds = [("b", ids(2, 7), 7, 2), ("a", ids(3, 8), 24, 3)]
    for (s, tokens, pos, last), got in zip(rounds, run_together(together, rounds), strict=True):
        assert torch.equal(got, run_alone(alone, s, tokens, pos, last)), s


def test_a_round_that_cannot_run_leaves_the_others_running(checkpoints):
    (stage,) = load_split(lambda: SafetensorsCheckpoint(checkpoints["llama"]), [4])
    outs = stage.forward_many(
        [
            Request("fresh", ids(4, 1), 0, 1),
            Request("unknown", ids(1, 2), 9, 1),  # no cache here: a gap
            Request("bad", torch.tensor([10_000]), 0, 1),  # outside the vocabulary
        ]
    )
    assert outs[0].shape == (1, stage.cfg.vocab_size)
    assert isinstance(outs[1], GapError) and isinstance(outs[2], ValueError)
    assert "unknown" not in stage.sessions and stage.sessions["fresh"].length == 4
