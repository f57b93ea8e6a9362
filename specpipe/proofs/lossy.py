"""TEST ONLY: a deliberately lossy verify rule, to show the nightly regression catches one.

A stage worker's tail uses it only when a test installs it through the worker's configuration
(`WorkerConfig.tail_sampling`, named "lossy": the stage's record and log then say it does not
sample exactly); nothing in the product does. On the first rejected draft it commits the most
likely token other than the draft instead of the target's own draw: greedy-biased, so the
committed tokens no longer follow the target distribution. Plain sampling (no drafts) is
untouched, which is what makes speculative and plain runs disagree.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specpipe.core.sampling import Sampler


class LossySampler(Sampler):
    """A `Sampler` whose `accept` is biased towards the argmax on rejection."""

    def accept(self, logits, drafts: Sequence[int], start_pos: int) -> list[int]:
        result = super().accept(logits, drafts, start_pos)
        for j, draft in enumerate(drafts):
            if result[j] != draft:
                probs = self.probs(np.asarray(logits, dtype=np.float64)[j]).copy()
                probs[int(draft)] = -1.0  # anything but the rejected draft
                result[j] = int(np.argmax(probs))
                break
        return result
