"""A stage reads only its own tensors and shard files; bad checkpoints fail with one clear error."""

from __future__ import annotations

import json
import shutil

import pytest

from specpipe.transformer.checkpoint import SafetensorsCheckpoint, read_safetensors_header
from specpipe.transformer.errors import ModelError
from specpipe.transformer.layer_range import load_stage
from tests.model.conftest import N_LAYERS, write_gptoss


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A gpt-oss checkpoint saved in many small shards with an index."""
    path = write_gptoss(tmp_path_factory.mktemp("sharded") / "g", mxfp4=False, shard_size="60KB")
    assert (path / "model.safetensors.index.json").exists()
    return path


def _expected(path, start, end, first, last):
    """The index's own tensor names for a layer range: what the stage must read, no more."""
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    names = {n for n in weight_map if any(f"layers.{i}." in n for i in range(start, end))}
    if first:
        names.add("model.embed_tokens.weight")
    if last:
        names |= {"model.norm.weight", "lm_head.weight"}
    return names, {weight_map[n] for n in names}


@pytest.mark.parametrize("start,end", [(0, 1), (1, 3), (3, N_LAYERS), (0, N_LAYERS)])
def test_stage_reads_only_its_share(sharded, start, end):
    source = SafetensorsCheckpoint(sharded)
    load_stage(source, start, end)
    names, files = _expected(sharded, start, end, start == 0, end == N_LAYERS)
    want_bytes = sum(source.info(n)[2] for n in names)
    assert source.bytes_read == want_bytes
    assert source.files_opened == files
    all_files = set(
        json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values()
    )
    if (start, end) != (0, N_LAYERS):
        assert source.files_opened < all_files


def test_tied_head_reads_embedding_once(checkpoints):
    source = SafetensorsCheckpoint(checkpoints["qwen2"])
    stage = load_stage(source, 0, N_LAYERS, pack=False)
    assert stage.head.weight.data_ptr() == stage.embed.weight.data_ptr()
    tail_source = SafetensorsCheckpoint(checkpoints["qwen2"])
    tail = load_stage(tail_source, 2, N_LAYERS, pack=False)
    assert tail.embed is None and tail.head.weight.shape == (97, 64)


@pytest.mark.parametrize(
    "start,end,word", [(2, 2, "empty"), (3, 1, "reversed"), (0, N_LAYERS + 1, "out of range")]
)
def test_bad_layer_range(checkpoints, start, end, word):
    with pytest.raises(ModelError, match=word):
        load_stage(SafetensorsCheckpoint(checkpoints["llama"]), start, end)


def test_unknown_model_type(checkpoints, tmp_path):
    path = shutil.copytree(checkpoints["llama"], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "mamba"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="config.json: unknown model_type 'mamba'"):
        SafetensorsCheckpoint(path)


def test_missing_and_unreadable_files(checkpoints, tmp_path):
    with pytest.raises(ModelError, match="no such checkpoint directory"):
        SafetensorsCheckpoint(tmp_path / "nowhere")
    path = shutil.copytree(checkpoints["llama"], tmp_path / "m")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="config.json: not valid JSON"):
        SafetensorsCheckpoint(path)
    path = shutil.copytree(checkpoints["llama"], tmp_path / "n")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="no safetensors files"):
        SafetensorsCheckpoint(path)


@pytest.mark.parametrize("damage", ["length", "json", "truncated"])
def test_corrupted_safetensors_header(checkpoints, tmp_path, damage):
    path = shutil.copytree(checkpoints["llama"], tmp_path / "m")
    file = path / "model.safetensors"
    data = bytearray(file.read_bytes())
    if damage == "length":
        data[:8] = (10**12).to_bytes(8, "little")
    elif damage == "json":
        data[8:12] = b"\xff\xfe{["
    else:
        data = data[: len(data) // 2]
    file.write_bytes(bytes(data))
    with pytest.raises(ModelError, match="model.safetensors: corrupted safetensors header"):
        read_safetensors_header(file)
    with pytest.raises(ModelError, match="model.safetensors"):
        load_stage(SafetensorsCheckpoint(path), 0, N_LAYERS)


def test_wrong_shape_is_named(checkpoints, tmp_path):
    path = shutil.copytree(checkpoints["llama"], tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 80
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelError, match=r"mlp.gate_proj.weight \+ model.layers.0.mlp.up_proj.weight has shape"
    ):
        load_stage(SafetensorsCheckpoint(path), 0, 1)
