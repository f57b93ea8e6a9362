"""What one stage of a real-size model holds: gpt-oss-120b at its shapes, range by range.

For each layer range: make the range's checkpoint (`specpipe.transformer.synth`, random weights, the
release's layout), load it in a child process as a stage worker on a GPU would (bf16, MXFP4
experts kept packed, weights not packed for the CPU), the tail with its draft head, and measure:

- resident weights: the bytes of every tensor the stage holds, in the dtype it holds them;
- RSS after the load and its peak during the load, above the process's own before it;
- the load's wall time: the tensors are memory-mapped, so it reads little; then the time to
  read every weight byte once, as a copy to a GPU would (from the page cache, since the files
  were just written: a first read from disk takes longer);
- KV per token: full-attention layers grow by one position per token; sliding-window layers
  hold at most `sliding_window` positions per session, a fixed cost;
- on a card of `card_gib`: what is left for KV once the weights and a reserve for activations
  and the runtime are taken, and the context each of `sessions` sessions may hold in it.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

GIB = 2**30
RANGES = ((0, 9), (9, 18), (27, 36))  # stage 0 with the embedding, a middle one, the tail


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _unique_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a tied or borrowed one counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure_load(path: str, start: int, end: int, dtype: str, draft_head: bool) -> dict:
    """Load layers [start, end) of the checkpoint at `path` here and say what it holds."""
    from specpipe.drafting.head import DraftHead, load_with_head
    from specpipe.transformer.layer_range import load_stage
    from specpipe.transformer.resolve import model_label, open_checkpoint

    torch.set_num_threads(1)
    checkpoint = open_checkpoint(path)
    cfg = checkpoint.config
    with tempfile.TemporaryDirectory() as scratch:
        head_file = "none"
        if draft_head and end == cfg.n_layers:  # a head of the shipped kind, random
            head_file = str(Path(scratch) / "head.safetensors")
            meta = {"model": model_label(path), "dim": cfg.dim, "vocab": cfg.vocab_size}
            DraftHead(cfg.dim, cfg.dim).save(head_file, meta)
        base, peak_before = _rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        started = time.perf_counter()
        (stage,), head = load_with_head(
            lambda **options: [load_stage(checkpoint, start, end, dtype=dtype, **options)],
            head_file,
            model_label(path),
            checkpoint,
            pack=False,  # as on a GPU: packing for oneDNN is the CPU's own copy
        )
        load_s = time.perf_counter() - started
    held = list(stage.state_dict().values())
    host_held = []  # what a GPU tail keeps in host memory: its draft head's embedding table
    if head is not None:
        held += list(head.head.state_dict().values())
        held += [head.parts.head_weight]
        host_held += [head.parts.embed_weight]
    mapped_rss, peak = _rss() - base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # What a copy to a GPU reads: every byte once, a tensor at a time.
    started = time.perf_counter()
    for t in held + host_held:
        if t is not None:
            torch.empty_like(t).copy_(t)
    read_s = time.perf_counter() - started
    element = torch.empty((), dtype=stage.dtype).element_size()
    per_layer_token = 2 * cfg.n_kv_heads * cfg.head_dim * element  # K and V of one position
    windows = [cfg.window(i) for i in range(start, end)]
    return {
        "layers": [start, end],
        "dtype": str(stage.dtype).removeprefix("torch."),
        "embedding": stage.embed is not None,
        "head": stage.last,
        "draft_head": head is not None,
        "load_s": load_s,
        "read_s": read_s,
        "resident_weight_bytes": _unique_bytes(held),
        "host_weight_bytes": _unique_bytes(host_held),
        "rss_bytes": mapped_rss,
        "peak_rss_bytes": max(peak - max(base, peak_before), mapped_rss),
        "rss_after_read_bytes": _rss() - base,
        "full_attention_layers": sum(w is None for w in windows),
        "kv_bytes_per_token": per_layer_token * sum(w is None for w in windows),
        "kv_bytes_per_session_fixed": per_layer_token * sum(w for w in windows if w),
    }


def budget(row: dict, card_gib: float, reserve_gib: float, sessions: int) -> dict:
    """What a card of `card_gib` leaves for KV with this stage's weights and a reserve, and the
    context each of `sessions` sessions may hold in it."""
    left = card_gib * GIB - row["resident_weight_bytes"] - reserve_gib * GIB
    per_session = left / sessions - row["kv_bytes_per_session_fixed"]
    per_token = row["kv_bytes_per_token"]
    return {
        "card_gib": card_gib,
        "reserve_gib": reserve_gib,
        "kv_budget_bytes": int(left),
        "sessions": sessions,
        "context_tokens_per_session": int(per_session // per_token) if per_token else None,
        "fits": left > 0 and per_session > 0,
    }


def run(
    like: str = "gpt-oss-120b",
    ranges: tuple[tuple[int, int], ...] = RANGES,
    dtype: str = "bfloat16",
    card_gib: float = 24.0,
    reserve_gib: float = 1.0,
    sessions: int = 8,
    workdir: str | Path | None = None,
    keep: bool = False,
    progress=print,
) -> dict:
    """Make, load and measure each range in turn (each checkpoint removed after, unless
    `keep`); the report as a dict."""
    from specpipe.transformer import synth
    from specpipe.transformer.synth import synthesize

    root = Path(workdir or tempfile.mkdtemp(prefix="stage-memory-"))
    n_layers = synth.LIKE[like]["num_hidden_layers"]
    rows = []
    for start, end in ranges:
        path = root / f"{like}-{start}-{end}"
        began = time.perf_counter()
        if not (path / "config.json").exists():
            # The tail's draft head reads the embedding table too.
            made = synthesize(like, path, (start, end), embedding=end == n_layers)
            progress(
                f"made {path.name}: {made.bytes / GIB:.2f} GiB in {made.shards} shard(s) "
                f"in {time.perf_counter() - began:.0f} s"
            )
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "specpipe.bench.stage_memory",
                str(path),
                str(start),
                str(end),
                dtype,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode:
            raise RuntimeError(f"loading {path.name} failed: {done.stderr.strip()[-2000:]}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["budget"] = budget(row, card_gib, reserve_gib, sessions)
        rows.append(row)
        progress(format_row(row))
        if not keep:
            shutil.rmtree(path, ignore_errors=True)
    return {"model": like, "stages": rows}


def format_row(row: dict) -> str:
    """One line of the report for one stage."""
    a, b = row["layers"]
    parts = [f"layers {a}:{b}"]
    parts += ["+ embedding"] if row["embedding"] else []
    parts += ["+ head"] if row["head"] else []
    parts += ["+ draft head"] if row["draft_head"] else []
    plan, host = row["budget"], row["host_weight_bytes"]
    context = plan["context_tokens_per_session"]
    if not plan["fits"]:
        room = "DOES NOT FIT"
    elif context is None:  # sliding-window layers only: their caches stop growing
        room = f"any context for {plan['sessions']} sessions (windows only)"
    else:
        room = f"{context:,} tokens each for {plan['sessions']} sessions"
    return (
        f"{' '.join(parts)} ({row['dtype']}): "
        f"weights {row['resident_weight_bytes'] / GIB:.2f} GiB"
        + (f" (+ {row['host_weight_bytes'] / GIB:.2f} GiB in host memory), " if host else ", ")
        + f"RSS {row['rss_bytes'] / GIB:.2f} GiB mapped (peak {row['peak_rss_bytes'] / GIB:.2f}), "
        f"load {row['load_s']:.1f} s, every byte read once {row['read_s']:.1f} s; "
        f"KV {row['kv_bytes_per_token'] / 1024:.0f} KiB/token "
        f"+ {row['kv_bytes_per_session_fixed'] / 2**20:.1f} MiB/session (windows); "
        f"on {plan['card_gib']:g} GiB with {plan['reserve_gib']:g} GiB reserved: "
        f"{plan['kv_budget_bytes'] / GIB:.2f} GiB for KV, {room}"
    )


if __name__ == "__main__":  # the child: load one range, print its row as JSON
    path, start, end, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    print(json.dumps(measure_load(path, start, end, dtype, draft_head=True)))
