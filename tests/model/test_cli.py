"""`specpipe model info` and `specpipe generate --local` through click's test runner."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from click.testing import CliRunner

from specpipe.cli import cli
from specpipe.transformer.resolve import default_model_path
from tests.model.test_tokenizer import _write_tokenizer


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_model_info_default_json():
    from gguf import GGUFReader

    result = invoke("model", "info", "default", "--json", "--stages", "4")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    reader = GGUFReader(default_model_path())
    assert info["architecture"] == "llama" and info["layers"] == 30
    assert info["parameters"] == sum(int(t.n_elements) for t in reader.tensors)
    assert info["bytes"] == sum(int(t.n_bytes) for t in reader.tensors)
    assert [s["layers"] for s in info["stages"]] == [[0, 8], [8, 16], [16, 23], [23, 30]]
    # The tied embedding is held by both the first stage and the tail.
    embed = next(int(t.n_bytes) for t in reader.tensors if t.name == "token_embd.weight")
    assert sum(s["bytes"] for s in info["stages"]) == info["bytes"] + embed


def test_model_info_checkpoint_counts_parameters_like_transformers(checkpoints):
    import transformers

    from tests.model.conftest import reference

    for name in ("llama", "qwen2", "gptoss", "gptoss-mxfp4"):
        result = invoke("model", "info", str(checkpoints[name]), "--json", "--stages", "3")
        info = json.loads(result.stdout)
        model = transformers.AutoModelForCausalLM.from_pretrained(reference(checkpoints[name]))
        assert info["parameters"] == model.num_parameters(), name
        assert [s["layers"] for s in info["stages"]] == [[0, 2], [2, 3], [3, 4]]


def test_model_info_text():
    result = invoke("model", "info", "default", "--stages", "2")
    assert result.exit_code == 0
    assert "architecture llama, 30 layers" in result.output
    assert "stage 1: layers [15, 30)" in result.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["model", "info", "/no/such/model"], "/no/such/model: no such file or directory"),
        (["generate", "--local", "hi", "--model", "/no/such/model"], "no such file or directory"),
    ],
)
def test_bad_model_is_one_line_exit_2(args, message):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_generate_needs_a_tokenizer_that_fits(checkpoints, tmp_path):
    import shutil

    path = shutil.copytree(checkpoints["llama"], tmp_path / "m")
    result = CliRunner().invoke(cli, ["generate", "--local", "hi", "--model", str(path)])
    assert result.exit_code == 2 and "tokenizer.json: no such file" in result.output
    _write_tokenizer(path, 150)
    result = CliRunner().invoke(cli, ["generate", "--local", "hi", "--model", str(path)])
    assert result.exit_code == 2 and "tokenizer has 150 tokens" in result.output


def test_generate_tiny_checkpoint_spec_equals_plain(checkpoints, tmp_path):
    """Sampled at temp 1: speculative and plain commit the same tokens, and --json is complete."""
    import shutil

    path = shutil.copytree(checkpoints["gptoss"], tmp_path / "g")
    _write_tokenizer(path, 90)
    common = ["generate", "--local", "hello world", "--model", str(path), "--json", "--temp", "1"]
    common += ["--seed", "7", "--max-new-tokens", "30", "--stages", "2"]
    spec = json.loads(invoke(*common, "--draft-k", "4").output)
    plain = json.loads(invoke(*common, "--no-spec").output)
    assert spec["tokens"] == plain["tokens"] and len(spec["tokens"]) > 0
    assert json.loads(invoke(*common, "--draft-k", "0").output)["rounds"] == plain["rounds"]
    assert plain["rounds"] == len(plain["tokens"])
    fields = {"tokens", "text", "tok_s", "rounds", "tokens_per_round", "seed", "reasoning"}
    assert set(spec) == fields
    assert spec["tokens_per_round"] == pytest.approx(len(spec["tokens"]) / spec["rounds"], 1e-2)


@pytest.fixture(scope="module")
def tiny_and_head(tmp_path_factory):
    """The tiny test model (untied: a split tail needs stage 0's embedding table for a head) and
    an untrained draft head for it: its drafts are verified all the same."""
    import torch

    from specpipe.drafting.head import DraftHead
    from specpipe.transformer.resolve import model_label, open_checkpoint
    from tests.swarmprocs import write_tiny_model

    home = tmp_path_factory.mktemp("tiny")
    tiny = write_tiny_model(home / "tiny")
    cfg = open_checkpoint(tiny).config
    torch.manual_seed(0)
    head = home / "head.safetensors"
    DraftHead(cfg.dim, 32).save(
        head, {"model": model_label(tiny), "dim": cfg.dim, "vocab": cfg.vocab_size}
    )
    return tiny, head


@pytest.mark.parametrize("stages", ["1", "2"])
@pytest.mark.parametrize("temp", ["0", "0.7"])
def test_generate_local_runs_as_a_swarm_job_and_the_head_changes_no_token(
    tiny_and_head, monkeypatch, tmp_path, stages, temp
):
    """The tail holds the draft head shipped for the model (or --draft-head's), each round's
    draft length is chosen, and the tokens are those of plain decoding."""
    import shutil

    from specpipe.drafting import head as drafthead
    from specpipe.drafting.length import DraftLength

    tiny, head = tiny_and_head
    calls = Counter()

    def count(cls, name: str) -> None:
        method = getattr(cls, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            return method(*args, **kwargs)

        monkeypatch.setattr(cls, name, counted)

    count(drafthead.TailHead, "drafts_after")
    count(drafthead.TailHead, "draft_tree")
    count(DraftLength, "observe_cost")  # adaptive: every round's cost is measured
    common = [
        "generate",
        "--local",
        "hello world",
        "--model",
        str(tiny),
        "--json",
        "--temp",
        temp,
        "--seed",
        "3",
        "--max-new-tokens",
        "24",
        "--stages",
        stages,
    ]

    def run(*extra: str) -> tuple[list[int], Counter]:
        calls.clear()
        return json.loads(invoke(*common, *extra).output)["tokens"], Counter(calls)

    plain, _ = run("--no-spec")
    assert len(plain) == 24
    without, counts = run("--draft-k", "4", "--draft-head", "none")
    assert without == plain and counts["draft_tree"] == 0 and counts["observe_cost"] > 0
    # A model the package ships no head for runs without one.
    unshipped, counts = run("--draft-k", "4")
    assert unshipped == plain and counts["draft_tree"] == 0
    # With a head, it proposes the trees a job's rounds carry (chains are trees of one branch).
    given, counts = run("--draft-k", "4", "--draft-head", str(head))
    assert given == plain and counts["draft_tree"] > 0 and counts["drafts_after"] == 0
    shipped = tmp_path / "drafters"
    shipped.mkdir()
    shutil.copy(head, shipped / f"{tiny.name}.safetensors")
    monkeypatch.setattr(drafthead, "SHIPPED", shipped)
    by_default, counts = run("--draft-k", "4")
    assert by_default == plain and counts["draft_tree"] > 0


def test_generate_local_refuses_a_head_for_another_model(tiny_and_head, tmp_path):
    import shutil

    tiny, head = tiny_and_head
    other = shutil.copytree(tiny, tmp_path / "other")
    result = CliRunner().invoke(
        cli, ["generate", "--local", "hi", "--model", str(other), "--draft-head", str(head)]
    )
    assert result.exit_code == 2 and "the head was trained for model 'tiny'" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_generate_without_local_needs_a_running_swarm(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECPIPE_HOME", str(tmp_path))
    monkeypatch.setenv("SPECPIPE_SWARM", "nobody-runs-this-swarm")
    result = CliRunner().invoke(cli, ["generate", "hi"])
    assert result.exit_code == 1 and "no swarm running" in result.output
    assert len(result.output.strip().splitlines()) == 1
    result = CliRunner().invoke(cli, ["generate", "hi", "--raw"])  # raw prompts run there too
    assert result.exit_code == 1 and "no swarm running" in result.output
    result = CliRunner().invoke(cli, ["generate", "hi", "--draft-head", "none"])
    assert result.exit_code == 2 and "--draft-head needs --local" in result.output


def test_generate_default_streams_and_reports():
    result = invoke(
        "generate",
        "--local",
        "What is the capital of France?",
        "--max-new-tokens",
        "8",
        "--temp",
        "0",
    )
    assert result.exit_code == 0
    assert "Paris" in result.output
    assert "tok/s" in result.output and "tokens per round" in result.output


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--temp", "-1"], "Invalid value"),
        (["--top-p", "0"], "Invalid value"),
        (["--top-k", "-2"], "Invalid value"),
        (["--draft-k", "-1"], "--draft-k must be between 0 (no speculation) and 32"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be between 1 and 4096"),
    ],
)
def test_generate_refuses_bad_sampling_options(option, message):
    result = CliRunner().invoke(cli, ["generate", "--local", "hi", *option])
    assert result.exit_code == 2 and message in result.output


def test_generate_local_stop_cuts_the_text_streamed_and_in_json(checkpoints, tmp_path):
    import shutil

    from specpipe.transformer.resolve import load_tokenizer, open_checkpoint

    path = shutil.copytree(checkpoints["gptoss"], tmp_path / "g")
    _write_tokenizer(path, 90)
    common = ["generate", "--local", "hello world", "--model", str(path), "--temp", "1"]
    common += ["--seed", "7", "--max-new-tokens", "30", "--stages", "2"]
    full = json.loads(invoke(*common, "--json", "--no-spec").output)
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 6]  # spans a word boundary: several tokens
    want = text[: text.index(stop)]
    plain = json.loads(invoke(*common, "--json", "--no-spec", "--stop", stop).output)
    spec = json.loads(invoke(*common, "--json", "--draft-k", "4", "--stop", stop).output)
    assert plain["text"] == spec["text"] == want and stop not in want
    n = len(plain["tokens"])
    assert plain["tokens"] == full["tokens"][:n] and n < len(full["tokens"])
    decode = load_tokenizer(open_checkpoint(path)).decode
    assert stop in decode(plain["tokens"]) and stop not in decode(plain["tokens"][:-1])
    assert spec["tokens"] == full["tokens"][: len(spec["tokens"])] and len(spec["tokens"]) >= n
    # Streamed, the text never shows the start of a stop string it later cuts away.
    streamed = CliRunner().invoke(cli, [*common, "--no-spec", "--stop", stop, "--stop", "zzz"])
    assert streamed.exit_code == 0 and streamed.stdout == want + "\n"


@pytest.mark.parametrize(
    ("stops", "message"),
    [
        ([""], "--stop must not contain an empty string"),
        (["a", "b", "c", "d", "e"], "--stop must be at most 4 strings, not 5"),
        (["x" * 65], "--stop must each be at most 64 characters"),
    ],
)
@pytest.mark.parametrize("where", [["--local"], []], ids=["local", "swarm"])
def test_generate_refuses_bad_stop_strings_in_one_line(stops, message, where):
    args = ["generate", *where, "hi"]
    for stop in stops:
        args += ["--stop", stop]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and message in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--draft-k", "33"], "--draft-k must be between 0 (no speculation) and 32"),
        (["--max-new-tokens", "5000"], "--max-new-tokens must be between 1 and 4096"),
    ],
)
@pytest.mark.parametrize("where", [["--local"], []], ids=["local", "swarm"])
def test_generate_meets_the_web_apps_limits_before_anything_runs(
    monkeypatch, option, message, where
):
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # nothing may be reached
    result = CliRunner().invoke(cli, ["generate", *where, "hi", *option])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"Error: {message}"
