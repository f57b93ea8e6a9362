"""The one-process ring: every stage called in order in this process, the tail's sampler and
draft head at its end (see `specpipe.core.ring` for the round's contract)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specpipe.core.coupling import sampler_for
from specpipe.core.ring import RoundResult, Stage
from specpipe.core.sampling import Sampler, SamplingParams
from specpipe.decoding.tail import finish_round
from specpipe.drafting.head import TailHead


class LocalRing:
    """Every stage in this process, called in order: the one-process ring."""

    route: tuple = ()  # no hosts: a round never leaves this process

    def __init__(self, stages: Sequence[Stage], head: TailHead | None = None):
        if not stages or not stages[0].first or not stages[-1].last:
            raise ValueError("a ring needs stages from the embeddings (first) to the head (last)")
        self.stages = list(stages)
        self.head = head  # the tail's draft head (see `drafthead.load_with_head`), if any
        self.samplers: dict[str, Sampler] = {}

    def reset(self, session: str, params: SamplingParams) -> None:
        for stage in self.stages:
            stage.drop(session)
        self.reseed(session, params)

    def reseed(self, session: str, params: SamplingParams) -> None:
        self.samplers[session] = sampler_for(params)

    def round(
        self, session: str, tokens: Sequence[int], start_pos: int, n_draft: int, head_k: int = 0
    ) -> RoundResult:
        sampler = self.samplers.get(session)
        if sampler is None:
            raise KeyError(f"session {session!r} was never reset")
        hidden = torch.tensor(list(tokens), dtype=torch.long)
        for stage in self.stages[:-1]:
            hidden = stage.forward(session, hidden, start_pos)
        tail = self.stages[-1]
        logits = tail.forward(session, hidden, start_pos, last_rows=n_draft + 1)
        return finish_round(
            tail, session, logits, tokens, start_pos, n_draft, sampler, self.head, head_k
        )

    def drop(self, session: str) -> None:
        for stage in self.stages:
            stage.drop(session)
        self.samplers.pop(session, None)

    def close(self) -> None:
        """Nothing to let go of: the stages belong to whoever made them."""
