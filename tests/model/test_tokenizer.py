"""tokenizer.json checkpoints: loading, chat templates from tokenizer_config.json, misfits."""

from __future__ import annotations

import json
import shutil

import pytest

from specpipe.transformer.errors import ModelError
from specpipe.transformer.resolve import load_tokenizer, open_checkpoint

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def _write_tokenizer(path, n_words: int, template: str | None = TEMPLATE) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<s>", "</s>", "[UNK]", "[", "]", "user", "assistant", "hello", "world", "\n"]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(n_words - len(words))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    if template:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture
def model_dir(checkpoints, tmp_path):
    return shutil.copytree(checkpoints["llama"], tmp_path / "m")


def test_tokenizer_json_and_chat_template(model_dir):
    _write_tokenizer(model_dir, 90)
    tok = load_tokenizer(open_checkpoint(model_dir))
    assert tok.encode("hello world w5") == [7, 8, 15]
    assert tok.render_chat([{"role": "user", "content": "hello"}]) == (
        "<s>[user] hello\n[assistant] "
    )
    assert tok.prompt_ids("hello")[:2] == [0, 3]  # <s> then "[" from the template
    assert tok.prompt_ids("hello", raw=True) == [7]


def test_checkpoint_without_template_takes_raw_prompt(model_dir):
    _write_tokenizer(model_dir, 90, template=None)
    tok = load_tokenizer(open_checkpoint(model_dir))
    assert tok.chat_template is None and tok.prompt_ids("hello world") == [7, 8]


def test_tokenizer_larger_than_model(model_dir):
    _write_tokenizer(model_dir, 150)
    with pytest.raises(
        ModelError, match="tokenizer.json: tokenizer has 150 tokens, the model only 97"
    ):
        load_tokenizer(open_checkpoint(model_dir))


def test_missing_or_broken_tokenizer(model_dir):
    with pytest.raises(ModelError, match="tokenizer.json: no such file"):
        load_tokenizer(open_checkpoint(model_dir))
    (model_dir / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ModelError, match="tokenizer.json: unreadable tokenizer"):
        load_tokenizer(open_checkpoint(model_dir))


def test_template_error_is_reported(model_dir):
    _write_tokenizer(model_dir, 90, template="{{ raise_exception('no system role') }}")
    tok = load_tokenizer(open_checkpoint(model_dir))
    with pytest.raises(ModelError, match="chat template failed \\(no system role\\)"):
        tok.prompt_ids("hello")
