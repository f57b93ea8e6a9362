"""Row-stable products: linear layers and batched matmuls whose rows do not depend on how many
rows run together.

Row stability: the logits at a position must be the same numbers whether it is computed alone (a
plain decode step) or among K drafts (a verify), or speculative and plain sampling could commit
different tokens. Linear layers on the CPU hold their weight packed in oneDNN's blocked layout
(`Linear.pack`): its kernels give every row the same numbers for any number of rows from 2 up,
and a few rows cost about what one does. Packing checks this on each weight and keeps the plain
weight where it does not hold. Unpacked products go through BLAS, whose kernel (and rounding)
depends on the number of rows in ways that differ between CPUs; so they run in blocks of exactly
`BLAS_ROWS` rows, the last one padded. A packed product runs at most `PACKED_ROWS` rows at a
time, and above `BLAS_ROWS` rows pads to a multiple of it: oneDNN keeps a kernel, and memory with
it, for every number of rows it has run (up to 1,024 of them): 20 prompts of new lengths grew
a stage of the default model by 91 MB, and now by 5 MB, each weight running one of 28 shapes
(prefill measured 2 % slower than with a kernel for each length, 16 % with blocks of 64 rows).
Attention's products pad to at least `MIN_ROWS` rows (and its keys too, see `attention`). Every
module with a `row_stable` attribute follows it; `row_stable=False` on the stage turns all of
this off, and a verify row may then differ from a plain step in the last bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MIN_ROWS = 4
BLAS_ROWS = 16
PACKED_ROWS = 256  # the most rows one packed product runs


def padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [..., M, K] with zero rows appended up to `rows` (x itself if it has as many)."""
    pad = rows - x.shape[-2]
    return F.pad(x, (0, 0, 0, pad)) if pad > 0 else x


def stable_linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, stable: bool = True
) -> torch.Tensor:
    """F.linear on [M, K] whose every row is the same numbers for any M: the rows go through
    BLAS in blocks of exactly `BLAS_ROWS` (unless `stable` is False)."""
    M = x.shape[-2]
    if not stable:
        return F.linear(x, w, b)
    x = padded(x, -(-M // BLAS_ROWS) * BLAS_ROWS)
    blocks = [F.linear(block, w, b) for block in x.split(BLAS_ROWS, dim=-2)]
    return torch.cat(blocks, dim=-2)[..., :M, :]


def stable_bmm(a: torch.Tensor, b: torch.Tensor, min_rows: int = MIN_ROWS) -> torch.Tensor:
    """a @ b for [B, M, K] x [B, K, N] whose every row is the same numbers for any M."""
    M = a.shape[-2]
    if M >= min_rows:
        return a @ b
    return (padded(a, min_rows) @ b)[..., :M, :]


# Rows at which `pack_weight` checks that a packed product agrees with its longest one.
PROBE_ROWS = (MIN_ROWS, 5, 9, 17, 64, PACKED_ROWS)


def pack_weight(w: torch.Tensor) -> torch.Tensor | None:
    """w [N, K] in oneDNN's blocked layout, or None where packing is unavailable or the packed
    product would not give every row the same numbers for any number of rows from MIN_ROWS up."""
    if (
        w.device.type != "cpu"
        or w.dtype not in (torch.float32, torch.bfloat16)
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach())
        probe = torch.randn(
            max(PROBE_ROWS), w.shape[1], generator=torch.Generator().manual_seed(0)
        ).to(w.dtype)
        whole = _packed_product(probe, packed, None)
        rows = (_packed_product(probe[:m], packed, None) for m in PROBE_ROWS)
        if all(torch.equal(y, whole[: y.shape[0]]) for y in rows):
            return packed
    except RuntimeError:  # a build or CPU without these kernels
        pass
    return None


def _packed_product(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


def packed_rows(M: int, min_rows: int = MIN_ROWS) -> int:
    """The rows a packed product of M <= PACKED_ROWS rows runs with: at least `min_rows`, and
    above `BLAS_ROWS` the next multiple of it."""
    if M <= BLAS_ROWS:
        return max(M, min_rows)
    return -(-M // BLAS_ROWS) * BLAS_ROWS


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None, min_rows: int = MIN_ROWS
) -> torch.Tensor:
    """F.linear on [M, K] with a weight from `pack_weight`: in blocks of `PACKED_ROWS` rows,
    each padded to `packed_rows` of its own."""
    M = x.shape[-2]
    if M > PACKED_ROWS:
        blocks = x.split(PACKED_ROWS, dim=-2)
        return torch.cat([packed_linear(block, packed, b, min_rows) for block in blocks], dim=-2)
    rows = packed_rows(M, min_rows)
    if rows == M:
        return _packed_product(x.contiguous(), packed, b)
    return _packed_product(padded(x, rows), packed, b)[..., :M, :]


class Linear(nn.Linear):
    """nn.Linear through `stable_linear`, or `packed_linear` once packed."""

    row_stable = True  # see the module docstring
    packed: torch.Tensor | None = None  # set by pack(); not moved by .to()

    def pack(self) -> bool:
        """Hold the weight packed (see `pack_weight`) instead of plain; False if it stays plain."""
        packed = pack_weight(self.weight)
        if packed is None:
            return False
        self.packed = packed
        self.weight = None  # the plain copy is freed (unless another module shares it)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias, MIN_ROWS if self.row_stable else 1)
        return stable_linear(x, self.weight, self.bias, self.row_stable)
