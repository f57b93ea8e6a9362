"""Tokenizers and prompts: tokenizer.json, or a GGUF file's own vocabulary; chat templates.

Everything is built from local files. A GGUF "gpt2" vocabulary becomes a byte-level BPE tokenizer
of the `tokenizers` library; control and user-defined tokens become added tokens, so chat markers
such as `<|im_start|>` stay single tokens. Chat templates are Jinja, rendered as transformers
renders them (sandboxed, trim_blocks, lstrip_blocks).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from specpipe.transformer.errors import ModelError

CONTROL, USER_DEFINED = 3, 4  # GGUF token types that are added tokens
# llama.cpp's pre-tokenizer names whose regex splits digits one by one before the GPT-2 regex.
SPLIT_DIGITS = {"smollm", "llama3", "llama-bpe", "qwen2", "deepseek-llm"}


class Tokenizer:
    """Text <-> ids for one model, plus its chat template when it has one."""

    def __init__(
        self,
        backend,
        source: str,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos: bool = False,
    ) -> None:
        self.backend, self.source = backend, source
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.add_bos = add_bos

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special`, the BOS the model expects."""
        ids = self.backend.encode(text, add_special_tokens=add_special).ids
        bos = self.token_id(self.bos_token) if self.bos_token else None
        if add_special and self.add_bos and bos is not None and ids[:1] != [bos]:
            ids = [bos] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)

    def prompt_ids(self, prompt: str, raw: bool = False) -> list[int]:
        """The ids to feed for a user prompt: through the chat template unless raw or none."""
        if raw or not self.chat_template:
            return self.encode(prompt)
        return self.chat_ids([{"role": "user", "content": prompt}])

    def chat_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The ids to feed for a chat: its messages (and the functions it may call, `tools`)
        through the chat template."""
        if not self.chat_template:
            raise ModelError(f"{self.source}: the model has no chat template")
        return self.encode(self.render_chat(messages, tools), False)

    @property
    def takes_tools(self) -> bool:
        """Whether the chat template renders function tools (it reads `tools`)."""
        if not self.chat_template:
            return False
        from jinja2 import TemplateError, meta

        try:
            parsed = _environment().parse(self.chat_template)
        except TemplateError:
            return False
        return "tools" in meta.find_undeclared_variables(parsed)

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The chat template applied to `messages`, ending with the assistant's turn opened.
        `tools`, the functions the assistant may call, go in as transformers passes them: a
        list of `{"type": "function", "function": {name, description, parameters}}`, or None."""
        from jinja2 import TemplateError

        try:
            template = _environment().from_string(self.chat_template)
            return template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as e:
            raise ModelError(f"{self.source}: chat template failed ({e})") from None

    def check_fits(self, vocab_size: int) -> None:
        """Raise ModelError when this tokenizer makes ids the model has no embedding for."""
        if self.vocab_size > vocab_size:
            raise ModelError(
                f"{self.source}: tokenizer has {self.vocab_size} tokens, "
                f"the model only {vocab_size}"
            )


def _environment():
    """A Jinja environment as transformers renders chat templates in (sandboxed)."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    env.globals["raise_exception"] = raise_exception
    # gpt-oss's template dates its system message, as transformers lets templates do.
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def from_hf_dir(path: str | Path) -> Tokenizer:
    """tokenizer.json (and tokenizer_config.json for the template and special tokens)."""
    from tokenizers import Tokenizer as Backend

    path = Path(path)
    file = path / "tokenizer.json"
    if not file.exists():
        raise ModelError(f"{file}: no such file (the checkpoint has no tokenizer)")
    try:
        backend = Backend.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ModelError(f"{file}: unreadable tokenizer ({e})") from None
    config: dict[str, Any] = {}
    config_file = path / "tokenizer_config.json"
    if config_file.exists():
        try:
            config = json.loads(config_file.read_text())
        except (OSError, json.JSONDecodeError):
            raise ModelError(f"{config_file}: not valid JSON") from None

    def token(key: str) -> str | None:
        value = config.get(key)
        return value.get("content") if isinstance(value, dict) else value

    template = config.get("chat_template")
    jinja = path / "chat_template.jinja"
    if template is None and jinja.exists():
        template = jinja.read_text()
    return Tokenizer(backend, str(file), template, token("bos_token"), token("eos_token"))


def from_gguf_metadata(meta: dict[str, Any], source: str) -> Tokenizer:
    """A byte-level BPE tokenizer from a GGUF file's `tokenizer.ggml.*` metadata."""
    from tokenizers import AddedToken, decoders, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelError(f"{source}: unsupported GGUF tokenizer model {kind!r}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = Backend(BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if meta.get("tokenizer.ggml.pre") in SPLIT_DIGITS:
        digits = pre_tokenizers.Digits(individual_digits=True)
        backend.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=False)
            if k == CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, normalized=False)
            for t, k in zip(tokens, types, strict=False)
            if k == USER_DEFINED
        ]
    )

    def name(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    return Tokenizer(
        backend,
        source,
        meta.get("tokenizer.chat_template"),
        name("bos"),
        name("eos"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    )
