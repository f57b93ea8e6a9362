"""gpt-oss checkpoints at tiny sizes: the released layout with every size shrunk, and one with
gpt-oss's real tokenizer (o200k_harmony: o200k_base's 199,998 ranks and pre-tokenizer pattern,
then special tokens up to 201,087, harmony's markers at their ids) and a chat template in
harmony's format: the minimal one, or one that also renders function tools, an assistant's
calls and the tools' results as harmony does (`TOOLS_TEMPLATE`: token for token what OpenAI's
harmony library renders, tests/model/test_harmony_reference.py).

The ranks and the pattern are the ones the bpe-openai package ships (a test-only dependency);
transformers' own tiktoken converter makes tokenizer.json of them, as gpt-oss's was made. Nothing
is downloaded.
"""

from __future__ import annotations

import json
import warnings
from functools import lru_cache
from pathlib import Path

from specpipe.transformer import synth

VOCAB = 201088
SPECIALS = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
    200018: "<|endofprompt|>",
}
# Harmony's prompt: a dated system message, the conversation, the assistant's turn opened.
TEMPLATE = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: {{ strftime_now('%Y-%m-%d') }}\n\n"
    "Reasoning: medium\n\n# Valid channels: analysis, commentary, final. "
    "Channel must be included for every message.<|end|>"
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)

SYSTEM = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: {{ strftime_now('%Y-%m-%d') }}\n\n"
    "Reasoning: medium\n\n# Valid channels: analysis, commentary, final. "
    "Channel must be included for every message."
    "{% if tools %}{{ '\\n' }}Calls to these tools must go to the commentary channel: "
    "'functions'.{% endif %}<|end|>"
)
# A JSON Schema's type as TypeScript: enums as their values, arrays of their items' type.
TS_TYPE = """
{%- macro ts_type(spec) -%}
{%- if spec.enum is defined -%}{{ spec.enum | map('tojson') | join(' | ') }}
{%- elif spec.type == 'string' -%}string
{%- elif spec.type in ('integer', 'number') -%}number
{%- elif spec.type == 'boolean' -%}boolean
{%- elif spec.type == 'array' -%}{{ ts_type(spec['items'] or {}) }}[]
{%- else -%}any
{%- endif -%}
{%- endmacro -%}
"""
# The functions as a TypeScript namespace, as harmony declares them in the developer message.
NAMESPACE = """
{%- macro namespace(tools) -%}
{{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' -}}
{%- for tool in tools -%}
{%- set f = tool.function -%}
{%- set params = f.parameters or {} -%}
{%- if f.description -%}{{ '// ' + f.description + '\n' }}{%- endif -%}
{%- if params.properties -%}
{{- 'type ' + f.name + ' = (_: {\n' -}}
{%- for name, spec in params.properties.items() -%}
{%- if spec.description -%}{{ '// ' + spec.description + '\n' }}{%- endif -%}
{{- name -}}{%- if name not in (params.required or []) -%}?{%- endif -%}
{{- ': ' + ts_type(spec) + ',\n' -}}
{%- endfor -%}
{{- '}) => any;\n\n' -}}
{%- else -%}
{{- 'type ' + f.name + ' = () => any;\n\n' -}}
{%- endif -%}
{%- endfor -%}
{{- '} // namespace functions' -}}
{%- endmacro -%}
"""
# The conversation: a first system message becomes the developer's instructions, an assistant's
# calls are commentary addressed to the function (after its reasoning, `thinking`), and a tool's
# result comes from the function to the assistant.
CONVERSATION = """
{%- if messages[0].role == 'system' -%}
{%- set instructions, rest = messages[0].content, messages[1:] -%}
{%- else -%}
{%- set instructions, rest = '', messages -%}
{%- endif -%}
{%- if instructions or tools -%}
{{- '<|start|>developer<|message|>' -}}
{%- if instructions -%}{{ '# Instructions\n\n' + instructions }}{%- endif -%}
{%- if instructions and tools -%}{{ '\n\n' }}{%- endif -%}
{%- if tools -%}{{ namespace(tools) }}{%- endif -%}
{{- '<|end|>' -}}
{%- endif -%}
{%- for m in rest -%}
{%- if m.role == 'assistant' and m.tool_calls -%}
{%- if m.thinking -%}
{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' -}}
{%- endif -%}
{%- for call in m.tool_calls -%}
{%- set args = call.function.arguments -%}
{{- '<|start|>assistant to=functions.' + call.function.name -}}
{{- '<|channel|>commentary <|constrain|>json<|message|>' -}}
{{- args if args is string else args | tojson -}}
{{- '<|call|>' -}}
{%- endfor -%}
{%- elif m.role == 'assistant' -%}
{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' -}}
{%- elif m.role == 'tool' -%}
{{- '<|start|>functions.' + m.name + ' to=assistant<|channel|>commentary<|message|>' -}}
{{- m.content + '<|end|>' -}}
{%- else -%}
{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}
"""
TOOLS_TEMPLATE = TS_TYPE + NAMESPACE + SYSTEM + CONVERSATION

