"""The tail's end of a round, written once for every ring: verify the drafts against the logits
(the sampler's doctored result vector, or the walk of a draft tree, and the committed tokens'
log-probabilities), then let the draft head propose the next round's drafts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specpipe.core.ring import Round, RoundResult, Stage
from specpipe.core.sampling import Sampler
from specpipe.core.tree import DraftTree

if TYPE_CHECKING:
    from specpipe.drafting.sources import TailDrafter


def finish_round(
    tail: Stage,
    r: Round,
    logits: torch.Tensor,
    sampler: Sampler,
    head: TailDrafter | None = None,
) -> RoundResult:
    """The result of round `r` from the tail stage's `logits` (at least its last
    `r.n_draft + 1` rows), its drafts verified (a tree under the token before them when
    `r.branches.parents` says so); with the next round's drafts from `head`, which drafts from
    `tail.features[r.session]`: up to `r.head_k` in a chain, or the tree of `r.branches.shape`.
    ValueError when the drafts or the logits cannot be verified (a draft id outside the
    vocabulary, a malformed tree, NaN)."""
    session, tokens, start_pos, n_draft = r.session, r.tokens, r.start_pos, r.n_draft
    branches = r.branches
    rows = logits[-(n_draft + 1) :]
    root_pos = start_pos + len(tokens) - n_draft - 1  # the position of the last committed token
    path: list[int] = []
    if branches is not None and branches.parents is not None:
        if len(tokens) != n_draft + 1:
            raise ValueError("a tree round carries its root and its drafts only")
        tree = DraftTree(tokens[1:], tuple(branches.parents))
        committed, path = sampler.accept_tree(rows, tree, root_pos + 1)
        result = committed + [-1] * (n_draft + 1 - len(committed))
        logprobs = sampler.result_logprobs(rows[path], result)
        feature_row = path[-1]
    else:
        drafts = list(tokens)[len(tokens) - n_draft :] if n_draft else []
        result = sampler.accept(rows, drafts, root_pos + 1)
        logprobs = sampler.result_logprobs(rows, result)
        committed = [t for t in result if t >= 0]
        feature_row = len(committed) - 1
    found = RoundResult(result, logprobs, path=path)
    if head is None:
        return found
    # Each committed token with the feature of the row that drew it: the head's past. Where
    # the tail kept more rows than the verify's (every row's taps, for an EAGLE-3 head), the
    # rows before the root drew the round's own tokens after them.
    head.starts_round(session, int(tokens[0]), start_pos)
    kept = tail.features.get(session)
    if kept is not None:
        before = kept.shape[0] - (n_draft + 1)
        if before > 0:
            first = len(tokens) - n_draft - before  # the token the first of them drew
            head.remember(session, kept[:before], tokens[first : first + before], start_pos + first)
            kept = kept[before:]
        drew = path if path else range(len(committed))
        head.remember(session, kept[list(drew)], committed, root_pos + 1)
    root = int(tokens[len(tokens) - n_draft - 1])
    found.ranks = head.ranks_of(session, root_pos, root, committed)
    shape = branches.shape if branches is not None else None
    if (shape is None and r.head_k <= 0) or kept is None:
        return found  # nothing asked, or nothing to draft from (a round without its taps)
    # The last committed token was drawn from `feature_row`, whose feature sits one position
    # before that token's.
    features = kept[feature_row]
    token_pos = root_pos + len(committed)
    if shape is not None:
        tree = head.draft_tree(session, features, committed[-1], token_pos, shape, sampler.params)
        found.drafts, found.draft_parents = list(tree.tokens), list(tree.parents)
    else:
        found.drafts = head.drafts_after(
            session, features, committed[-1], token_pos, r.head_k, sampler.params
        )
    return found
