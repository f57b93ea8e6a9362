"""`specpipe model synth`: checkpoints of gpt-oss's released layout with random weights.

The real sizes are checked from the tensor table alone (61 GiB would take minutes to write);
what is written is checked on a model of the same layout at tiny sizes: transformers' GptOss
takes its tensors by name and shape, and gives the logits our stages give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from specpipe.cli import cli
from specpipe.transformer import synth
from specpipe.transformer.checkpoint import SafetensorsCheckpoint
from specpipe.transformer.config import ModelConfig
from specpipe.transformer.errors import ModelError
from specpipe.transformer.layer_range import load_stage
from tests.harmony_checkpoint import tiny_like

transformers = pytest.importorskip("transformers")

GIB = 2**30


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(synth.LIKE, "tiny-oss", tiny_like())
    return "tiny-oss"


def test_gpt_oss_120b_has_the_released_size_shapes_and_dtypes():
    cfg = ModelConfig.from_hf(synth.LIKE["gpt-oss-120b"])
    specs = {s.name: s for s in synth.tensor_specs(cfg, 0, cfg.n_layers)}
    total = sum(s.nbytes for s in specs.values())
    assert 60.5 * GIB < total < 61.5 * GIB  # "about 61 GiB of safetensors"
    assert specs["model.embed_tokens.weight"].shape == (201088, 2880)
    assert specs["lm_head.weight"].shape == (201088, 2880)
    layer = "model.layers.35."
    assert specs[layer + "self_attn.q_proj.weight"].shape == (64 * 64, 2880)
    assert specs[layer + "self_attn.k_proj.weight"].shape == (8 * 64, 2880)
    assert specs[layer + "self_attn.sinks"].shape == (64,)
    assert specs[layer + "mlp.experts.gate_up_proj_blocks"].shape == (128, 5760, 90, 16)
    assert specs[layer + "mlp.experts.down_proj_scales"].shape == (128, 2880, 90)
    assert len(specs) == 3 + 36 * 19  # embedding, norm, head; 19 tensors a layer
    # A 9-layer middle stage: the experts are most of it, about 14.8 GiB of MXFP4.
    middle = sum(s.nbytes for s in synth.tensor_specs(cfg, 9, 18))
    assert 14 * GIB < middle < 15.5 * GIB
    assert cfg.n_layers == 36 and cfg.n_experts == 128 and cfg.experts_per_token == 4
    assert cfg.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert cfg.sliding_window == 128 and cfg.mxfp4 and cfg.rope_scaling["rope_type"] == "yarn"
    from specpipe.cli.options import RELEASED_LAYOUTS

    assert set(RELEASED_LAYOUTS) == set(synth.LIKE)  # what the commands offer is what is made
    small = ModelConfig.from_hf(synth.LIKE["gpt-oss-20b"])
    assert (small.n_layers, small.n_experts) == (24, 32)
    whole_20b = sum(s.nbytes for s in synth.tensor_specs(small, 0, 24))
    assert 12.5 * GIB < whole_20b < 13 * GIB  # its release: 13.8 GB


def test_a_synthesized_checkpoint_is_what_transformers_loads_and_our_stages_equal_it(
    tiny, tmp_path
):
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    made = synth.synthesize(tiny, tmp_path / "oss", shard_bytes=64 * 1024)
    assert made.shards > 1 and made.layers == (0, 4)
    index = json.loads((tmp_path / "oss" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == made.bytes
    # transformers' own model, its experts unpacked by transformers' own MXFP4 decoder: every
    # tensor must be taken by name and shape (strict), and none be left over.
    tensors = {}
    for file in sorted((tmp_path / "oss").glob("*.safetensors")):
        tensors.update(load_file(file))
    assert tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"].dtype == torch.uint8
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    state = {}
    for name, t in tensors.items():
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            state[base] = convert_moe_packed_tensors(
                t, tensors[base + "_scales"], dtype=torch.float32
            )
        elif not name.endswith("_scales"):
            state[name] = t.float()
    config = {k: v for k, v in tiny_like().items() if k != "quantization_config"}
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**config)).eval()
    model.load_state_dict(state, strict=True)
    ids = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids[None]).logits[0].float()
    checkpoint = SafetensorsCheckpoint(tmp_path / "oss")
    first, last = load_stage(checkpoint, 0, 2), load_stage(checkpoint, 2, 4)
    got = last.forward("s", first.forward("s", ids, 0), 0)
    assert want.abs().max() > 0.1  # not a comparison of near-zeros
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_range_holds_its_layers_alone_and_the_same_values_as_the_whole(tiny, tmp_path):
    whole = synth.synthesize(tiny, tmp_path / "whole", seed=3)
    part = synth.synthesize(tiny, tmp_path / "part", layers=(1, 3), seed=3)
    assert part.layers == (1, 3) and part.bytes < whole.bytes
    a, b = SafetensorsCheckpoint(whole.path), SafetensorsCheckpoint(part.path)
    names = set(b.names())
    assert {n for n in names if not n.startswith("model.layers.")} == set()
    assert {int(n.split(".")[2]) for n in names} == {1, 2}
    for name in names:
        assert torch.equal(a.read(name), b.read(name)), name
    stage = load_stage(b, 1, 3)  # a middle stage loads from it alone
    assert stage.forward("s", torch.randn(3, 64), 0).shape == (3, 64)
    tail = synth.synthesize(tiny, tmp_path / "tail", layers=(3, 4), embedding=True)
    assert "model.embed_tokens.weight" in SafetensorsCheckpoint(tail.path).names()
    other = synth.synthesize(tiny, tmp_path / "other", layers=(1, 3), seed=4)
    name = "model.layers.1.self_attn.q_proj.weight"
    assert not torch.equal(SafetensorsCheckpoint(other.path).read(name), b.read(name))


def test_bad_requests_are_refused_and_a_failed_write_leaves_nothing(tiny, tmp_path, monkeypatch):
    with pytest.raises(ModelError, match="unknown model 'gpt-oss-7b'"):
        synth.synthesize("gpt-oss-7b", tmp_path / "x")
    with pytest.raises(ModelError, match="not within 0:4"):
        synth.synthesize(tiny, tmp_path / "x", layers=(2, 9))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ModelError, match="not an empty directory"):
        synth.synthesize(tiny, tmp_path / "full")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    written = []

    def failing_save(tensors, path, metadata=None):
        if written:
            raise OSError(28, "No space left on device")
        written.append(path)
        path.write_bytes(b"part")

    monkeypatch.setattr(synth, "save_file", failing_save)
    with pytest.raises(OSError):
        synth.synthesize(tiny, tmp_path / "half", shard_bytes=64 * 1024)
    assert written and sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def test_the_command_writes_a_range_and_refuses_bad_input_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(synth.LIKE, "gpt-oss-20b", tiny_like())  # its layout, tiny sizes

    def run(*args):
        return CliRunner().invoke(cli, ["model", "synth", "--like", "gpt-oss-20b", *args])

    done = run("--layers", "3:4", "--with-embedding", str(tmp_path / "tail"))
    assert done.exit_code == 0, done.output
    assert done.output.startswith(f"wrote {tmp_path / 'tail'}: gpt-oss-20b layers 3:4, 22 tensors")
    names = SafetensorsCheckpoint(tmp_path / "tail").names()
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(names)
    for args, message in (
        (("--layers", "3:9"), "Error: layer range 3:9 is not within 0:4 of gpt-oss-20b"),
        (("--layers", "3:2"), "is empty or reversed: A must be below B"),
        (("--like", "llama-70b"), "'llama-70b' is not one of"),
        ((), "exists and is not an empty directory"),
    ):
        out = tmp_path / ("tail" if not args else "o")
        refused = run(*args, str(out))
        assert refused.exit_code == 2 and message in refused.output, refused.output
        assert "Traceback" not in refused.output
    assert not (tmp_path / "o").exists()


def test_bench_stage_memory_measures_each_range_and_its_room_on_a_card(tmp_path, monkeypatch):

    monkeypatch.setitem(synth.LIKE, "gpt-oss-20b", tiny_like())  # its layout, tiny sizes
    cfg = ModelConfig.from_hf(tiny_like())
    out = tmp_path / "report.json"
    argv = ["bench", "stage-memory", "--like", "gpt-oss-20b", "--layers", "1:3"]
    argv += ["--layers", "3:4", "--dir", str(tmp_path / "made"), "--json", str(out)]
    done = CliRunner().invoke(cli, argv)
    assert done.exit_code == 0, done.output
    middle, tail = json.loads(out.read_text())["stages"]
    # A middle stage holds its layers' tensors as stored: bf16, the experts packed in MXFP4.
    assert middle["resident_weight_bytes"] == sum(s.nbytes for s in synth.tensor_specs(cfg, 1, 3))
    assert (middle["embedding"], middle["head"], middle["draft_head"]) == (False, False, False)
    assert middle["dtype"] == "bfloat16" and middle["load_s"] > 0
    # Layer 1 attends over everything, layer 2 over a window of 4: K and V of 2 heads of 16.
    assert middle["kv_bytes_per_token"] == 2 * 2 * 16 * 2
    assert middle["kv_bytes_per_session_fixed"] == 2 * 2 * 16 * 2 * 4
    plan = middle["budget"]
    left = 24 * 2**30 - middle["resident_weight_bytes"] - 2**30
    assert plan["kv_budget_bytes"] == left
    assert plan["context_tokens_per_session"] == (left / 8 - 512) // 128
    # The tail holds its head and the draft head; the embedding table the draft head reads
    # stays in host memory, off the card.
    assert (tail["head"], tail["draft_head"]) == (True, True)
    table = cfg.vocab_size * cfg.dim * 2
    assert tail["host_weight_bytes"] == table
    assert tail["resident_weight_bytes"] > sum(s.nbytes for s in synth.tensor_specs(cfg, 3, 4))
    assert tail["resident_weight_bytes"] + table >= sum(
        s.nbytes for s in synth.tensor_specs(cfg, 3, 4, embedding=True)
    )
    assert middle["host_weight_bytes"] == 0
    assert "layers 3:4 + head + draft head (bfloat16)" in done.output
    assert "in host memory" in done.output
    assert "\nverdict PASS\n" in done.output
    assert not any((tmp_path / "made").iterdir())  # made, measured and removed
    # A card too small for the weights and the reserve: FAIL, exit 1.
    small = CliRunner().invoke(cli, [*argv[:6], "--card-gib", "1", "--reserve-gib", "1"])
    assert small.exit_code == 1 and "DOES NOT FIT" in small.output


def told_mode(report: Path, name: str) -> dict:
    return next(m for m in json.loads(report.read_text())["modes"] if m["mode"] == name)


def test_the_reference_cost_model_adds_up_a_round_and_measures_a_layer_when_not_told(
    tmp_path, monkeypatch
):
    from specpipe.bench import reference

    modes = [reference.Mode("plain", 1.0, 1), reference.Mode("spec", 2.0, 5)]
    result = reference.predict({1: 40.0, 5: 50.0}, modes, handling_ms=2.0)
    plain, spec = result["modes"]
    assert plain["ring_ms"] == 4 * 40 + 4 * 2 + 41.4 and spec["ring_ms"] == 4 * 50 + 8 + 41.4
    assert plain["tok_s"] == round(1000 / 209.4, 3) and spec["tok_s"] == round(2000 / 249.4, 3)
    assert result["links_ceiling_tok_s"] == round(1000 / 41.4, 2)
    assert plain["of_reference"] == round(plain["tok_s"] / 4.6, 3)
    out = tmp_path / "reference.json"
    told = CliRunner().invoke(
        cli,
        ["bench", "reference", "--forward-ms", "1=40,5=50", "--spec-tokens-per-round", "2"]
        + ["--handling-ms", "2", "--eagle3-drafts", "4", "--eagle3-tokens-per-round", "2"]
        + ["--mbit-s", "0", "--json", str(out)],
    )
    assert told.exit_code == 0, told.output
    plain_and_spec, eagle3 = json.loads(out.read_text())["modes"][:2], told_mode(out, "eagle3")
    assert plain_and_spec == result["modes"]
    assert "-> 8.02 tok/s" in told.output and "24.1 tok/s at 1 token per round" in told.output
    # Bytes free, the taps cost nothing: the EAGLE-3 round is today's round at the same rows.
    assert eagle3["ring_ms"] == spec["ring_ms"] and eagle3["sending_ms"] == 0
    # At a bandwidth each stage's hop sends its sealed message, the taps' blocks after the rows:
    # gpt-oss-120b's taps 2, 18, 33 ride 1, 1 and 2 of the three stage hops, 5,760 bytes a row
    # each (bf16), so 5 rows add 4 x 5 x 5,760 bytes, 1.84 ms at 100 Mbit/s.
    modes.append(reference.Mode("eagle3", 2.0, 5, (2, 18, 33)))
    sent = reference.predict({1: 40.0, 5: 50.0}, modes, handling_ms=2.0, mbit_s=100.0)
    plain, spec, eagle3 = sent["modes"]
    assert 3 * 5760 * 8 / 1e5 < plain["sending_ms"] < 3 * 6500 * 8 / 1e5  # and a header
    assert abs(eagle3["sending_ms"] - spec["sending_ms"] - 4 * 5 * 5760 * 8 / 1e5) < 0.01
    assert abs(eagle3["ring_ms"] - spec["ring_ms"] - 4 * 5 * 5760 * 8 / 1e5) < 0.02
    assert eagle3["tok_s"] < spec["tok_s"]  # the same tokens a round, a longer round
    # Rows between those given are on the line between them; rows past them: one line.
    between = CliRunner().invoke(
        cli, ["bench", "reference", "--forward-ms", "1=40,5=50", "--json", str(out)]
    )
    assert between.exit_code == 0 and "([4] rows interpolated)" in between.output
    assert told_mode(out, "eagle3")["forward_ms"] == 4 * 47.5
    short = CliRunner().invoke(cli, ["bench", "reference", "--forward-ms", "1=40,4=50"])
    assert short.exit_code == 2 and "no time for [5] rows" in short.output
    # Not told: one layer of the model's layout is made and timed here (tiny sizes in a test).
    monkeypatch.setitem(synth.LIKE, "gpt-oss-120b", tiny_like(n_layers=36))
    timed = CliRunner().invoke(cli, ["bench", "reference", "--draft-k", "2"])
    assert timed.exit_code == 0, timed.output
    assert "one real-shape layer timed here × 9: 1 row(s)" in timed.output
    assert "3 rows:" in timed.output and "eagle3: 2.41 tokens/round, 4 rows" in timed.output


def test_the_gpu_check_runs_its_stage_and_ring_here_on_the_cpu_at_tiny_sizes(tmp_path, monkeypatch):
    """What benchmarks/gpu_check.sh runs on a GPU, on the CPU with the layout at tiny sizes: the
    stage drawn in place holds what a synthesized checkpoint holds, and the ring reaches its
    latency ceiling's neighbourhood (the links' sleeps dominate)."""
    from specpipe.bench import gpu_check

    monkeypatch.setitem(synth.LIKE, "gpt-oss-120b", tiny_like(n_layers=36))
    made = synth.synthesize("gpt-oss-120b", tmp_path / "made", layers=(9, 18))
    from_files = load_stage(SafetensorsCheckpoint(made.path), 9, 18, dtype="bfloat16")
    in_place = load_stage(synth.SynthSource("gpt-oss-120b"), 9, 18, dtype="bfloat16")
    for (name, a), (_, b) in zip(
        from_files.state_dict().items(), in_place.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    out = tmp_path / "gpu_check.json"
    argv = ["--device", "cpu", "--tokens", "6", "--repeats", "1", "--json", str(out)]
    result = gpu_check.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert set(result["stage"]["rows_ms"]) == {1, 2, 4, 8, 16}
    assert set(result["stage"]["sessions_of_5_rows_ms"]) == {1, 2, 4, 8}
    ring = result["ring"]
    assert ring["stages"] == [[0, 9], [9, 18], [18, 27], [27, 36]] and ring["tokens"] == 6
    assert 0.5 < ring["of_ceiling"] < 1.2
    assert ring["ceiling_tok_s"] < 1000 / 41.4  # the links alone bound it


def test_bench_parity_compares_our_stages_with_transformers_on_a_cut_model(tmp_path, monkeypatch):
    """`bench parity` on the layout at tiny sizes: the model cut to its first layers, ours and
    transformers' logits within the tolerance, the same greedy tokens."""
    monkeypatch.setitem(synth.LIKE, "gpt-oss-20b", tiny_like(n_layers=4))
    out = tmp_path / "parity.json"
    argv = ["bench", "parity", "--n-layers", "2", "--tokens", "6", "--steps", "3"]
    done = CliRunner().invoke(cli, [*argv, "--json", str(out)])
    assert done.exit_code == 0, done.output
    result = json.loads(out.read_text())
    assert result["layers"] == 2 and result["verdict"] == "PASS"
    assert result["max_abs_diff"] <= 1e-4 and result["argmax_identical"]
    assert len(result["greedy_ours"]) == 3 and result["greedy_identical"]
    # The cut model is the layout's first layers with its embedding, norm and head.
    made = synth.synthesize("gpt-oss-20b", tmp_path / "cut", n_layers=2)
    names = set(SafetensorsCheckpoint(made.path).names())
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= names
    assert max(int(n.split(".")[2]) for n in names if n.startswith("model.layers.")) == 1
    with pytest.raises(ModelError, match="has 4 layers, not 5"):
        synth.synthesize("gpt-oss-20b", tmp_path / "none", n_layers=5)