# Two functions a chat may offer: one with parameters of each kind the namespace renders, one
# without any.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Gets the weather.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city"},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "array", "items": {"type": "integer"}},
            },
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "description": "The time."}}
# A chat with instructions, a question, the assistant's reasoning and call, and the result.
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "thinking": "Need the weather.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"c":20}'},
]


def o200k_base() -> dict:
    """o200k_base as bpe-openai ships it: its ranks ("mergeable_ranks", bytes to rank) and its
    pre-tokenizer pattern ("pat_str")."""
    with warnings.catch_warnings():  # on import it reads its data with a deprecated call
        warnings.simplefilter("ignore", DeprecationWarning)
        from bpe_openai import registry

        return registry.o200k_base()


@lru_cache(maxsize=1)
def o200k_harmony() -> str:
    """gpt-oss's tokenizer as tokenizer.json text: o200k_base through transformers' tiktoken
    converter, then every id from the ranks' end to VOCAB a special token (harmony's markers at
    their ids, `<|reserved_N|>` at the others, as o200k_harmony names them). Built once a
    process: it takes a few seconds."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class GivenRanks(TikTokenConverter):
        """The converter handed the ranks themselves: reading a ranks file takes tiktoken."""

        load_tiktoken_bpe = staticmethod(lambda ranks: ranks)

    base = o200k_base()
    ranks = base["mergeable_ranks"]
    assert sorted(ranks.values()) == list(range(len(ranks)))  # the specials follow at once
    # Added in id order, each special token takes the next id: its own.
    specials = {SPECIALS.get(i, f"<|reserved_{i}|>"): i for i in range(len(ranks), VOCAB)}
    assert base["special_tokens"].items() <= specials.items()  # o200k_base's two agree
    converter = GivenRanks(ranks, pattern=base["pat_str"], extra_special_tokens=specials)
    tokenizer = converter.converted()
    assert all(tokenizer.token_to_id(token) == i for token, i in specials.items())
    assert tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB
    return tokenizer.to_str()


def write_tokenizer(path: Path, template: str = TEMPLATE) -> None:
    """tokenizer.json (gpt-oss's) and tokenizer_config.json (`template`, and <|return|> ends)."""
    (path / "tokenizer.json").write_text(o200k_harmony(), encoding="utf-8")
    config = {"chat_template": template, "eos_token": "<|return|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def tiny_like(n_layers: int = 4, vocab_size: int = 97) -> dict:
    """gpt-oss's config with every size shrunk, the layout kept."""
    config = synth._gpt_oss(n_layers=n_layers, n_experts=4)
    config.update(
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts_per_tok=2,
        experts_per_token=2,
        sliding_window=4,
        vocab_size=vocab_size,
    )
    if vocab_size < VOCAB:  # ids of the real vocabulary would not fit
        config.update(pad_token_id=0, eos_token_id=1)
    return config


def write_checkpoint(path: Path, monkeypatch, template: str = TEMPLATE) -> Path:
    """gpt-oss's layout at tiny sizes (vocabulary 201,088) with the harmony tokenizer, prompting
    through `template`."""
    monkeypatch.setitem(synth.LIKE, "tiny-harmony", tiny_like(n_layers=2, vocab_size=VOCAB))
    synth.synthesize("tiny-harmony", path)
    write_tokenizer(path, template)
    return path
