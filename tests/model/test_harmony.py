"""Harmony, gpt-oss's chat format: a reply split into its channels and its calls of functions,
whole or as it is written; the test checkpoint's tokenizer is gpt-oss's own (o200k, checked
against its ranks by brute force), and the checkpoint opens as a harmony model; a chat template
renders function tools, calls and their results as transformers renders them (and as OpenAI's
harmony library does: test_harmony_reference)."""

from __future__ import annotations

import datetime

import pytest

from specpipe.decoding.target import open_target
from specpipe.transformer.harmony import Reply, ToolCall, speaks_harmony, split_reply
from tests.harmony_checkpoint import (
    HISTORY,
    NOW,
    SPECIALS,
    TOOLS_TEMPLATE,
    VOCAB,
    WEATHER,
    o200k_base,
    write_checkpoint,
    write_tokenizer,
)

REPLY = (
    "<|channel|>analysis<|message|>The user greets. Answer briefly.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>"
)


def test_a_reply_gives_its_reasoning_and_its_answer_apart():
    assert split_reply(REPLY) == Reply("The user greets. Answer briefly.", "Hello! How can I help?")
    two = (
        "<|channel|>analysis<|message|>first<|end|><|start|>assistant<|channel|>analysis"
        "<|message|>second<|end|><|start|>assistant<|channel|>final<|message|>done<|return|>"
    )
    assert split_reply(two) == Reply("first\nsecond", "done")
    # A preamble in the commentary channel is said to the user; a constrained header still parses.
    said = (
        "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant"
        "<|channel|>final <|constrain|>json<|message|>{}<|return|>"
    )
    assert split_reply(said) == Reply("", "Let me check.{}")
    # A model that does not follow the format: all of it is the answer.
    assert split_reply("Just text.") == Reply("", "Just text.")


def _cuts(text: str) -> list[int]:
    """Every place a tokenizer could cut `text`: between characters or whole markers (each
    marker is one token)."""
    markers = (
        "<|channel|>",
        "<|message|>",
        "<|end|>",
        "<|start|>",
        "<|return|>",
        "<|call|>",
        "<|constrain|>",
    )
    cuts, i = [], 0
    while i < len(text):
        marker = next((m for m in markers if text.startswith(m, i)), None)
        i += len(marker) if marker else 1
        cuts.append(i)
    return cuts


def test_a_reply_being_written_only_grows_in_each_channel():
    """Streamed, each channel's text so far is a prefix of its final text: deltas never retract."""
    final = split_reply(REPLY)
    seen = Reply("", "")
    for cut in _cuts(REPLY):
        now = split_reply(REPLY[:cut])
        assert final.reasoning.startswith(now.reasoning) and final.content.startswith(now.content)
        assert now.reasoning.startswith(seen.reasoning) and now.content.startswith(seen.content)
        seen = now
    assert seen == final
    assert split_reply("<|channel|>analysis<|message|>The us") == Reply("The us", "")
    assert split_reply(REPLY.split("<|start|>")[0] + "<|start|>assistant<|chan") == Reply(
        final.reasoning, ""
    )


CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city":"Paris"}<|call|>'
)


def test_a_call_of_a_function_is_given_apart_in_either_header():
    weather = ToolCall("get_weather", '{"city":"Paris"}')
    assert split_reply(CALL) == Reply("Need the weather.", "Checking.", (weather,))
    # The recipient may come before the channel, and the reply may start with the call.
    before = (
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Paris"}<|call|>'
    )
    assert split_reply(before) == Reply("", "", (weather,))
    after = "<|channel|>analysis<|message|>a<|end|><|start|>assistant to=functions.now"
    after += "<|channel|>commentary json<|message|>{}<|call|>"
    assert split_reply(after) == Reply("a", "", (ToolCall("now", "{}"),))
    # A call still being written; a message to anyone but a function is neither answer nor call.
    open_call = CALL.removesuffix('"Paris"}<|call|>')
    assert split_reply(open_call).calls == (ToolCall("get_weather", '{"city":', done=False),)
    browse = "<|channel|>analysis to=browser.search <|constrain|>json<|message|>{}<|call|>"
    assert split_reply(browse) == Reply("", "")


