"""The ring interface: one verify round through every stage, in one process or across hosts.

A *round* (`Round`: a session's tokens from an absolute position, the last of them drafts, a
chain or a draft tree) passes every stage; the tail verifies its drafts and the ring returns the
doctored result vector, a `RoundResult`: the list of ids, with the committed tokens'
`TokenLogprob`s beside it when the session asked for log-probabilities
(`SamplingParams.logprobs`), and the tail's draft head's proposal for the next round when the
round asked for one. A stage whose cache ends before the round's start (it restarted) raises
`GapError`; the caller then replays the committed prefix as one round from position 0.

`LocalRing` (`specpipe.decoding.local_ring`) runs the stages in this process; `RedisRing`
(`specpipe.swarm.redis_ring`) sends each hop over Redis Streams. Both offer the same calls, so
the generation loop cannot tell them apart.

What a caller needs beyond a round is named here too, so nobody has to probe for it: every
ring has a `route` (the hosts a round passes, none in one process) and a `close`; a ring across
hosts whose late rounds can ask whether a hop is gone is a `WatchedRing`, and one that can build
itself again on another route a `ReroutingRing`. A stage that runs several sessions' rounds as
one forward is a `BatchedStage`; a tail that keeps the features its draft head reads is a
`FeatureStage`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specpipe.core.sampling import SamplingParams, TokenLogprob
from specpipe.core.tree import DraftTree, TreeShape


class GapError(RuntimeError):
    """A stage was asked to continue from a position beyond its KV cache (it lost its state)."""


class RoundResult(list):
    """A round's doctored result vector (a list of ids, equal to the plain list; after a tree,
    its committed tokens, -1 padded) carrying the committed tokens' log-probabilities when the
    session asked for them, and the tail's draft head's proposal for the next round when it was
    asked for one: a chain, or a tree when `draft_parents` says where each draft hangs."""

    def __init__(
        self,
        ids,
        logprobs: Sequence[TokenLogprob] = (),
        drafts: Sequence[int] = (),
        *,
        path: Sequence[int] = (),
        draft_parents: Sequence[int] = (),
        ranks: Sequence[int] = (),
        batch: int = 1,
    ) -> None:
        super().__init__(ids)
        self.logprobs = list(logprobs)
        self.drafts = [int(t) for t in drafts]
        self.path = [int(r) for r in path]  # a tree round's rows walked, the root first
        self.draft_parents = [int(r) for r in draft_parents]  # the proposal's tree, if a tree
        # Where the head drafted the tree this round verified: the rank of each committed token
        # among the head's candidates at its node, -1 for none of them (`TreeSize` learns from
        # it), up to the first node the head did not expand.
        self.ranks = [int(r) for r in ranks]
        # The rounds the tail's forward ran together, this one's included: what a row of this
        # session's costs the others too.
        self.batch = max(int(batch), 1)

    @property
    def draft_tree(self) -> DraftTree:
        """The head's proposal as a tree (a chain when it gave no parents)."""
        if self.draft_parents:
            return DraftTree(tuple(self.drafts), tuple(self.draft_parents))
        return DraftTree.chain(self.drafts)


@dataclass(frozen=True)
class Branches:
    """What a round says of draft trees, beyond its tokens.

    `parents`: the round's drafts form a tree, draft i under row parents[i] (row 0: the root,
    the round's first token; its only other tokens are the drafts). `keep`: the rows the last
    tree round walked, the root first, which every stage stores at that root's position before
    running this round. `shape`: the tree the tail's draft head proposes for the next round."""

    parents: tuple[int, ...] | None = None
    keep: tuple[int, ...] = ()
    shape: TreeShape | None = None


