"""The tail's sampling: each session's sampler, set by its `reset` or `reseed`, and the round's
verify-and-draft step (`specpipe.decoding.tail`) that turns the tail's logits into the reply.

Which sampler a session's parameters get is the worker's config (`TailSampling`): the lossless
one they name, unless the process that built the worker installed another (a test double), whose
name then shows in the node's record and log."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specpipe.core import coupling
from specpipe.core.ring import Branches, Round, Stage
from specpipe.core.sampling import Sampler, SamplingParams
from specpipe.core.tree import TreeShape
from specpipe.decoding.tail import finish_round
from specpipe.swarm import wire
from specpipe.swarm.inventory import EXACT_SAMPLER
from specpipe.swarm.stage.activity import remember
from specpipe.swarm.stage.counters import StageStats

if TYPE_CHECKING:
    from specpipe.drafting.sources import TailDrafter

MAX_SESSIONS = 4096  # sessions whose sampling parameters are kept


@dataclass(frozen=True)
class TailSampling:
    """The sampler a session's parameters get on this stage, and its name: any but
    `EXACT_SAMPLER` is NOT lossless (a test double), which the stage then says loudly."""

    sampler_for: Callable[[SamplingParams], Sampler] = coupling.sampler_for
    name: str = EXACT_SAMPLER

    @property
    def exact(self) -> bool:
        """Whether these are the product's lossless samplers."""
        return self.name == EXACT_SAMPLER


class TailSamplers:
    """Each session's sampler (every stage keeps them; the tail draws with them)."""

    def __init__(
        self,
        stage: Stage,
        sampling: TailSampling,
        stats: StageStats,
        head: TailDrafter | None = None,
    ) -> None:
        self.stage = stage
        self.sampling = sampling
        self.stats = stats
        self.head = head  # the tail's draft head (`drafting.head.load_with_head`), if any
        self._samplers: OrderedDict[str, Sampler] = OrderedDict()

    def __contains__(self, session: str) -> bool:
        return session in self._samplers

    def set_params(self, message: wire.Message) -> None:
        """Take a `reset`'s or `reseed`'s parameters for its session; a message with parameters
        that make no sampler is dropped and counted."""
        try:
            sampler = self.sampling.sampler_for(SamplingParams.from_fields(message.params))
        except (KeyError, IndexError, ValueError, TypeError, OverflowError) as exc:
            self.stats.drop(f"reset with bad sampling parameters: {exc}")
            return
        remember(self._samplers, message.session, sampler, MAX_SESSIONS)

    def forget(self, session: str) -> None:
        self._samplers.pop(session, None)
        if self.head is not None:
            self.head.forget(session)

    def sample(
        self, message: wire.Message, logits: torch.Tensor, host: str, batch: int = 1
    ) -> tuple[str, dict]:
        """The reply to a round the tail ran, as (kind, fields): its result (with the `batch`
        of rounds its forward ran), or a gap when the session's parameters were lost, or an
        error when its drafts cannot be verified."""
        sampler = self._samplers.get(message.session)
        if sampler is None:
            # The tail restarted and lost the reset; the coordinator re-sends it on a gap.
            self.stats.count("gaps")
            return "gap", {"reason": f"{host}: no sampling parameters"}
        try:
            r = Round(
                message.session,
                message.tokens,
                message.start_pos,
                message.n_draft,
                message.head_k,
                branches_of(message),
            )
            result = finish_round(self.stage, r, logits, sampler, self.head)
        except ValueError as exc:  # e.g. a draft id outside the vocabulary, NaN logits
            self.stats.count("errors")
            return "error", {"reason": f"{host}: {exc}"}
        if message.parents is not None:
            self.stats.count("trees")
        return "result", {
            "tokens": tuple(int(t) for t in result),
            "logprobs": tuple((lp.logprob, lp.top) for lp in result.logprobs),
            "drafts": tuple(result.drafts),
            "path": tuple(result.path),
            "draft_parents": tuple(result.draft_parents),
            "ranks": tuple(result.ranks),
            "batch": min(batch, wire.MAX_BATCH),
        }


def branches_of(message: wire.Message) -> Branches | None:
    """What a round says of draft trees (`core.ring.Branches`), None when it says nothing."""
    if message.parents is None and not message.keep and not message.head_shape:
        return None
    shape = None
    if message.head_shape:
        parents, ranks = zip(*message.head_shape, strict=True)
        shape = TreeShape(parents, ranks)
    return Branches(message.parents, message.keep, shape)
