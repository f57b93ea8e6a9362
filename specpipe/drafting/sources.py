"""Where a round's drafts come from: the draft sources a generation composes, and the drafters
at the tail.

A `DraftSource` is what the generation loop (`specpipe.decoding.generation`) asks for drafts: it
proposes a chain or a tree for its session, learns from what each round committed, and forgets
the session at its end. Two kinds exist:

- `NgramSource`, prompt lookup over the session's committed tokens, drafted where the loop runs;
- `TailSource`, whatever drafter the tail stage runs (today's draft head, an EAGLE-3 head): it
  drafts right after the tail verifies a round, from the target's hidden states, and its
  proposal comes back with that round's result. Its drafts cost the tail's time, so the loop
  says each round how many it wants (`ask`), none while another source's drafts lead.

At the tail, a `TailDrafter` is the drafter itself, shared by every session the stage serves:
it learns each session's committed tokens with the features that drew them, proposes a chain
or a tree after the last one, ranks a tree's candidates against what the target chose, and
forgets a session. `specpipe.drafting.head.TailHead` is one.

Whatever a source proposes, the verify rule commits exactly what the target samples: a source
changes how many tokens a round commits, never which.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from specpipe.core.ring import RoundResult
from specpipe.core.sampling import SamplingParams
from specpipe.core.tree import DraftTree, TreeShape
from specpipe.drafting.ngram import NgramDrafter

# Which sources a generation drafts from, by name: the n-gram drafter, the tail's drafter, or the
# n-gram where it has a match and leads and the tail's drafter elsewhere.
DRAFT_SOURCES = ("ngram", "head", "both")
NO_DRAFTS = DraftTree((), ())


@runtime_checkable
class DraftSource(Protocol):
    """A source of one session's drafts."""

    name: str  # what its proposals are scored and sized under (`DraftLength`)
    at_tail: bool  # drafted by the tail after each round: asked for, at the tail's cost

    def propose(self, k: int) -> DraftTree:
        """Its drafts after what it learned, at most `k` deep (none: an empty tree)."""
        ...

    def learn(self, committed: Sequence[int], result: RoundResult | None) -> None:
        """Tokens the session committed (the prompt first, with no result), and the round's
        result that committed them."""
        ...

    def forget(self) -> None:
        """The session ended: let go of what was learned."""
        ...


class NgramSource:
    """Prompt lookup over the session's committed tokens (`NgramDrafter`)."""

    name = "ngram"
    at_tail = False

    def __init__(self, drafter: NgramDrafter | None = None) -> None:
        self.drafter = drafter or NgramDrafter()

    def propose(self, k: int) -> DraftTree:
        return DraftTree.chain(self.drafter.propose(k))

    def learn(self, committed: Sequence[int], result: RoundResult | None) -> None:
        self.drafter.extend(committed)

    def forget(self) -> None:
        self.drafter = NgramDrafter(self.drafter.max_ngram, self.drafter.min_ngram)


class TailSource:
    """The tail's drafter as the loop sees it: the chain or tree it sent back with the last
    result, offered only when the loop asked for some (`ask`) for this round."""

    name = "head"
    at_tail = True

    def __init__(self) -> None:
        self.proposal = NO_DRAFTS
        self.wanted = 0  # drafts asked of the tail for the round ahead (0: none)

    def ask(self, wanted: int) -> None:
        """The round going out asks the tail for `wanted` drafts for the round after it."""
        self.wanted = wanted

    def propose(self, k: int) -> DraftTree:
        if not self.wanted or not self.proposal.tokens:
            return NO_DRAFTS
        return self.proposal.within_depth(k)

    def learn(self, committed: Sequence[int], result: RoundResult | None) -> None:
        self.proposal = NO_DRAFTS if result is None else result.draft_tree

    def forget(self) -> None:
        self.proposal, self.wanted = NO_DRAFTS, 0


def named_sources(name: str, params: SamplingParams) -> list[DraftSource]:
    """The sources `name` (one of DRAFT_SOURCES) stands for, the one to go first on a tie first.
    The tail's drafter drafts in the target's own noise (Gumbel-max), so at a sampling
    temperature its drafts agree with the target's draws only under that sampler: elsewhere it
    is left out."""
    if name not in DRAFT_SOURCES:
        raise ValueError(f"drafts_from must be one of {', '.join(DRAFT_SOURCES)}")
    sources: list[DraftSource] = []
    if name in ("ngram", "both"):
        sources.append(NgramSource())
    if name in ("head", "both") and (params.temp <= 0 or params.sampler == "gumbel"):
        sources.append(TailSource())
    return sources


@runtime_checkable
class TailDrafter(Protocol):
    """A drafter at the tail, for every session the stage serves (see the module's docstring)."""

    # The target's layers whose incoming hidden states it drafts from, every row's, side by
    # side (`StageModel.tap_layers`); none: the tail's own rows before the final norm.
    taps: tuple[int, ...]

    def remember(
        self, session: str, features: torch.Tensor, tokens: Sequence[int], first_pos: int
    ) -> None:
        """Tokens the session committed at `first_pos` …, each with the feature [m, D] of the
        row that sampled it."""
        ...

    def starts_round(self, session: str, token: int, token_pos: int) -> None:
        """A round of the session starts from `token` at `token_pos`, before it remembers the
        round's tokens: the token the row before it drew, unless the loop dropped that one (a
        prefill chunk's round samples a token it does not keep)."""
        ...

    def ranks_of(
        self, session: str, root_pos: int, root: int, committed: Sequence[int]
    ) -> list[int]:
        """The rank of each committed token among the candidates of the session's last tree,
        when it grew from `root` at `root_pos`."""
        ...

    def drafts_after(
        self,
        session: str,
        feature: torch.Tensor,
        token: int,
        token_pos: int,
        k: int,
        params: SamplingParams,
    ) -> list[int]:
        """`k` drafts in a chain after the last committed `token`."""
        ...

    def draft_tree(
        self,
        session: str,
        feature: torch.Tensor,
        token: int,
        token_pos: int,
        shape: TreeShape,
        params: SamplingParams,
    ) -> DraftTree:
        """A tree of `shape` after the last committed `token`."""
        ...

    def forget(self, session: str) -> None:
        """Let go of what is kept of a session."""
        ...
