"""A drafter's tokens under the target's own noise (the Gumbel coupling, `core.coupling`).

A drafter whose distribution is close to the target's drafts the token the target will draw as
often as the two allow when it draws with the noise the target draws that position with:
greedy, its argmax; sampled, the Gumbel-max draw of its distribution under the target's
temperature, top-p and top-k. Its columns may be part of the target's vocabulary only (`ids`:
column c is token ids[c]): the noise is the target's for those tokens, and a token outside
them is simply never drafted. Whatever it drafts, the verify commits the target's own draw.
"""

from __future__ import annotations

import numpy as np

from specpipe.core.coupling import gumbel_draw, gumbel_noise
from specpipe.core.sampling import SamplingParams, target_probs


def coupled_draft(
    logits: np.ndarray, params: SamplingParams, position: int, ids: np.ndarray | None = None
) -> int:
    """The drafter's token at `position` from its logits [V'] (column c is token ids[c], or c):
    argmax when greedy, else the Gumbel-max draw of its distribution under the target's
    sampling parameters and the target's noise for those tokens."""
    if params.temp <= 0:
        best = int(np.argmax(logits))
        return best if ids is None else int(ids[best])
    q = target_probs(logits, params.temp, params.top_p, params.top_k)
    return gumbel_draw(q, params.seed, position, ids)


def ranked_candidates(
    logits: np.ndarray, params: SamplingParams, position: int, ids: np.ndarray | None, n: int
) -> list[int]:
    """The drafter's best `n` tokens at `position` from its logits [V'] (column c is token
    ids[c], or c), best first: by logit when greedy, else by the Gumbel-max score log q + g
    under the target's noise, over the tokens q keeps. The first is `coupled_draft`'s token."""
    return ranked_at(np.asarray(logits)[None, :], params, position, ids, n)[0]


def ranked_at(
    logits: np.ndarray, params: SamplingParams, position: int, ids: np.ndarray | None, n: int
) -> list[list[int]]:
    """`ranked_candidates` of each row of logits [N, V'], all drafting one `position` (the
    nodes of one depth of a tree): the noise of the tokens any row keeps is drawn once."""
    logits = np.asarray(logits)
    if params.temp <= 0:
        return [_best(np.asarray(row, dtype=np.float64), None, ids, n) for row in logits]
    q = target_probs(logits, params.temp, params.top_p, params.top_k)  # [N, V']
    kept_any = np.flatnonzero((q > 0).any(axis=0))
    tokens = kept_any if ids is None else np.asarray(ids)[kept_any]
    noise = np.zeros(q.shape[1])
    noise[kept_any] = gumbel_noise(params.seed, position, tokens)
    ranked = []
    for row in q:
        columns = np.flatnonzero(row > 0)
        ranked.append(_best(np.log(row[columns]) + noise[columns], columns, ids, n))
    return ranked


def _best(
    scores: np.ndarray, columns: np.ndarray | None, ids: np.ndarray | None, n: int
) -> list[int]:
    """The tokens of the `n` best `scores` (of `columns`, or of every column), best first; on a
    tie the lower column, as `coupled_draft`'s argmax picks it."""
    if columns is None:
        columns = np.arange(len(scores))
    n = min(n, len(scores))
    top = np.argpartition(-scores, n - 1)[:n] if n < len(scores) else np.arange(len(scores))
    best = top[np.lexsort((columns[top], -scores[top]))]
    chosen = columns[best]
    return [int(c) if ids is None else int(ids[c]) for c in chosen]
