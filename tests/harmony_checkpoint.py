"""gpt-oss checkpoints at tiny sizes: the released layout with every size shrunk, and one whose
tokenizer has the real layout: o200k's 201,088 ids with harmony's markers at their real ids, and
a chat template in harmony's format.

That vocabulary is not the real one (bytes, then filler tokens; no merges), which no test here
needs: what matters is that the markers are single special tokens at the ids gpt-oss uses.
"""

from __future__ import annotations

import json
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


def write_tokenizer(path: Path) -> None:
    """tokenizer.json (byte-level, the markers at their ids) and tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for i in range(len(alphabet), VOCAB):
        vocab[SPECIALS.get(i, f"<|reserved_{i}|>")] = i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS.values()])
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"chat_template": TEMPLATE, "eos_token": "<|return|>"}
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


def write_checkpoint(path: Path, monkeypatch) -> Path:
    """gpt-oss's layout at tiny sizes (vocabulary 201,088) with the harmony tokenizer."""
    monkeypatch.setitem(synth.LIKE, "tiny-harmony", tiny_like(n_layers=2, vocab_size=VOCAB))
    synth.synthesize("tiny-harmony", path)
    write_tokenizer(path)
    return path
