"""The ring interface: one verify round through every stage, in one process or across hosts.

A *round* sends tokens at absolute positions `start_pos … start_pos+len(tokens)-1` through the
stages; the last `n_draft` of them are drafts. The tail samples the doctored result vector for
the `n_draft + 1` positions that follow the last non-draft token (see `Sampler.accept`) and the
ring returns it. A stage whose cache ends before `start_pos` (it restarted) raises `GapError`;
the caller then replays the committed prefix as one round from position 0.

When the session asked for log-probabilities (`SamplingParams.logprobs`), the result is a
`RoundResult`: still the list of ids, with the committed tokens' `TokenLogprob`s beside it.

`LocalRing` (`specpipe.decoding.local_ring`) runs the stages in this process; `RedisRing`
(`specpipe.swarm.redis_ring`) sends each hop over Redis Streams. Both offer the same calls, so
the generation loop cannot tell them apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specpipe.core.sampling import SamplingParams, TokenLogprob


class GapError(RuntimeError):
    """A stage was asked to continue from a position beyond its KV cache (it lost its state)."""


class RoundResult(list):
    """A round's doctored result vector (a list of ids, equal to the plain list) carrying the
    committed tokens' log-probabilities when the session asked for them, and the tail's draft
    head's proposal for the next round when it was asked for one."""

    def __init__(
        self, ids, logprobs: Sequence[TokenLogprob] = (), drafts: Sequence[int] = ()
    ) -> None:
        super().__init__(ids)
        self.logprobs = list(logprobs)
        self.drafts = [int(t) for t in drafts]


@dataclass(frozen=True)
class Request:
    """One session's round for a stage (see `Stage.forward`)."""

    session: str
    inputs: torch.Tensor
    start_pos: int
    last_rows: int | None = None


class Stage(Protocol):
    """One layer range of the model: what a stage worker holds."""

    first: bool  # holds the embeddings: takes token ids
    last: bool  # holds the final norm and head: returns logits

    def forward(
        self, session: str, inputs: torch.Tensor, start_pos: int, last_rows: int | None = None
    ) -> torch.Tensor:
        """ids [T] (first) or hidden [T, D] -> hidden [T, D], or logits [T, V] (last).

        Truncates the session's cache to `start_pos` first; raises GapError beyond it. On the
        last stage, `last_rows` keeps only the logits of the last rows (a round needs K+1)."""
        ...

    def drop(self, session: str) -> None:
        """Forget a session's cache."""
        ...


class Ring(Protocol):
    """A path through every stage, ending in the tail's sampler."""

    def reset(self, session: str, params: SamplingParams) -> None:
        """Start (or restart) a session: clear caches, set the tail's sampling parameters."""
        ...

    def reseed(self, session: str, params: SamplingParams) -> None:
        """Change a session's sampling parameters on the tail, keeping every cache (the proofs
        draw many times from one context)."""
        ...

    def round(
        self, session: str, tokens: Sequence[int], start_pos: int, n_draft: int, head_k: int = 0
    ) -> list[int]:
        """Run one round; return the doctored result vector (n_draft + 1 ids, -1 padded), with
        up to `head_k` drafts for the next round from the tail's draft head, if it has one."""
        ...

    def drop(self, session: str) -> None:
        """End a session everywhere."""
        ...
