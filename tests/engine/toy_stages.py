"""A tiny recurrent two-stage model that honours the stage contract (cache by absolute
position, truncate to start_pos, gap beyond the cache). The generation loop's tests use it;
the real transformer stages are tested against transformers in tests/model."""

from __future__ import annotations

import torch

from specpipe.core.ring import GapError

VOCAB, WIDTH = 40, 16


class ToyStage:
    """Stage 0 embeds and runs h_t = tanh(E[x_t] + 0.9 h_{t-1}); the tail maps h_t to logits."""

    def __init__(self, first: bool, last: bool, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.first, self.last = first, last
        self.embed = torch.randn(VOCAB, WIDTH, generator=gen, dtype=torch.float64)
        self.head = torch.randn(WIDTH, VOCAB, generator=gen, dtype=torch.float64) * 3
        self.cache: dict[str, list[torch.Tensor]] = {}
        self.calls = 0

    def forward(
        self, session: str, inputs: torch.Tensor, start_pos: int, last_rows: int | None = None
    ) -> torch.Tensor:
        self.calls += 1
        states = self.cache.setdefault(session, [])
        if start_pos > len(states):
            raise GapError(f"session {session}: cache ends at {len(states)}, asked {start_pos}")
        del states[start_pos:]
        if not self.first:
            states.extend(inputs.double())
            return (inputs.double() @ self.head).float()
        out = []
        for token in inputs.tolist():
            previous = states[-1] if states else torch.zeros(WIDTH, dtype=torch.float64)
            states.append(torch.tanh(self.embed[token] + 0.9 * previous))
            out.append(states[-1])
        return torch.stack(out)

    def drop(self, session: str) -> None:
        self.cache.pop(session, None)

    def held_tokens(self) -> dict[str, int]:
        return {session: len(states) for session, states in self.cache.items()}


def toy_stages() -> list[ToyStage]:
    return [ToyStage(first=True, last=False), ToyStage(first=False, last=True)]
