"""The model the on-ring proofs run against: its tokenizer, stop tokens and layer count.

`open_target(name)` opens a checkpoint through `specpipe.model.resolve`; other kinds of model
(a deployment's own, or the test suite's toy transformer) register an opener by name with
`register_target`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specpipe.ring import Stage

# Prompts for proof 2: input-grounded ones (the answer is mostly in the prompt, so the n-gram
# drafter has something to propose) and open-ended ones (high-entropy stops).
DEFAULT_PROMPTS = (
    "Repeat this sentence exactly, then say it once more: the quick brown fox jumps over the "
    "lazy dog near the river bank.",
    "Summarise in one sentence: The lighthouse keeper climbed the stairs every evening, lit "
    "the lamp, and watched the ships pass until dawn.",
    "Write a short poem about the sea at night.",
    "Tell me a story about a robot who learns to paint.",
)
# The prompt proof 3 generates from, greedy and sampled.
DEFAULT_GENERATION_PROMPT = "Write three sentences about why the sky is blue."


@dataclass
class Target:
    """What a proof needs of a model besides the ring."""

    name: str
    n_layers: int
    prompt_ids: Callable[[str], list[int]]  # a user prompt, chat template applied
    decode: Callable[[list[int]], str]
    eos_ids: tuple[int, ...] = ()
    quant: str = "none"
    load_stages: Callable[[int], Sequence[Stage]] | None = field(default=None, repr=False)


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_OPENERS: dict[str, Callable[[], Target]] = {}


def register_target(name: str, opener: Callable[[], Target]) -> None:
    """Make `open_target(name)` call `opener` instead of reading a checkpoint."""
    _OPENERS[name] = opener


def _quant(checkpoint) -> str:
    if getattr(checkpoint.config, "mxfp4", False):
        return "mxfp4"
    match = re.search(r"\.(I?Q\d\w*|F16|F32|BF16)\.gguf$", str(checkpoint.path), re.IGNORECASE)
    if match:
        return match.group(1)
    return "gguf" if str(checkpoint.path).endswith(".gguf") else "none"


def open_target(name: str) -> Target:
    """The named model as a `Target`; ValueError with a one-line reason when it cannot open."""
    if name in _OPENERS:
        return _OPENERS[name]()
    try:
        from specpipe.model.resolve import load_stages, load_tokenizer, open_checkpoint
    except ImportError as exc:
        raise ValueError(f"cannot open model {name!r}: model support is missing ({exc})") from None
    # The settings name the embedded default model by its name; resolve knows it as `default`.
    source = "default" if name == DEFAULT_MODEL_NAME else name
    try:
        checkpoint = open_checkpoint(source)
        tokenizer = load_tokenizer(checkpoint)
    except Exception as exc:  # ModelError, OSError, bad files: all one line for the caller
        raise ValueError(f"cannot open model {name!r}: {exc}") from None
    eos = set(checkpoint.config.eos_token_ids)
    eos_token = getattr(tokenizer, "eos_token", None)
    if eos_token and tokenizer.token_id(eos_token) is not None:
        eos.add(tokenizer.token_id(eos_token))
    return Target(
        name=name,
        n_layers=checkpoint.config.n_layers,
        prompt_ids=tokenizer.prompt_ids,
        decode=tokenizer.decode,
        eos_ids=tuple(sorted(eos)),
        quant=_quant(checkpoint),
        load_stages=lambda n: load_stages(source, n),
    )