@pytest.mark.parametrize(
    "reply", [CALL, ' to=functions.get_weather<|channel|>commentary json<|message|>{"a":1}<|call|>']
)
def test_a_call_being_written_only_grows(reply):
    """Streamed, a call's name is there from its first sight and its arguments only grow; the
    answer never shows a header being written, even one that starts with its recipient."""
    final = split_reply(reply)
    seen = Reply("", "")
    for cut in _cuts(reply):
        now = split_reply(reply[:cut])
        for field in ("reasoning", "content"):
            assert getattr(now, field).startswith(getattr(seen, field))
            assert getattr(final, field).startswith(getattr(now, field))
        assert len(seen.calls) <= len(now.calls) <= len(final.calls)
        for before, call, last in zip(seen.calls, now.calls, final.calls, strict=False):
            assert call.name == before.name == last.name
            assert last.arguments.startswith(call.arguments)
            assert call.arguments.startswith(before.arguments)
        seen = now
    assert seen == final and all(call.done for call in final.calls)


def test_a_harmony_template_renders_tools_calls_and_results_as_transformers_does(tmp_path):
    import warnings

    import transformers

    from specpipe.transformer.tokenizer import from_hf_dir

    write_tokenizer(tmp_path, TOOLS_TEMPLATE)
    ours = from_hf_dir(tmp_path)
    assert ours.takes_tools
    text = ours.render_chat(HISTORY, [WEATHER, NOW])
    developer = (
        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n"
        "## functions\n\nnamespace functions {\n\n// Gets the weather.\n"
        'type get_weather = (_: {\n// The city\ncity: string,\nunit?: "c" | "f",\n'
        "days?: number[],\n}) => any;\n\n// The time.\ntype now = () => any;\n\n"
        "} // namespace functions<|end|>"
    )
    assert (
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|>" + developer
    ) in text
    assert text.endswith(
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"c":20}'
        "<|end|><|start|>assistant"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for tools in ([WEATHER, NOW], None):
        assert ours.render_chat(HISTORY, tools) == theirs.apply_chat_template(
            HISTORY, tools=tools, tokenize=False, add_generation_prompt=True
        )
    # Without tools, no namespace and no word of them; the instructions stay.
    bare = ours.render_chat(HISTORY)
    assert "# Tools" not in bare and "Calls to these tools" not in bare
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>" in bare


def test_a_gpt_oss_checkpoint_with_the_real_token_layout_is_a_harmony_model(tmp_path, monkeypatch):
    target = open_target(str(write_checkpoint(tmp_path / "oss", monkeypatch)))
    assert target.harmony and not target.takes_tools  # its minimal template renders no tools
    tools = open_target(str(write_checkpoint(tmp_path / "tools", monkeypatch, TOOLS_TEMPLATE)))
    assert tools.harmony and tools.takes_tools
    assert {200002, 200012} <= set(target.eos_ids)  # <|return|> and <|call|> end a reply
    ids = target.prompt_ids("What is the capital of France?")
    text = target.decode(ids)
    assert text.startswith("<|start|>system<|message|>")
    assert f"Current date: {datetime.date.today().isoformat()}" in text  # strftime_now
    assert text.endswith(
        "<|start|>user<|message|>What is the capital of France?<|end|><|start|>assistant"
    )
    # Markers are single tokens at their ids: the prompt ends <|start|> then "assistant".
    assistant = target.prompt_ids("assistant", raw=True)
    assert ids[-len(assistant) - 1 :] == [200006, *assistant]
    assert {200006, 200007, 200008} <= set(ids)


def _o200k_ranks() -> dict[bytes, int]:
    """o200k_base's ranks, read from bpe-openai's data file: each line a token's bytes in base64,
    then its rank."""
    import base64
    import gzip
    from importlib.resources import files

    with (files("bpe_openai.data") / "o200k_base.tiktoken.gz").open("rb") as raw:
        lines = gzip.decompress(raw.read()).decode().splitlines()
    ranks = {}
    for line in lines:
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _o200k_encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    """o200k by brute force, as tiktoken defines it: the pattern cuts the text into pieces; a
    piece that is a token is its rank; any other is joined up from its bytes, always the
    adjacent pair whose join ranks lowest, until no join is a token."""
    from itertools import pairwise

    import regex

    ids = []
    for piece in regex.findall(o200k_base()["pat_str"], text):
        whole = piece.encode()
        parts = [whole] if whole in ranks else [bytes([b]) for b in whole]
        while True:
            pairs = enumerate(pairwise(parts))
            joins = [(ranks[a + b], i) for i, (a, b) in pairs if a + b in ranks]
            if not joins:
                break
            i = min(joins)[1]
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids += [ranks[part] for part in parts]
    return ids


