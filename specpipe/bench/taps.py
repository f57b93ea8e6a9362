"""What an EAGLE-3 head's taps add to a round on the wire, measured on sealed wire messages.

A round passes its hidden states [T, D] from stage to stage. With taps, each stage sends on the
hidden states and, after them, the states entering every tapped layer that it or a stage before
it holds (`specpipe/swarm/stage/onward.py`): the hop into a stage carries one more [T, D] block
for each tap below that stage's first layer, and the tail taps its own. `measure` seals real
round messages (header, AES-GCM-SIV, signature) for each hop of an even split, with and without
the taps, and reports the bytes per row, and at a link's bandwidth the milliseconds the taps
add to a decode round (`rows` rows) and to a prefill chunk of 512 rows.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

PREFILL_ROWS = 512


@dataclass(frozen=True)
class Shape:
    """A model as the ring splits it: its width, layers, stages, wire dtype and a head's taps."""

    name: str
    dim: int
    n_layers: int
    stages: int
    dtype: torch.dtype
    taps: tuple[int, ...]


def shapes() -> list[Shape]:
    """The default model on CPU stages (float32), and gpt-oss-120b as the reference run splits
    it, 4 × 9 layers, bf16, with the released heads' default taps."""
    from specpipe.drafting.eagle3 import default_taps
    from specpipe.transformer.resolve import open_checkpoint

    cfg = open_checkpoint("default").config
    return [
        Shape("default", cfg.dim, cfg.n_layers, 4, torch.float32, default_taps(cfg.n_layers)),
        Shape("gpt-oss-120b", 2880, 36, 4, torch.bfloat16, default_taps(36)),
    ]


def hop_blocks(shape: Shape) -> list[int]:
    """Per hop from stage i to stage i + 1: the tap blocks it carries after the hidden states."""
    from specpipe.transformer.resolve import even_split

    ranges = even_split(shape.n_layers, shape.stages)
    return [sum(1 for k in shape.taps if k < end) for _, end in ranges[:-1]]


def sealed_bytes(dim: int, rows: int, blocks: int, dtype: torch.dtype, taps: Sequence[int]) -> int:
    """The size of a sealed round message carrying [rows, (1 + blocks) x dim]."""
    from specpipe.swarm import wire

    message = wire.Message(
        kind="round",
        session="s",
        round_id=secrets.token_hex(16),
        seq=1,
        to="specpipe:s:stage:h",
        sender="h0",
        tokens=tuple(range(rows)),
        tensor=torch.zeros(rows, (1 + blocks) * dim, dtype=dtype),
        taps=tuple(taps),
    )
    return len(wire.encode(message, "s", secrets.token_bytes(32)))


def measure(shape: Shape, rows: int = 5, mbit_s: float = 100.0) -> dict:
    """Bytes per row and per round on the ring's hops, with and without taps, and the time the
    taps add at `mbit_s`."""
    blocks = hop_blocks(shape)
    per_hop = []
    for blocks_here in blocks:
        plain = sealed_bytes(shape.dim, rows, 0, shape.dtype, ())
        tapped = sealed_bytes(shape.dim, rows, blocks_here, shape.dtype, shape.taps)
        per_hop.append({"tap_blocks": blocks_here, "plain_bytes": plain, "tapped_bytes": tapped})
    plain_round = sum(h["plain_bytes"] for h in per_hop)
    tapped_round = sum(h["tapped_bytes"] for h in per_hop)
    extra_per_row = (tapped_round - plain_round) / rows
    element = torch.empty((), dtype=shape.dtype).element_size()

    def ms(n_bytes: float) -> float:
        return round(n_bytes * 8 / (mbit_s * 1e6) * 1000, 3)

    return {
        "model": shape.name,
        "dim": shape.dim,
        "dtype": str(shape.dtype).removeprefix("torch."),
        "taps": list(shape.taps),
        "tap_bytes_per_row": shape.dim * element,
        "rows": rows,
        "hops": per_hop,
        "round_bytes_plain": plain_round,
        "round_bytes_tapped": tapped_round,
        "extra_bytes_per_row": round(extra_per_row, 1),
        "mbit_s": mbit_s,
        "extra_ms_per_round": ms(extra_per_row * rows),
        "extra_ms_per_prefill_chunk": ms(extra_per_row * PREFILL_ROWS),
    }


def report(results: Sequence[dict]) -> list[str]:
    lines = []
    for r in results:
        lines.append(
            f"{r['model']}: D {r['dim']} {r['dtype']}, taps {r['taps']}: one tap is "
            f"{r['tap_bytes_per_row']} bytes a row"
        )
        for i, hop in enumerate(r["hops"]):
            lines.append(
                f"  hop {i} -> {i + 1}: {hop['tap_blocks']} tap block(s); {r['rows']} rows "
                f"{hop['plain_bytes']} bytes plain, {hop['tapped_bytes']} with taps"
            )
        lines.append(
            f"  a round of {r['rows']} rows: {r['round_bytes_plain']} -> "
            f"{r['round_bytes_tapped']} bytes ({r['extra_bytes_per_row']} more a row); at "
            f"{r['mbit_s']:g} Mbit/s the taps add {r['extra_ms_per_round']} ms a round, "
            f"{r['extra_ms_per_prefill_chunk']} ms a {PREFILL_ROWS}-row prefill chunk"
        )
    return lines