@dataclass(frozen=True)
class Round:
    """One session's verify round: `tokens` at absolute positions `start_pos …
    start_pos+len(tokens)-1`, the last `n_draft` of them drafts. The tail samples the doctored
    result vector for the `n_draft + 1` positions that follow the last non-draft token (see
    `Sampler.accept`): n_draft + 1 ids, -1 padded.

    `head_k`: up to that many drafts for the next round from the tail's draft head, if it has
    one (`RoundResult.drafts`). `branches` (see `Branches`): what the round says of draft trees.
    With `parents`, its drafts form a tree instead of a chain (`core.tree`): its tokens are the
    root (the last committed token) and the drafts, each under a parent row. Every stage runs
    the tree's rows in one forward and the tail walks it; the result holds the committed tokens
    and the rows walked (`RoundResult.path`). The stages keep those rows in their caches when
    the session's next round tells them which they were (`keep`), so a tree costs no trip and
    no forward of its own: a stage that is told nothing forgets the tree, and a round that then
    starts past its cache gets a gap, as after a restart. With `shape`, the head proposes that
    tree for the next round instead of `head_k` drafts in a chain.

    ValueError unless the round has tokens, more of them than drafts."""

    session: str
    tokens: tuple[int, ...]
    start_pos: int
    n_draft: int = 0
    head_k: int = 0
    branches: Branches | None = None

    def __post_init__(self) -> None:
        tokens = tuple(int(t) for t in self.tokens)
        object.__setattr__(self, "tokens", tokens)
        if not tokens or not 0 <= self.n_draft < len(tokens):
            raise ValueError(
                f"a round needs more tokens ({len(tokens)}) than drafts ({self.n_draft})"
            )

    @property
    def wanted(self) -> int:
        """How many drafts the tail's head is asked for: the tree's of `branches.shape`, else
        `head_k`."""
        branches = self.branches
        return len(branches.shape) if branches and branches.shape else self.head_k


@dataclass(frozen=True)
class Request:
    """One session's round for a stage (see `Stage.forward`)."""

    session: str
    inputs: torch.Tensor
    start_pos: int
    last_rows: int | None = None
    # A draft tree (`core.tree`): the parent row of each input row after the first (the root);
    # row r sits at start_pos + its depth and sees the prefix and its own ancestors. None: the
    # rows are a sequence at start_pos, start_pos + 1, …
    parents: tuple[int, ...] | None = None
    # The rows of the session's last tree that its tail walked (root first): stored before this
    # round runs, where it starts right after them (`Branches.keep`).
    keep: tuple[int, ...] = ()
    # The layers whose incoming hidden states the tail's drafter reads (an EAGLE-3 head's
    # taps): a stage keeps those in its range for every row (`TappedStage`). (): none.
    taps: tuple[int, ...] = ()


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

    def held_tokens(self) -> dict[str, int]:
        """The positions each session's cache holds now (what a KV budget counts)."""
        ...


@runtime_checkable
class SizedStage(Stage, Protocol):
    """A stage that knows what its caches cost: what its KV budget is derived from."""

    device: torch.device | str  # where its weights and caches live

    def kv_bytes_per_token(self) -> int:
        """What one position of one session's cache takes across this stage's layers."""
        ...


@runtime_checkable
class BatchedStage(Stage, Protocol):
    """A stage that runs rounds of different sessions as one forward."""

    def forward_many(self, requests: Sequence[Request]) -> list[torch.Tensor | Exception]:
        """Each request's `forward`, in one pass; a request that failed has its exception in
        its place, the others their output."""
        ...


class FeatureStage(Stage, Protocol):
    """A tail that keeps, per session, the rows its last round sampled from as they were
    before the final norm: what the tail's draft head drafts from."""

    keep_features: bool
    features: dict[str, torch.Tensor]


