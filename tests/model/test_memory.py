"""Memory: sizes from the real gpt-oss-120b configuration, built on the meta device (no weights),
and what a stage process of the default model keeps resident."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specpipe.transformer import synth
from specpipe.transformer.config import ModelConfig
from specpipe.transformer.layer_range import StageModel
from specpipe.transformer.resolve import even_split

GPT_OSS_120B = synth.LIKE["gpt-oss-120b"]  # the published config.json


def _bytes(model: StageModel, dtype: torch.dtype) -> int:
    """Resident bytes with float tensors in `dtype` (packed MXFP4 stays uint8)."""
    size = torch.finfo(dtype).bits // 8
    return sum(
        t.numel() * (size if t.is_floating_point() else t.element_size())
        for t in [*model.parameters(), *model.buffers()]
    )


def test_nine_layer_gpt_oss_120b_stage_fits_24_gb_only_packed():
    cfg = ModelConfig.from_hf(GPT_OSS_120B)
    assert cfg.mxfp4 and cfg.window(0) == 128 and cfg.window(1) is None
    gib = 2**30
    for start, end in even_split(cfg.n_layers, 4):
        assert end - start == 9
        with torch.device("meta"):
            packed = StageModel(cfg, start, end, packed_experts=True)
            unpacked = StageModel(cfg, start, end, packed_experts=False)
        assert _bytes(packed, torch.bfloat16) < 20 * gib  # room left for the KV cache
        assert _bytes(unpacked, torch.bfloat16) > 24 * gib


# Prepended to the code `_anonymous_mb` runs: anon() is the process's anonymous memory in MB.
ANON = """
import json
def anon():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) / 1024
"""


def _anonymous_mb(code: str) -> dict[str, float]:
    """Run `code` in a fresh interpreter; it prints a JSON map of labels to anonymous MB."""
    out = subprocess.run(
        [sys.executable, "-c", ANON + code], capture_output=True, text=True, check=True, timeout=300
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc")
def test_a_stage_process_keeps_its_weights_not_the_parse_of_the_gguf_file():
    got = _anonymous_mb("""
import gc, torch
from specpipe.transformer.resolve import open_checkpoint
from specpipe.transformer.layer_range import load_stage
from specpipe.swarm.stage.worker import release_load_memory
base = anon()
stage = load_stage(open_checkpoint("default"), 8, 15)
gc.collect()
loaded = anon()
release_load_memory()
print(json.dumps({"loaded": loaded - base, "released": anon() - base}))
""")
    # Seven layers of the default model are 99 MB of float32 weights, and the file's metadata
    # (its 49k-token vocabulary) some 80 MB as Python values. Keeping the GGUF reader as well
    # (a numpy view per vocabulary string) made 380 MB; the loader's freed heap is ~45 MB.
    assert got["loaded"] < 300, got
    assert got["released"] < got["loaded"] - 10, got


SERVE_MANY_SHAPES = """
import os, torch
from specpipe.transformer.resolve import open_checkpoint
from specpipe.transformer.layer_range import load_stage
from specpipe.transformer import heap
from specpipe.swarm.stage.worker import release_load_memory
torch.set_num_threads(1)
stage = load_stage(open_checkpoint("default"), 8, 15)
release_load_memory()
def serve(length):  # a prompt, a few rounds, the end of the session
    stage.forward("s", torch.randn(length, stage.cfg.dim), 0)
    for pos in range(length, length + 8, 4):
        stage.forward("s", torch.randn(4, stage.cfg.dim), pos)
    stage.drop("s")
for length in range(8, 264, 16):
    serve(length)
heap.trim()  # what ended sessions freed goes back, as a stage worker's housekeeping does
before = anon()
for length in range(266, 620, 18):  # lengths not seen before
    serve(length)
heap.trim()
print(json.dumps({"grown": anon() - before}))
"""


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc")
def test_a_stage_serving_prompts_of_ever_new_lengths_stops_growing():
    # oneDNN keeps a kernel and its memory for each shape a product ran: when a packed weight
    # ran every prompt's length as it came, these 20 prompts added some 90 MB. Both ends are
    # measured after a heap trim: what glibc merely kept of freed sessions (it varied by tens of
    # MB from run to run) is not what this is about, and a stage worker trims it anyway.
    got = _anonymous_mb(SERVE_MANY_SHAPES)
    assert got["grown"] < 40, got
