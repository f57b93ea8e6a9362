"""A stage's KV budget: the tokens of cache its record advertises, and which sessions it
forgets when its caches hold more (see `specpipe.swarm.kvbudget` for the sizing)."""

from __future__ import annotations

import torch

from specpipe.core.ring import SizedStage, Stage
from specpipe.settings import kv_budget_tokens
from specpipe.swarm import kvbudget

OVER_BUDGET_IDLE_S = 30.0  # over the KV budget, a session idle this long is forgotten


def kv_budget(stage: Stage) -> int:
    """The tokens of KV cache this stage holds across its sessions, as its record advertises:
    `SPECPIPE_KV_BUDGET_TOKENS`, else a share of the memory available now (the GPU's free
    memory on a GPU) over what one token of the stage's layers takes; 0 when neither is known."""
    configured = kv_budget_tokens()
    if configured is not None:
        return configured
    if not isinstance(stage, SizedStage):  # a stage that cannot say has none unless configured
        return 0
    per_token, device = stage.kv_bytes_per_token(), torch.device(stage.device)
    if device.type == "cuda":
        available = torch.cuda.mem_get_info(device)[0]
    else:
        available = kvbudget.available_memory_bytes()
    return kvbudget.default_budget_tokens(per_token, available)


def over_budget(
    held: dict[str, int], budget: int, last_used: dict[str, float], now: float
) -> list[str]:
    """The sessions to forget, idle longest first, while the caches hold more than `budget`
    tokens (`held`: per session): each only if idle for `OVER_BUDGET_IDLE_S`. The room that
    coordinators reserve ends with their jobs (or their locks), but a cache lives on here until
    its drop, or until the session is idle; one forgotten too early costs only a replay."""
    total = sum(held.values())
    cutoff = now - OVER_BUDGET_IDLE_S
    forgotten = []
    for session in sorted(held, key=lambda s: last_used.get(s, 0.0)):
        if total <= budget or last_used.get(session, 0.0) > cutoff:
            break
        total -= held[session]
        forgotten.append(session)
    return forgotten
