"""The vocabulary of a round and its math: the ring and stage protocols, sampling, the
coupling of drafts to the target's draws, and stop strings."""