class TappedStage(BatchedStage, Protocol):
    """A stage that keeps, per session, the hidden states entering the layers its last round
    asked for (`Request.taps`) for every row: what an EAGLE-3 head drafts from."""

    def split_taps(
        self, inputs: torch.Tensor, taps: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the previous stage sent, [T, (1 + j) x D], as the round's rows [T, D] and the
        earlier stages' taps [T, j x D] (None: none); ValueError for the wrong width."""
        ...

    def carry_taps(self, session: str, before: torch.Tensor | None) -> torch.Tensor | None:
        """`before` (the earlier stages' taps of the round, [T, j x D]) with this stage's
        beside them."""
        ...


@dataclass(frozen=True)
class Prefix:
    """A prefix the stages keep: its name there, and the positions of it a session starts from
    (`Ring.reset`) or a session's end keeps (`Ring.drop`)."""

    name: str
    length: int


@runtime_checkable
class PrefixStage(Stage, Protocol):
    """A stage that keeps a session's cache as a named prefix, for later sessions whose tokens
    start with the same ones (see `StageModel.keep_prefix`)."""

    def keep_prefix(self, session: str, name: str, length: int) -> int:
        """Keep a copy of `session`'s first `length` positions as `name`; how many it kept."""
        ...

    def start_from_prefix(self, session: str, name: str, length: int) -> bool:
        """Start `session` from a copy of `name`'s first `length` positions; whether it could."""
        ...

    def forget_prefix(self, name: str) -> None:
        """Let go of a kept prefix."""
        ...

    def kept_tokens(self) -> dict[str, int]:
        """The positions each kept prefix holds."""
        ...


class Hop(Protocol):
    """One stage on a route: its host, the Redis holding its input stream, what it is routed
    for (layers `layer_start:layer_end` of `model`), which it checks at every round, and the
    tokens of KV cache it holds across sessions (`kv_budget_tokens`, 0: no budget known)."""

    @property
    def host(self) -> str: ...

    @property
    def redis_url(self) -> str: ...

    @property
    def layer_start(self) -> int: ...

    @property
    def layer_end(self) -> int: ...

    @property
    def model(self) -> str: ...

    @property
    def kv_budget_tokens(self) -> int: ...


class Ring(Protocol):
    """A path through every stage, ending in the tail's sampler."""

    def reset(self, session: str, params: SamplingParams, prefix: Prefix | None = None) -> None:
        """Start (or restart) a session: clear caches, set the tail's sampling parameters. With
        `prefix`, each stage that keeps it starts the session from its first `prefix.length`
        positions (one that does not starts it empty: the first round then gets a gap)."""
        ...

    def reseed(self, session: str, params: SamplingParams) -> None:
        """Change a session's sampling parameters on the tail, keeping every cache (the proofs
        draw many times from one context)."""
        ...

    def round(self, r: Round) -> RoundResult:
        """Run one round; return the doctored result vector (`r.n_draft + 1` ids, -1 padded),
        with the tail's draft head's proposal for the next round when `r` asks for one."""
        ...

    def drop(self, session: str, keep: Prefix | None = None) -> None:
        """End a session everywhere; with `keep`, every stage keeps the first `keep.length`
        positions of its cache as the prefix `keep.name`."""
        ...

    def keep(self, session: str, prefix: Prefix) -> None:
        """Every stage keeps the first `prefix.length` positions of the session's cache as the
        prefix `prefix.name`, the session going on (jobs with the same first tokens that wait
        for its prefill start from it)."""
        ...

    def close(self) -> None:
        """Let go of what the ring holds open (connections); its sessions are not dropped."""
        ...

    @property
    def route(self) -> Sequence[Hop]:
        """The stages a round passes, in ring order; empty when every stage is in this
        process."""
        ...


class WatchedRing(Ring, Protocol):
    """A ring across hosts whose late rounds ask `watchdog` whether a hop of the route is gone
    (a reason back ends the round), and which can end a session on all but some hosts."""

    watchdog: Callable[[], str | None] | None

    def drop(self, session: str, keep: Prefix | None = None, skip: Collection[str] = ()) -> None:
        """End a session on every stage but those of the hosts in `skip` (gone ones)."""
        ...


class ReroutingRing(Ring, Protocol):
    """A ring that may build itself again on another route while a session runs; it calls
    `on_reroute`, when set, with the new route before it replays there."""

    on_reroute: Callable[[Sequence[Hop]], None] | None