# Words, several scripts, digits, runs of spaces and newlines, contractions, JSON.
SAMPLES = [
    "Hello, world!",
    "The capital of France is Paris.",
    "naïve café, 東京タワー, Ünïcödé and 🙂",
    "1234567 + 89 = 1234656",
    "  indented\n\n\tline's end\r\n",
    "I'M HERE, they'll SEE",
    '{"city": "Paris", "days": [1, 2]}',
]


def test_the_checkpoint_tokenizer_is_o200k_with_harmony_markers(tmp_path):
    """Text encodes to the ids o200k_base's ranks give it, and ids decode to their bytes; every id
    after the ranks is one special token, harmony's markers at their ids, 201,088 in all."""
    from specpipe.transformer.tokenizer import from_hf_dir

    write_tokenizer(tmp_path)
    ours = from_hf_dir(tmp_path)
    ranks = _o200k_ranks()
    assert ours.encode("hello") == [ranks[b"hello"]]
    assert ours.encode(" world") == [ranks[b" world"]]
    for text in SAMPLES:
        assert ours.encode(text) == _o200k_encode(text, ranks), text
        assert ours.decode(ours.encode(text)) == text
    for token, rank in list(ranks.items())[::101]:
        if token.decode(errors="ignore").encode() == token:  # whole UTF-8 on its own
            assert ours.decode([rank]) == token.decode()
    assert ours.vocab_size == VOCAB and len(ranks) == min(SPECIALS)  # specials follow the ranks
    for i, marker in SPECIALS.items():
        assert ours.token_id(marker) == i and ours.encode(marker) == [i]
        assert ours.decode([i]) == marker
    for i in (200000, 200019, VOCAB - 1):
        assert ours.token_id(f"<|reserved_{i}|>") == i
    # In text a marker stays one token, and the text between markers is o200k's.
    text = "<|start|>assistant<|channel|>final<|message|>Hi there!<|end|>"
    words = [_o200k_encode(word, ranks) for word in ("assistant", "final", "Hi there!")]
    assert ours.encode(text) == [200006, *words[0], 200005, *words[1], 200008, *words[2], 200007]


def test_the_default_model_is_not_a_harmony_model():
    target = open_target("default")
    assert not target.harmony and not target.takes_tools
    from specpipe.transformer.resolve import load_tokenizer, open_checkpoint

    assert not speaks_harmony(load_tokenizer(open_checkpoint("default")).token_id)


@pytest.mark.parametrize("missing", ["<|channel|>", "<|return|>"])
def test_a_tokenizer_without_every_marker_is_not_harmony(missing):
    tokens = {
        "<|start|>": 1,
        "<|end|>": 2,
        "<|message|>": 3,
        "<|channel|>": 4,
        "<|return|>": 5,
        "<|call|>": 6,
    }
    assert speaks_harmony(tokens.get)
    del tokens[missing]
    assert not speaks_harmony(tokens.get)


def test_generate_shows_the_reasoning_on_stderr_and_the_answer_on_stdout_as_they_grow(capsys):
    from specpipe.cli.generate import TextStream, finished

    stream = TextStream([], quiet=False, harmony=True)
    for cut in _cuts(REPLY):
        stream.show(REPLY[:cut])
    stream.finish(REPLY)
    shown = capsys.readouterr()
    assert shown.out == "Hello! How can I help?\n"
    assert shown.err == "reasoning: The user greets. Answer briefly.\n"
    assert finished(REPLY, True) == ("Hello! How can I help?", "The user greets. Answer briefly.")
    # Any other model (or a raw prompt): the text as generated, on stdout.
    plain = TextStream([], quiet=False)
    plain.show(REPLY[:40])
    plain.finish(REPLY)
    assert capsys.readouterr().out == REPLY + "\n"
    assert finished(REPLY, False) == (REPLY, "")


def test_generate_on_a_gpt_oss_checkpoint_reports_the_answer_and_the_reasoning(
    tmp_path, monkeypatch
):
    import json

    from click.testing import CliRunner

    from specpipe.cli import cli

    model = str(write_checkpoint(tmp_path / "oss", monkeypatch))
    argv = ["generate", "--local", "Hi", "--model", model, "--max-new-tokens", "6", "--json"]
    done = CliRunner().invoke(cli, [*argv, "--temp", "0"])
    assert done.exit_code == 0, done.output
    outcome = json.loads(done.output.strip().splitlines()[-1])
    # Random weights write no channels: all of the text is the answer, with no reasoning.
    assert outcome["reasoning"] == "" and len(outcome["tokens"]) == 6
    raw = CliRunner().invoke(cli, [*argv, "--temp", "0", "--raw"])
    assert json.loads(raw.output.strip().splitlines()[-1])["reasoning"] == ""
