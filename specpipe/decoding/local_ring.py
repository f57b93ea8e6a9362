"""The one-process ring: every stage called in order in this process, the tail's sampler and
draft head at its end (see `specpipe.core.ring` for the round's contract)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specpipe.core.coupling import sampler_for
from specpipe.core.ring import Prefix, PrefixStage, Request, Round, RoundResult, Stage
from specpipe.core.sampling import Sampler, SamplingParams
from specpipe.decoding.tail import finish_round
from specpipe.drafting.sources import TailDrafter


class LocalRing:
    """Every stage in this process, called in order: the one-process ring."""

    route: tuple = ()  # no hosts: a round never leaves this process

    def __init__(self, stages: Sequence[Stage], head: TailDrafter | None = None):
        if not stages or not stages[0].first or not stages[-1].last:
            raise ValueError("a ring needs stages from the embeddings (first) to the head (last)")
        self.stages = list(stages)
        self.head = head  # the tail's drafter (see `drafthead.load_with_head`), if any
        # A drafter that reads taps has every round ask the stages for them
        # (`core.ring.TappedStage`).
        self.taps = tuple(head.taps) if head is not None else ()
        self.samplers: dict[str, Sampler] = {}

    def reset(self, session: str, params: SamplingParams, prefix: Prefix | None = None) -> None:
        for stage in self.stages:
            stage.drop(session)
            if prefix is not None and isinstance(stage, PrefixStage):
                stage.start_from_prefix(session, prefix.name, prefix.length)
        self.reseed(session, params)

    def reseed(self, session: str, params: SamplingParams) -> None:
        self.samplers[session] = sampler_for(params)

    def round(self, r: Round) -> RoundResult:
        sampler = self.samplers.get(r.session)
        if sampler is None:
            raise KeyError(f"session {r.session!r} was never reset")
        session, start_pos, branches = r.session, r.start_pos, r.branches
        x = torch.tensor(r.tokens, dtype=torch.long)
        tail = self.stages[-1]
        taps = None  # the round's taps so far, every stage's beside the earlier ones'
        # A tree's rows, or rows to keep of the last one, go as `forward_many` takes them; a
        # tree the round only asks of the head concerns the tail's head alone.
        tree = branches is not None and (branches.parents is not None or branches.keep)
        if tree or self.taps:
            parents, keep = (branches.parents, branches.keep) if tree else (None, ())
            for stage in self.stages:
                last_rows = r.n_draft + 1 if stage is tail else None
                request = Request(session, x, start_pos, last_rows, parents, keep, self.taps)
                (x,) = stage.forward_many([request])
                if isinstance(x, BaseException):
                    raise x
                if self.taps:
                    taps = stage.carry_taps(session, taps)
            logits = x
        else:
            for stage in self.stages[:-1]:
                x = stage.forward(session, x, start_pos)
            logits = tail.forward(session, x, start_pos, last_rows=r.n_draft + 1)
        if taps is not None:
            tail.features[session] = taps  # what the drafter drafts from: every row's taps
        return finish_round(tail, r, logits, sampler, self.head)

    def drop(self, session: str, keep: Prefix | None = None) -> None:
        if keep is not None:
            self.keep(session, keep)
        for stage in self.stages:
            stage.drop(session)
        self.samplers.pop(session, None)
        if self.head is not None:
            self.head.forget(session)

    def keep(self, session: str, prefix: Prefix) -> None:
        for stage in self.stages:
            if isinstance(stage, PrefixStage):
                stage.keep_prefix(session, prefix.name, prefix.length)

    def close(self) -> None:
        """Nothing to let go of: the stages belong to whoever made them."""
