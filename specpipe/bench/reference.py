"""A cost model of the reference deployment, and the tok/s it predicts.

The reference run: gpt-oss-120b, 4 × 9 layers on four hosts in four US states, the ring
WA → MN → NC → NJ → back to WA (where the coordinator runs), one way 11, 8, 3.4 and 19 ms, at
about 4.6 tok/s. A round passes every stage once, so, as `bench wan` measures it on a live ring
(`inventory.RingLatency`), its time is the sum over the hops of the stage's forward at the
round's rows, its handling (checking, decoding, signing, sending on) and its link onward; a
round commits `tokens_per_round` tokens, so tok/s = tokens_per_round × 1000 / ring ms.

The forward of a stage comes from a GPU's measurement when given (`forward_ms`), else from this
machine: one layer of gpt-oss-120b at its real shapes (`specpipe.transformer.synth`, random
weights), loaded as a stage, its forward timed at each row count and multiplied by the
stage's 9 layers (every layer has the same shapes; at short contexts full and sliding
attention cost the same).
The handling per hop is `bench ring`'s measurement on this machine. With a bandwidth
(`mbit_s`), each link onward also takes the time its sealed round message takes to send: the
round's hidden states and, for an EAGLE-3 head's mode, the tap blocks the hop carries
(`bench.taps`); the tail's reply is a few tokens and counts nothing. The prediction is put
beside the reference run's 4.6 tok/s and the links' ceiling (1 token per round, free compute).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

HOSTS = ("WA", "MN", "NC", "NJ")
LINKS_MS = (11.0, 8.0, 3.4, 19.0)  # one way: WA → MN, MN → NC, NC → NJ, NJ → WA
LAYERS_PER_STAGE = 9
REFERENCE_TOK_S = 4.6
HANDLING_MS = 2.0  # per hop: `bench ring`'s overhead per hop on a 2-vCPU machine (1.9 to 2.0 ms)
CONTEXT = 64  # positions in the cache when a round is timed
DIM = 2880  # gpt-oss-120b's hidden size: a row of a round's hidden states
# Published EAGLE-3 heads for gpt-oss-120b: mean accepted length (tokens a round commits).
EAGLE3_TOKENS_PER_ROUND = 2.41  # specdrift's head at temp 0.7, chains of 3 drafts
EAGLE3_DRAFTS = 3


@dataclass(frozen=True)
class Mode:
    """A way of decoding: the tokens a round commits and the rows each stage runs for it."""

    name: str
    tokens_per_round: float
    rows: int
    taps: tuple[int, ...] = ()  # the layers an EAGLE-3 head taps: their states ride the round


def predict(
    forward_ms: Mapping[int, float],
    modes: Sequence[Mode],
    links_ms: Sequence[float] = LINKS_MS,
    handling_ms: float = HANDLING_MS,
    mbit_s: float | None = None,
) -> dict:
    """Each mode's ring time and tok/s, with one stage's forward `forward_ms[rows]` on every
    hop and, at `mbit_s`, each link's message bytes; where the time of a round goes; the
    links' ceiling and the reference run's tok/s."""
    from specpipe.swarm.inventory import HopLatency, RingLatency

    rows = []
    for mode in modes:
        sending = sending_ms(mode, mbit_s) if mbit_s else [0.0] * len(HOSTS)
        ring = RingLatency(
            [
                HopLatency(
                    host,
                    HOSTS[(i + 1) % len(HOSTS)],
                    forward_ms[mode.rows],
                    handling_ms,
                    link + sending[i],
                )
                for i, (host, link) in enumerate(zip(HOSTS, links_ms, strict=True))
            ]
        )
        tok_s = ring.ceiling_tok_s(mode.tokens_per_round)
        rows.append(
            {
                "mode": mode.name,
                "tokens_per_round": mode.tokens_per_round,
                "rows": mode.rows,
                "ring_ms": round(ring.ring_ms, 2),
                "forward_ms": round(sum(h.forward_ms for h in ring.hops), 2),
                "handling_ms": round(sum(h.handling_ms for h in ring.hops), 2),
                "link_ms": round(sum(h.link_ms for h in ring.hops), 2),
                "sending_ms": round(sum(sending), 2),
                "tok_s": round(tok_s, 3),
                "of_reference": round(tok_s / REFERENCE_TOK_S, 3),
            }
        )
    return {
        "links_ms": list(links_ms),
        "mbit_s": mbit_s,
        "links_ceiling_tok_s": round(1000 / sum(links_ms), 2),
        "reference_tok_s": REFERENCE_TOK_S,
        "modes": rows,
    }


def interpolated(forward_ms: Mapping[int, float], rows: Sequence[int]) -> dict[int, float]:
    """The forward's time at each of `rows`, on the line between the two nearest row counts
    given around it in `forward_ms` (rows -> ms)."""
    known = sorted(forward_ms)
    times = {}
    for n in rows:
        below = max(r for r in known if r < n)
        above = min(r for r in known if r > n)
        share = (n - below) / (above - below)
        times[n] = forward_ms[below] + share * (forward_ms[above] - forward_ms[below])
    return times


def sending_ms(mode: Mode, mbit_s: float) -> list[float]:
    """Per hop, the milliseconds its sealed round message takes at `mbit_s`: the stages' hops
    carry the round's rows and the tap blocks below the next stage; the tail's reply nothing."""
    import torch

    from specpipe.bench.taps import Shape, hop_blocks, sealed_bytes

    shape = Shape(
        "gpt-oss-120b", DIM, LAYERS_PER_STAGE * len(HOSTS), len(HOSTS), torch.bfloat16, mode.taps
    )
    blocks = hop_blocks(shape) if mode.taps else [0] * (len(HOSTS) - 1)
    return [
        sealed_bytes(DIM, mode.rows, n, torch.bfloat16, mode.taps) * 8 / (mbit_s * 1e3)
        for n in blocks
    ] + [0.0]


def measure_layer_forward(
    rows: Sequence[int], like: str = "gpt-oss-120b", repeats: int = 3, dtype: str = "bfloat16"
) -> dict[int, float]:
    """Milliseconds of one real-shape layer's forward here, at each row count: the median of
    `repeats`, each a verify of that many rows after `CONTEXT` positions, rolled back after."""
    import shutil

    import torch

    from specpipe.transformer.layer_range import load_stage
    from specpipe.transformer.resolve import open_checkpoint
    from specpipe.transformer.synth import LIKE, synthesize

    middle = LIKE[like]["num_hidden_layers"] // 2 + 1  # a full-attention layer, no embedding
    root = Path(tempfile.mkdtemp(prefix="reference-"))
    try:
        synthesize(like, root / "layer", (middle, middle + 1))
        stage = load_stage(open_checkpoint(root / "layer"), middle, middle + 1, dtype=dtype)
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(CONTEXT + max(rows), stage.cfg.dim, generator=g).to(stage.dtype)
        stage.forward("timing", hidden[:CONTEXT], 0)
        times = {}
        for n in rows:
            samples = []
            for _ in range(repeats + 1):  # the first warms the experts it routes to
                started = time.perf_counter()
                stage.forward("timing", hidden[CONTEXT : CONTEXT + n], CONTEXT)
                samples.append((time.perf_counter() - started) * 1000)
            times[n] = statistics.median(samples[1:])
        return times
    finally:
        shutil.rmtree(root, ignore_errors=True)


def format_report(result: dict) -> list[str]:
    """The report's lines."""
    links = " + ".join(f"{d:g}" for d in result["links_ms"])
    sent = f" at {result['mbit_s']:g} Mbit/s" if result.get("mbit_s") else ""
    lines = [
        f"ring {' → '.join((*HOSTS, HOSTS[0]))}, links {links} = "
        f"{sum(result['links_ms']):g} ms one way{sent}; forward per stage from "
        f"{result['forward_from']}",
    ]
    for row in result["modes"]:
        sending = f" (sending {row['sending_ms']:.1f})" if row.get("sending_ms") else ""
        lines.append(
            f"{row['mode']:>6}: {row['tokens_per_round']:.2f} tokens/round, {row['rows']} rows: "
            f"ring {row['ring_ms']:.1f} ms = forwards {row['forward_ms']:.1f} + handling "
            f"{row['handling_ms']:.1f} + links {row['link_ms']:.1f}{sending} -> "
            f"{row['tok_s']:.2f} tok/s ({row['of_reference']:.2f}× the reference run's "
            f"{result['reference_tok_s']:g})"
        )
    lines.append(
        f"the links alone allow {result['links_ceiling_tok_s']:.1f} tok/s at 1 token per round"
    )
    return lines
