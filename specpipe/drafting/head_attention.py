"""The draft head's attention over a session's past: EAGLE's one self-attention layer over the
pairs (target feature, sampled token) the session committed, and each draft row's own pairs on
its path from the root.

A pair at position t is x_t = fc([h_{t-1} ; e(x_t)]) (the head's input row, `DraftHead.pair`).
Its query, key and value are taken from rms(x_t) * w_a and turned by rotary angles of t, so a
score depends on the distance between two pairs only. A draft row at depth d of a tree (the
pair of its parent's predicted feature and its token) attends

    the session's committed pairs, the last `window` of them     (shared by every row)
    + the pairs on its own path below them, itself last          (d of them at depth d)

and adds W_o(attention) to x. Training sees the same two parts (`attend_window`): step 1's
row t attends the real pairs up to t; step s's row t (the head unrolled on its own features)
attends the real pairs up to t and its own pairs of steps 2 … s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specpipe.transformer.rope import apply_rope

HEAD_DIM = 64  # the width of one attention head
# Committed pairs a draft row sees by default, and the length of the training windows: on the
# default model 16 drafted as well as an MLP head alone at 30 k tokens, and 128 worse.
WINDOW = 16
ROPE_BASE = 10_000.0


def rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x scaled to unit root mean square over its last dimension (the head's norms, unweighted)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _angles(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [N, hd] for `positions` [N], laid out as `apply_rope` wants them."""
    inv_freq = ROPE_BASE ** -(torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = positions.float()[:, None] * inv_freq[None, :].to(positions.device)  # [N, hd/2]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)


@dataclass
class SessionPast:
    """The keys and values of a session's last committed pairs (already rotated), and the
    position the next pair will have."""

    keys: torch.Tensor  # [H, n, hd]
    values: torch.Tensor  # [H, n, hd]
    next_pos: int

    def __len__(self) -> int:
        return self.keys.shape[1]

    def before(self, position: int) -> SessionPast | None:
        """The pairs before `position`, if this past reaches up to it (else None: a gap)."""
        if self.next_pos < position:
            return None
        keep = max(0, len(self) - (self.next_pos - position))
        return SessionPast(self.keys[:, :keep], self.values[:, :keep], position)


@dataclass
class DraftRows:
    """What a batch of draft rows at one depth attends besides themselves: the session's
    committed pairs before their paths, and each row's pairs on its path so far (keys and
    values [N, d, H, hd], or None at the root). All of them sit at `position`."""

    past: SessionPast | None
    position: int
    own: tuple[torch.Tensor, torch.Tensor] | None = None


class PastAttention(nn.Module):
    """One causal self-attention layer over feature pairs, pre-normed, with a residual."""

    def __init__(self, dim: int, heads: int, window: int = WINDOW) -> None:
        super().__init__()
        if dim % heads or (dim // heads) % 2:
            raise ValueError(f"{heads} heads do not split a width of {dim} into even halves")
        if window < 1:
            raise ValueError(f"a window of {window} pairs sees nothing")
        self.heads, self.head_dim, self.window = heads, dim // heads, window
        self.w_a = nn.Parameter(torch.ones(dim))
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        nn.init.zeros_(self.out.weight)  # the layer starts as the identity

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """Queries, keys and values [..., N, H, hd] of pairs x [..., N, D] at `positions` [N]."""
        shape = (*x.shape[:-1], self.heads, self.head_dim)
        q, k, v = (t.reshape(shape) for t in self.qkv(rms(x) * self.w_a).chunk(3, dim=-1))
        cos, sin = (t[:, None, :] for t in _angles(positions, self.head_dim))  # [N, 1, hd]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    # -- a session's committed pairs --------------------------------------------------------

    def remember(self, past: SessionPast | None, x: torch.Tensor, first_pos: int) -> SessionPast:
        """`past` with the committed pairs x [m, D] at first_pos … appended, the last `window`
        kept. Pairs at or after first_pos that `past` held (a round sent again) are replaced;
        a `past` that ends before first_pos (a gap: the tail missed rounds) is dropped."""
        _, k, v = self.project(x, torch.arange(first_pos, first_pos + len(x), device=x.device))
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [H, m, hd]
        if past is not None and first_pos <= past.next_pos:
            keep = max(0, len(past) - (past.next_pos - first_pos))
            k = torch.cat([past.keys[:, :keep], k], dim=1)
            v = torch.cat([past.values[:, :keep], v], dim=1)
        return SessionPast(k[:, -self.window :], v[:, -self.window :], first_pos + len(x))

    # -- draft rows -------------------------------------------------------------------------

    def attend_rows(
        self, x: torch.Tensor, rows: DraftRows
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Draft rows x [N, D] through the layer; and their own keys and values [N, d, H, hd]
        (their paths' with theirs appended) for their children to attend."""
        q, k, v = self.project(x, torch.full((len(x),), rows.position, device=x.device))
        own = rows.own
        own_k = k[:, None] if own is None else torch.cat([own[0], k[:, None]], dim=1)
        own_v = v[:, None] if own is None else torch.cat([own[1], v[:, None]], dim=1)
        scale = self.head_dim**-0.5
        scores = torch.einsum("nhe,ndhe->nhd", q, own_k) * scale  # [N, H, d]
        values = own_v.transpose(1, 2)  # [N, H, d, hd]
        past = rows.past
        if past is not None and len(past):
            shared = torch.einsum("nhe,hke->nhk", q, past.keys) * scale  # [N, H, n]
            scores = torch.cat([shared, scores], dim=-1)
            values = torch.cat([past.values.expand(len(x), -1, -1, -1), values], dim=2)
        weights = torch.softmax(scores, dim=-1)  # [N, H, n + d]
        mixed = torch.einsum("nhk,nhke->nhe", weights, values).reshape(len(x), -1)  # [N, D]
        return x + self.out(mixed), (own_k, own_v)

    # -- training ---------------------------------------------------------------------------

    def attend_window(
        self,
        x: torch.Tensor,
        step: int,
        real: tuple[torch.Tensor, torch.Tensor] | None = None,
        own: list[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Training windows x [B, L, D] of unrolled step `step` through the layer; and their
        keys and values [B, L, H, hd]. Step 1's rows are the real pairs, and row t attends the
        real pairs up to t. Step s's row t (the head on its own features, s - 1 positions on)
        attends the real pairs up to t (`real`: step 1's keys and values) and its own pairs of
        steps 2 … s (`own`: those of steps 2 … s - 1), as a draft row at depth s - 1 does."""
        b, length = x.shape[:2]
        positions = torch.arange(length, device=x.device) + (step - 1)
        q, k, v = self.project(x, positions)  # [B, L, H, hd]
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        if real is None:
            mixed = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=causal
            ).transpose(1, 2)  # [B, L, H, hd]
            return x + self.out(mixed.reshape(b, length, -1)), (k, v)
        scale = self.head_dim**-0.5
        shared = torch.einsum("blhe,bmhe->bhlm", q, real[0]) * scale  # [B, H, L, L]
        shared = shared.masked_fill(~causal, float("-inf"))
        mine = [*own, (k, v)]
        diagonal = [torch.einsum("blhe,blhe->bhl", q, ok)[..., None] * scale for ok, _ in mine]
        weights = torch.softmax(torch.cat([shared, *diagonal], dim=-1), dim=-1)
        mixed = torch.einsum("bhlm,bmhe->blhe", weights[..., :length], real[1])
        for j, (_, ov) in enumerate(mine):
            mixed = mixed + weights[..., length + j].transpose(1, 2)[..., None] * ov
        return x + self.out(mixed.reshape(b, length, -1)), (k, v)
