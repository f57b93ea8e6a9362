"""The same stages on a CUDA device (skipped where there is none)."""

from __future__ import annotations

import pytest
import torch

from specpipe.model.checkpoint import SafetensorsCheckpoint
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
