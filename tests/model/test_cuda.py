"""The same stages on a CUDA device (skipped where there is none)."""

from __future__ import annotations

import pytest
import torch

from specpipe.transformer.checkpoint import SafetensorsCheckpoint
from tests.model.conftest import hf_logits
from tests.model.helpers import load_split, run_split

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


@pytest.mark.parametrize("family", ["llama", "gptoss-mxfp4"])
def test_cuda_stages_match_transformers(checkpoints, family):
    ids = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(0))
    want = hf_logits(checkpoints[family], ids)
    stages = load_split(lambda: SafetensorsCheckpoint(checkpoints[family]), [2, 2], device="cuda")
    assert stages[0].device.type == "cuda"
    logits = run_split(stages, "s", ids, 0)
    assert logits.device.type == "cuda"
    torch.testing.assert_close(logits.cpu(), want, atol=1e-3, rtol=0)
    half = load_split(
        lambda: SafetensorsCheckpoint(checkpoints[family]), [4], device="cuda", dtype="bfloat16"
    )
    assert run_split(half, "s", ids, 0).isfinite().all()


@pytest.mark.parametrize("family", ["llama", "gptoss-mxfp4"])
def test_cuda_verify_rows_equal_single_steps_exactly(checkpoints, family):
    """Row stability on the GPU: spec == plain there rests on it as it does on the CPU."""
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(3))
    stages = load_split(lambda: SafetensorsCheckpoint(checkpoints[family]), [1, 3], device="cuda")
    run_split(stages, "one", ids[:3], 0)
    single = torch.cat([run_split(stages, "one", ids[p : p + 1], p) for p in range(3, 40)])
    run_split(stages, "many", ids[:3], 0)
    chunks = [run_split(stages, "many", ids[p : p + 9], p) for p in range(3, 40, 9)]
    assert torch.equal(torch.cat(chunks), single)
