"""The generation loop: draft, one round through the ring, the equality accept loop, commit.

Drafts come from the generation's draft sources (`specpipe/drafting/sources.py`): the n-gram
drafter here, the tail's drafter with each round's result, or both. With `adaptive`, each round
sends the number of drafts `specpipe/drafting/length.py` expects to be fastest (at most
`draft_k`); the committed tokens are the same whatever it sends. With `trees` too, the tail's
drafter proposes a draft tree each round, shaped by `specpipe/drafting/tree_size.py` (at most
`draft_k` deep), which the next round carries when the root alone is uncached (else its main
branch, as a chain); the stages keep the branch the tail walked when the round after it names
it (`core.ring.Branches.keep`). Where several sources offer drafts, the one whose drafts are
measured likelier to be accepted goes out (each source's offer is scored every round, sent or
not), the first listed on a tie.

The same loop runs over a `LocalRing` (one process) and a `RedisRing` (the swarm). Positions
are absolute: after a round the stages' caches hold every position sent; the next round starts
at the first position whose cached token was not committed, and the stages truncate there
(this is how rejected drafts roll back). A stage that lost its state answers with a gap; the
loop then replays the committed prefix from position 0, which changes nothing in the output
because every token is sampled from the uniform keyed by its own position (a round replays at
most `MAX_REPLAYS` times: a stage lost while a long replay's rounds pass is replayed again).

A long prefix (a long prompt, a replay, a resume) goes through the ring in prefill rounds of at
most `prefill_chunk` tokens, whose sampled token is not used, before the round that samples: each
stage serves other sessions' rounds between them, so a running job's round waits for one chunk
of someone's prefill rather than for all of it.

When the session's parameters ask for log-probabilities, `logprobs` holds one `TokenLogprob`
per new token, as the tail computed them from the same logits it sampled from.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from specpipe.core.ring import Branches, GapError, Prefix, Ring, Round, RoundResult
from specpipe.core.sampling import SamplingParams, TokenLogprob, committed_tokens
from specpipe.core.tree import DraftTree, TreeShape
from specpipe.drafting.length import DraftLength
from specpipe.drafting.sources import NO_DRAFTS, DraftSource, TailSource, named_sources
from specpipe.drafting.tree_size import TreeSize

# The most tokens one round carries of a long prefix: a few hundred milliseconds of a stage's
# time on the default model, and few enough round trips that a long prompt pays little for them.
PREFILL_CHUNK = 512
MAX_REPLAYS = 3  # replays of one round, its last gap then ending the generation


@dataclass
class GenerationStats:
    """What a generation cost and how well the drafts did."""

    rounds: int = 0
    drafted: int = 0  # draft tokens sent for verification
    accepted: int = 0  # of those, how many were committed
    generated: int = 0  # new tokens committed
    replays: int = 0  # prefix replays after a gap
    reused: int = 0  # positions started from a kept prefix rather than prefilled
    head_rounds: int = 0  # rounds whose drafts the tail's drafter proposed
    tree_rounds: int = 0  # rounds that carried a draft tree (more than one branch)
    seconds: float = 0.0

    @property
    def tok_s(self) -> float:
        return self.generated / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Tokens committed per verify round (accepted drafts plus the target's own token)."""
        return self.generated / self.rounds if self.rounds else 0.0

    @property
    def draft_acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Generation:
    """One session's generation over a ring. Iterate `rounds()` to stream committed tokens."""

    def __init__(
        self,
        ring: Ring,
        session: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        max_new_tokens: int,
        draft_k: int = 4,
        adaptive: bool = False,
        eos_ids: Iterable[int] = (),
        sources: Sequence[DraftSource] | None = None,
        resume: Sequence[int] = (),
        should_stop: Callable[[list[int]], bool] | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        trees: bool = False,
        tree_drafts: int = 0,
        prefix: Prefix | None = None,
    ):
        if not prompt_ids:
            raise ValueError("the prompt has no tokens")
        if max_new_tokens < 0 or draft_k < 0 or prefill_chunk < 0:
            raise ValueError("max_new_tokens, draft_k and prefill_chunk must be >= 0")
        self.ring, self.session, self.params = ring, session, params
        self.max_new_tokens, self.draft_k = max_new_tokens, draft_k
        self.eos_ids = set(eos_ids)
        self.prefill_chunk = prefill_chunk  # 0: a prefix goes in one round, however long
        self.tokens = list(prompt_ids) + list(resume)  # everything committed, prompt included
        self.n_prompt = len(prompt_ids)
        # A prefix of `tokens` the stages keep from an earlier session: the first round starts
        # after it (the last token is always sent: a round samples after it).
        self.prefix = prefix
        self.cached = 0  # positions [0, cached) hold committed tokens in every stage's cache
        # By default the n-gram's drafts, and the tail's drafter's where its drafts can agree.
        self.sources = list(named_sources("both", params) if sources is None else sources)
        for source in self.sources:
            source.learn(self.tokens, None)
        # The tail's drafter, asked each round for the next one's drafts (at most one).
        self.tail = next((s for s in self.sources if isinstance(s, TailSource)), None)
        # With `adaptive`, draft_k is the most a round sends; each round's K is chosen.
        self.draft_length = DraftLength(draft_k) if adaptive and draft_k else None
        # With `trees` too, the tail's proposals are trees of the shape measured to pay (or of
        # `tree_drafts` drafts each, whatever they cost).
        self.tree_size = None
        if trees and self.tail is not None and self.draft_length is not None:
            self.tree_size = TreeSize(draft_k, self.draft_length, tree_drafts)
        self.keep: tuple[int, ...] = ()  # the rows the last tree round walked, for the stages
        self.offers: dict[str, DraftTree] = {}  # this round's proposal of each draft source
        # Sees the generated ids after each round (stop strings); the whole round stays committed.
        self.should_stop = should_stop
        self.stats = GenerationStats()
        self.logprobs: list[TokenLogprob] = []  # of this run's new tokens, when asked for
        self.finished = bool(resume) and (
            resume[-1] in self.eos_ids or (should_stop is not None and should_stop(list(resume)))
        )

    @property
    def generated(self) -> list[int]:
        """The new tokens committed so far."""
        return self.tokens[self.n_prompt :]

    def rounds(self) -> Iterator[list[int]]:
        """Run rounds until EOS, `should_stop` or the token budget; yield each round's tokens."""
        started = time.perf_counter()
        self.ring.reset(self.session, self.params, self.prefix)
        self.keep = ()
        self.cached = self.stats.reused = self._reusable()
        try:
            while not self.finished and len(self.generated) < self.max_new_tokens:
                committed, cached = self._step(self.cached)
                self.cached = min(cached, len(self.tokens))  # none past an EOS cut
                self.stats.seconds = time.perf_counter() - started
                yield committed
        finally:
            self.stats.seconds = time.perf_counter() - started
            if self.finished or len(self.generated) >= self.max_new_tokens:
                for source in self.sources:
                    source.forget()

    def _reusable(self) -> int:
        """The positions the kept prefix gives the session, short of the last token."""
        if self.prefix is None:
            return 0
        return max(0, min(self.prefix.length, len(self.tokens) - 1))

    def _step(self, cached: int) -> tuple[list[int], int]:
        """One round: draft, verify through the ring, commit. The tokens it committed, and the
        positions every stage's cache now holds committed tokens for (its new `cached`)."""
        budget = self.max_new_tokens - len(self.generated)
        proposal, source = self._propose(min(self.draft_k, budget - 1))
        from_tail = source is not None and source.at_tail
        drafts, parents = self._to_send(proposal, source, from_tail)
        replays = self.stats.replays
        round_started = time.perf_counter()
        shape, head_k = self._ask_tail(source if drafts else None)
        result, sent = self._round(cached, drafts, head_k, parents, shape)
        committed = self._verified(result, drafts, parents)
        if self.tree_size is not None:
            self.tree_size.observe(result.ranks)
            self.tree_size.observe_batch(result.batch)
        if self.draft_length is not None:
            seconds = time.perf_counter() - round_started
            steady = sent == len(drafts) + 1 and self.stats.replays == replays
            self._observe_cost(proposal, parents, drafts, committed, seconds, steady)
        cached = len(self.tokens) + len(committed) - 1
        committed = self._commit(committed, result)
        self._count(committed, drafts, parents, from_tail)
        return committed, cached

    def _to_send(
        self, proposal: DraftTree, source: DraftSource | None, from_tail: bool
    ) -> tuple[list[int], tuple[int, ...] | None]:
        """The drafts this round sends of `proposal`, and their parents when they are a tree: a
        tree whole; a chain as long as the draft length chooses (a chain of the tail's drafter
        whole where trees are on: the tree size chose its length)."""
        if not proposal.is_chain:
            return list(proposal.tokens), proposal.parents  # a tree round
        drafts = proposal.main_branch()
        if source and self.draft_length is not None and not (from_tail and self.tree_size):
            drafts = drafts[: self.draft_length.choose(len(drafts), source.name)]
        return drafts, None

    def _verified(
        self, result: RoundResult, drafts: list[int], parents: tuple[int, ...] | None
    ) -> list[int]:
        """The tokens a round's result commits; after a tree, the rows it walked are kept for
        the next round to name."""
        if parents is None:
            return committed_tokens(drafts, result)
        committed = [int(t) for t in result if t >= 0]
        self.keep = tuple(result.path)
        self.stats.tree_rounds += 1
        return committed

    def _commit(self, committed: list[int], result: RoundResult) -> list[int]:
        """Commit a round's tokens, up to the first EOS, and let every draft source learn them;
        the generation is finished at an EOS or where `should_stop` says so."""
        for i, token in enumerate(committed):
            if token in self.eos_ids:
                committed, self.finished = committed[: i + 1], True
                break
        self.tokens += committed
        self.logprobs += result.logprobs[: len(committed)]
        for each in self.sources:
            each.learn(committed, result)
        if self.should_stop is not None and self.should_stop(self.generated):
            self.finished = True
        return committed

    def _count(
        self,
        committed: list[int],
        drafts: list[int],
        parents: tuple[int, ...] | None,
        from_tail: bool,
    ) -> None:
        """Add a round to the stats: its drafts, and how many of them were accepted."""
        self.stats.rounds += 1
        self.stats.head_rounds += bool(drafts) and from_tail
        self.stats.drafted += len(drafts)
        self.stats.accepted += (
            len(committed) - 1 if parents else _leading_matches(committed, drafts)
        )
        self.stats.generated += len(committed)

    def _observe_cost(
        self,
        proposal: DraftTree,
        parents: tuple[int, ...] | None,
        drafts: list[int],
        committed: list[int],
        seconds: float,
        steady: bool,
    ) -> None:
        """Tell the draft length (and the tree size) what the round cost and what its proposal
        would have had accepted. A tree's longest branch is priced as a chain of that many
        rows; its other rows' time, beyond that, is the tree size's to measure."""
        longest = max(proposal.depths) if parents is not None else len(drafts)
        side = len(drafts) - longest
        for offered_by, offer in self.offers.items():  # sent or not, each source is scored
            self.draft_length.score(offer.main_branch(), committed, offered_by)
        line_seconds = seconds
        if self.tree_size is not None and side:
            # The line sees the round without its side rows, at what they are measured to
            # cost: else their time would count twice, in the line and in the side rows' cost.
            line_seconds -= side * self.tree_size.side_cost(self.draft_length.cost()[1])
        self.draft_length.observe_cost(longest, max(line_seconds, 0.0), steady)
        if self.tree_size is not None and steady:
            base, per_row = self.draft_length.cost()
            self.tree_size.observe_cost(side, seconds - (base + longest * per_row))

    def _leads(self, source: DraftSource, other: DraftSource) -> bool:
        """Whether `source`'s drafts go before `other`'s: always without adaptive draft lengths
        (nothing is measured; the first listed goes first); else while its drafts are measured
        at least as likely accepted (in copied text the n-gram's nine in ten; in novel text its
        rare matches are mostly wrong, and the tail's drafter's proposal is the better one)."""
        if self.draft_length is None:
            return True
        return self.draft_length.leads(source.name, other.name)

    def _propose(self, k: int) -> tuple[DraftTree, DraftSource | None]:
        """The drafts for this round, at most k deep, and the source that proposed them: of the
        sources that offer any, the first that leads all the others (`_leads`), else the last.
        What each source offered is kept in `offers`, to be scored against what the round
        commits."""
        self.offers = {}
        if k <= 0:
            return NO_DRAFTS, None
        offering = []
        for source in self.sources:
            offer = source.propose(k)
            if offer.tokens:
                self.offers[source.name] = offer
                offering.append(source)
        for source in offering:
            if all(self._leads(source, other) for other in offering if other is not source):
                return self.offers[source.name], source
        if not offering:
            return NO_DRAFTS, None
        return self.offers[offering[-1].name], offering[-1]

    def _ask_tail(self, chosen: DraftSource | None) -> tuple[TreeShape | None, int]:
        """What to ask of the tail's drafter for the next round, whose steps cost the tail's
        time: nothing while another source's drafts go out and lead it (in copied text the
        n-gram goes on matching); else the tree `TreeSize` chooses, or as many drafts in a chain
        as the draft length would send; and at least one, so that the tail's acceptance is
        still measured."""
        tail = self.tail
        if tail is None:
            return None, 0
        tail.ask(0)
        if self.draft_k == 0 or (
            chosen is not None and not chosen.at_tail and self._leads(chosen, tail)
        ):
            return None, 0
        if self.tree_size is not None:
            shape = self.tree_size.choose()
            tail.ask(len(shape))
            return (shape if len(shape) else TreeShape.chain(1)), 0
        if self.draft_length is None:
            tail.ask(self.draft_k)
            return None, self.draft_k
        tail.ask(self.draft_length.choose(self.draft_k, tail.name))
        return None, max(1, tail.wanted)

    def _round(
        self,
        cached: int,
        drafts: list[int],
        head_k: int,
        parents: tuple[int, ...] | None = None,
        shape: TreeShape | None = None,
    ) -> tuple[RoundResult, int]:
        """The round that verifies `drafts` (a tree under the last committed token, when
        `parents` are given) after the committed tokens, the stages' caches holding
        `[0, cached)`; and how many tokens it sent."""
        for _ in range(MAX_REPLAYS):
            try:
                return self._verify(cached, drafts, head_k, parents, shape)
            except GapError:
                # A stage restarted: rebuild every cache from the committed prefix. A long
                # prefix's replay is several rounds, and another stage may go (or the ring be
                # re-routed) while they pass, so a round may replay more than once, boundedly.
                self.stats.replays += 1
                self.stats.reused = 0
                self.ring.reset(self.session, self.params)
                self.keep = ()
                cached = 0
        return self._verify(cached, drafts, head_k, parents, shape)  # a gap ends the generation

    def _verify(
        self,
        cached: int,
        drafts: list[int],
        head_k: int,
        parents: tuple[int, ...] | None,
        shape: TreeShape | None,
    ) -> tuple[RoundResult, int]:
        # A tree's root goes alone (a replay leaves more uncached); a chain's round carries up
        # to `prefill_chunk` tokens of the prefix before its drafts.
        end = len(self.tokens) - 1 if parents is not None else len(self.tokens)
        while cached < end and (
            parents is not None
            or (self.prefill_chunk and len(self.tokens) - cached > self.prefill_chunk)
        ):
            step_end = min(cached + self.prefill_chunk, end) if self.prefill_chunk else end
            self._send(self.tokens[cached:step_end], cached, 0)  # its token unused
            cached = step_end
        send = self.tokens[cached:] + drafts
        return self._send(send, cached, len(drafts), head_k, parents, shape), len(send)

    def _send(
        self,
        tokens: list[int],
        start_pos: int,
        n_draft: int,
        head_k: int = 0,
        parents: tuple[int, ...] | None = None,
        shape: TreeShape | None = None,
    ) -> RoundResult:
        """One round through the ring, carrying the rows to keep of the last tree round."""
        keep, self.keep = self.keep, ()
        branches = Branches(parents, keep, shape)
        return self.ring.round(Round(self.session, tokens, start_pos, n_draft, head_k, branches))

    def run(self) -> list[int]:
        """Generate to the end; return the new tokens."""
        for _ in self.rounds():
            pass
        return self.generated


def _leading_matches(committed: Sequence[int], drafts: Sequence[int]) -> int:
    """How many drafts were committed as proposed."""
    n = 0
    for token, draft in zip(committed, drafts, strict=False):
        if token != draft:
            break
        n += 1
    return n
