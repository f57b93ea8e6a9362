"""The test checkpoint's harmony chat template and our reply parser against OpenAI's own
harmony library (openai-harmony, a test-only dependency): the same token ids for every kind of
conversation the OpenAI API sends (instructions, tools, an assistant's call and its result, an
earlier answer), and the same reasoning, answer and calls read from a reply.

Nothing is downloaded: the library reads o200k_base's ranks from a file written here from the
bpe-openai package's, and checks it against the published file's SHA-256 before it loads."""

from __future__ import annotations

import base64
import datetime
import hashlib
import json

import openai_harmony as oh
import pytest

from specpipe.transformer.harmony import split_reply
from specpipe.transformer.tokenizer import from_hf_dir
from tests.harmony_checkpoint import (
    HISTORY,
    NOW,
    TOOLS_TEMPLATE,
    WEATHER,
    o200k_base,
    write_tokenizer,
)

# The SHA-256 of o200k_base.tiktoken as OpenAI publishes it (the library checks it too).
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


@pytest.fixture(scope="module")
def encoding(tmp_path_factory):
    """harmony's gpt-oss encoding, its ranks read from a file written of bpe-openai's."""
    folder = tmp_path_factory.mktemp("encodings")
    ranks = o200k_base()["mergeable_ranks"]
    lines = b"".join(
        base64.b64encode(token) + b" %d\n" % rank
        for token, rank in sorted(ranks.items(), key=lambda item: item[1])
    )
    assert hashlib.sha256(lines).hexdigest() == O200K_SHA256
    (folder / "o200k_base.tiktoken").write_bytes(lines)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_ENCODINGS_BASE", str(folder))
        return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The test checkpoint's tokenizer with the template that renders tools."""
    folder = tmp_path_factory.mktemp("harmony")
    write_tokenizer(folder, TOOLS_TEMPLATE)
    return from_hf_dir(folder)


def system() -> oh.Message:
    """harmony's default system message, dated today as the template dates it."""
    today = datetime.date.today().isoformat()
    content = oh.SystemContent.new().with_conversation_start_date(today)
    return oh.Message.from_role_and_content(oh.Role.SYSTEM, content)


def developer(instructions: str | None, tools: list[dict]) -> oh.Message:
    content = oh.DeveloperContent.new()
    if instructions:
        content = content.with_instructions(instructions)
    if tools:
        described = [
            oh.ToolDescription.new(
                t["function"]["name"],
                t["function"]["description"],
                parameters=t["function"].get("parameters"),
            )
            for t in tools
        ]
        content = content.with_function_tools(described)
    return oh.Message.from_role_and_content(oh.Role.DEVELOPER, content)


def user(text: str) -> oh.Message:
    return oh.Message.from_role_and_content(oh.Role.USER, text)


def assistant(text: str, channel: str) -> oh.Message:
    return oh.Message.from_role_and_content(oh.Role.ASSISTANT, text).with_channel(channel)


def call(name: str, arguments: dict) -> oh.Message:
    # A template renders arguments given as an object with `tojson`: json.dumps's separators.
    message = oh.Message.from_role_and_content(oh.Role.ASSISTANT, json.dumps(arguments))
    return (
        message.with_channel("commentary")
        .with_recipient(f"functions.{name}")
        .with_content_type("<|constrain|>json")
    )


def result(name: str, text: str) -> oh.Message:
    author = oh.Author.new(oh.Role.TOOL, f"functions.{name}")
    message = oh.Message.from_author_and_content(author, text)
    return message.with_recipient("assistant").with_channel("commentary")


CASES = {
    "a user alone": ([{"role": "user", "content": "Hi there"}], None, [user("Hi there")]),
    "instructions": (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        None,
        [developer("Be brief.", []), user("Hi")],
    ),
    "instructions and tools": (
        HISTORY[:2],
        [WEATHER, NOW],
        [developer("Be brief.", [WEATHER, NOW]), user("Weather in Paris?")],
    ),
    "a call and its result": (
        HISTORY,
        [WEATHER],
        [
            developer("Be brief.", [WEATHER]),
            user("Weather in Paris?"),
            assistant("Need the weather.", "analysis"),
            call("get_weather", {"city": "Paris"}),
            result("get_weather", '{"c":20}'),
        ],
    ),
    "tools without instructions": (
        HISTORY[1:2],
        [NOW],
        [developer(None, [NOW]), user("Weather in Paris?")],
    ),
    "an earlier answer": (
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        ],
        None,
        [user("Hi"), assistant("Hello!", "final"), user("Bye")],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_the_template_renders_a_chat_as_harmony_does(encoding, tokenizer, case):
    messages, tools, theirs = CASES[case]
    conversation = oh.Conversation.from_messages([system(), *theirs])
    want = encoding.render_conversation_for_completion(conversation, oh.Role.ASSISTANT)
    assert tokenizer.chat_ids(messages, tools) == list(want)


REPLIES = {
    "reasoning, then the answer": (
        "<|channel|>analysis<|message|>The user greets.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>"
    ),
    "a call, the recipient after the channel": (
        "<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city":"Paris"}<|call|>'
    ),
    "a call, the recipient first": (
        "<|channel|>analysis<|message|>Need it.<|end|>"
        "<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}<|call|>"
    ),
}


@pytest.mark.parametrize("case", REPLIES)
def test_a_reply_reads_as_harmony_parses_it(encoding, tokenizer, case):
    text = REPLIES[case]
    ids = tokenizer.encode(text, False)
    parsed = encoding.parse_messages_from_completion_tokens(ids, oh.Role.ASSISTANT)
    reasoning = "".join(m.content[0].text for m in parsed if m.channel == "analysis")
    answer = "".join(m.content[0].text for m in parsed if m.channel == "final")
    calls = [
        (m.recipient.removeprefix("functions."), m.content[0].text)
        for m in parsed
        if m.recipient and m.recipient.startswith("functions.")
    ]
    ours = split_reply(text)
    assert (ours.reasoning, ours.content) == (reasoning, answer)
    assert [(c.name, c.arguments) for c in ours.calls] == calls
