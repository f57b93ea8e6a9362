"""gpt-oss-120b's stages on one GPU, weights drawn in place: what `benchmarks/gpu_check.sh` runs.

    python -m specpipe.bench.gpu_check --device cuda --json gpu_check.json

1. One 9-layer stage (layers 9:18) at the real shapes, bf16, experts packed in MXFP4: its
   forward time for 1 … 16 rows of one session, and for 1 … 8 sessions of 5 rows each (a
   verify of 4 drafts) in one batched forward.
2. The 36 layers as four stages on the one GPU, each followed by the reference run's one-way
   link delay (11, 8, 3.4 and 19 ms): plain greedy decoding's tok/s beside the reference run's
   4.6 and the latency ceiling, 1000 / (the links' delays + the four forwards measured in the
   run), and the share of the ceiling reached.

The weights are `specpipe.transformer.synth`'s random ones, made on the device
(`SynthSource`), so the check needs no 61 GiB of files. On a CPU it runs too (`--device
cpu`, slowly), which is how the suite checks it, at tiny sizes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence

import torch

from specpipe.bench.reference import LINKS_MS, REFERENCE_TOK_S
from specpipe.core.ring import Request
from specpipe.core.sampling import SamplingParams
from specpipe.decoding.generation import Generation
from specpipe.decoding.local_ring import LocalRing
from specpipe.transformer.layer_range import StageModel, load_stage
from specpipe.transformer.synth import SynthSource

CONTEXT = 64  # positions already cached when a forward is timed
ROWS = (1, 2, 4, 8, 16)
SESSIONS = (1, 2, 4, 8)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(stage: StageModel, run, repeats: int) -> float:
    """Median milliseconds of `run()` over `repeats`, after one warm-up."""
    samples = []
    for _ in range(repeats + 1):
        _sync(stage.device)
        started = time.perf_counter()
        run()
        _sync(stage.device)
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples[1:])


def stage_forward_times(
    source: SynthSource,
    start: int,
    end: int,
    rows: Sequence[int] = ROWS,
    sessions: Sequence[int] = SESSIONS,
    repeats: int = 5,
) -> dict:
    """One stage's forward: milliseconds per row count (one session), and per session count
    (5 rows each, batched), each at `CONTEXT` cached positions."""
    started = time.perf_counter()
    stage = load_stage(source, start, end, dtype="bfloat16", device=source.device)
    _sync(stage.device)
    load_s = time.perf_counter() - started
    g = torch.Generator(device=stage.device).manual_seed(0)
    dim = stage.cfg.dim
    hidden = torch.randn(CONTEXT + 16, dim, generator=g, device=stage.device).to(stage.dtype)
    names = [f"s{i}" for i in range(max(sessions))]
    for name in names:
        stage.forward(name, hidden[:CONTEXT], 0)

    def rows_run(n: int):
        return lambda: stage.forward(names[0], hidden[CONTEXT : CONTEXT + n], CONTEXT)

    def sessions_run(n: int):
        batch = [Request(name, hidden[CONTEXT : CONTEXT + 5], CONTEXT) for name in names[:n]]
        return lambda: stage.forward_many(batch)

    by_rows = {n: round(_timed(stage, rows_run(n), repeats), 3) for n in rows}
    by_sessions = {n: round(_timed(stage, sessions_run(n), repeats), 3) for n in sessions}
    return {
        "layers": [start, end],
        "load_s": round(load_s, 2),
        "rows_ms": by_rows,
        "sessions_of_5_rows_ms": by_sessions,
    }


class LinkedStage:
    """A stage followed by a link of `delay_ms` one way: its forward, then the wait (a test
    double of the WAN, in this check only). Times its forwards."""

    def __init__(self, stage: StageModel, delay_ms: float) -> None:
        self.stage, self.delay_s = stage, delay_ms / 1000
        self.first, self.last = stage.first, stage.last
        self.forward_ms: list[float] = []

    def forward(self, session, inputs, start_pos, last_rows=None):
        _sync(self.stage.device)
        started = time.perf_counter()
        out = self.stage.forward(session, inputs, start_pos, last_rows)
        _sync(self.stage.device)
        self.forward_ms.append((time.perf_counter() - started) * 1000)
        time.sleep(self.delay_s)
        return out

    def drop(self, session: str) -> None:
        self.stage.drop(session)

    def held_tokens(self) -> dict[str, int]:
        return self.stage.held_tokens()


def ring_at_reference_delays(
    source: SynthSource, tokens: int = 32, links_ms: Sequence[float] = LINKS_MS
) -> dict:
    """The model as four stages on one device, each link delayed as the reference run's: plain
    greedy tok/s against the latency ceiling of the links and the measured forwards."""
    n = source.config.n_layers
    bounds = [(i * n // 4, (i + 1) * n // 4) for i in range(4)]
    started = time.perf_counter()
    stages = [
        LinkedStage(load_stage(source, a, b, dtype="bfloat16", device=source.device), delay)
        for (a, b), delay in zip(bounds, links_ms, strict=True)
    ]
    load_s = time.perf_counter() - started
    ring = LocalRing(stages)
    prompt = [(1000 + i) % source.config.vocab_size for i in range(16)]
    warm = Generation(ring, "warm", prompt, SamplingParams(temp=0.0), max_new_tokens=4, draft_k=0)
    warm.run()
    ring.drop("warm")
    for stage in stages:
        stage.forward_ms.clear()
    gen = Generation(
        ring, "timed", prompt, SamplingParams(temp=0.0), max_new_tokens=tokens, draft_k=0
    )
    started = time.perf_counter()
    out = gen.run()
    elapsed = time.perf_counter() - started
    # The steps after the prompt's: one row each through every stage.
    step_ms = [statistics.median(s.forward_ms[1:]) for s in stages]
    ceiling = 1000 / (sum(links_ms) + sum(step_ms))
    tok_s = len(out) / elapsed
    return {
        "stages": [list(b) for b in bounds],
        "load_s": round(load_s, 2),
        "links_ms": list(links_ms),
        "step_forward_ms": [round(ms, 3) for ms in step_ms],
        "tokens": len(out),
        "tok_s": round(tok_s, 3),
        "ceiling_tok_s": round(ceiling, 3),
        "of_ceiling": round(tok_s / ceiling, 3),
        "reference_tok_s": REFERENCE_TOK_S,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--like", default="gpt-oss-120b")
    parser.add_argument("--stage", default="9:18", help="the stage timed alone, A:B")
    parser.add_argument("--tokens", type=int, default=32, help="tokens the ring generates")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    source = SynthSource(args.like, device)
    start, end = (int(x) for x in args.stage.split(":"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.like} on {name}", flush=True)
    stage = stage_forward_times(source, start, end, repeats=args.repeats)
    print(
        f"stage {start}:{end}: loaded in {stage['load_s']} s; forward ms by rows "
        f"{stage['rows_ms']}, by sessions of 5 rows {stage['sessions_of_5_rows_ms']}",
        flush=True,
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ring = ring_at_reference_delays(source, args.tokens)
    print(
        f"four stages, links {ring['links_ms']} ms: {ring['tok_s']} tok/s plain, ceiling "
        f"{ring['ceiling_tok_s']} ({ring['of_ceiling']:.0%}); forwards {ring['step_forward_ms']}"
        f" ms; the reference run: {REFERENCE_TOK_S} tok/s",
        flush=True,
    )
    result = {"device": name, "model": args.like, "stage": stage, "ring": ring}
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
