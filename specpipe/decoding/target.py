"""The target model as a ring's callers see it: tokenizer, end-of-sequence ids, layer count.

The coordinator, the proofs, the nightly regression, `generate --local` and the benchmarks all
open their model with `open_target(name)`. It reads a checkpoint through
`specpipe.transformer.resolve` (once per name and process: a coordinator runs many jobs on
one model); other kinds of model (a deployment's own, or the test suite's toy transformer)
register an opener by name with `register_target`. `Target.local_ring` runs the model in one
process as the swarm runs it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial

from specpipe.core.ring import Stage
from specpipe.decoding.local_ring import LocalRing
from specpipe.drafting.head import load_with_head
from specpipe.transformer.harmony import STOP_MARKERS, speaks_harmony


@dataclass(frozen=True)
class Target:
    """What a ring's caller needs of a model besides the ring."""

    name: str  # as the inventory records it: stages serving another model are not routed
    n_layers: int
    prompt_ids: Callable[..., list[int]]  # (prompt, raw=False): the chat template unless raw
    decode: Callable[[list[int]], str]
    eos_ids: tuple[int, ...] = ()
    quant: str = "none"
    # (messages, tools=None): a chat's messages, and the functions it may call, through the
    # chat template (ModelError when the model has none)
    chat_ids: Callable[..., list[int]] | None = None
    # its replies are harmony (gpt-oss): reasoning and answer in channels (`model.harmony`)
    harmony: bool = False
    takes_tools: bool = False  # its chat template renders function tools
    context_length: int = 0  # positions the model attends over; 0 when unknown
    # (n_stages, **options) -> the model as n_stages stages in this process
    load_stages: Callable[..., Sequence[Stage]] | None = field(default=None, repr=False)

    def local_ring(self, n_stages: int, draft_head: str | None = None, **options) -> LocalRing:
        """The model as up to `n_stages` stages in this process (`options`: `load_stages`'s),
        its tail holding the draft head as a stage worker's does (`load_with_head`: by default
        the one the package ships for the model, if any): a one-process ring as the swarm runs
        it. ValueError when the model cannot be loaded here."""
        if self.load_stages is None:
            raise ValueError(f"model {self.name!r} cannot be loaded in-process")
        load = partial(self.load_stages, min(n_stages, self.n_layers), **options)
        return LocalRing(*load_with_head(load, draft_head, self.name))


_OPENERS: dict[str, Callable[[], Target]] = {}


def register_target(name: str, opener: Callable[[], Target]) -> None:
    """Make `open_target(name)` call `opener` instead of reading a checkpoint."""
    _OPENERS[name] = opener


def open_target(name: str) -> Target:
    """The named model as a `Target`; ValueError with a one-line reason when it cannot open.
    Safe from several threads: a model is opened once."""
    if name in _OPENERS:
        return _OPENERS[name]()
    with _OPENING:
        return _open_checkpoint(name)


_OPENING = threading.Lock()


@lru_cache(maxsize=4)
def _open_checkpoint(name: str) -> Target:
    try:
        from specpipe.transformer.resolve import (
            load_stages,
            load_tokenizer,
            model_label,
            open_checkpoint,
        )
    except ImportError as exc:
        raise ValueError(f"cannot open model {name!r}: model support is missing ({exc})") from None
    try:
        checkpoint = open_checkpoint(name)
        tokenizer = load_tokenizer(checkpoint)
        label = model_label(name)
    except Exception as exc:  # ModelError, OSError, bad files: all one line for the caller
        raise ValueError(f"cannot open model {name!r}: {exc}") from None
    eos = set(checkpoint.config.eos_token_ids)
    eos_token = getattr(tokenizer, "eos_token", None)
    if eos_token and tokenizer.token_id(eos_token) is not None:
        eos.add(tokenizer.token_id(eos_token))
    harmony = speaks_harmony(tokenizer.token_id)
    if harmony:  # a reply ends with its last message, or with a tool call
        eos.update(tokenizer.token_id(marker) for marker in STOP_MARKERS)
    return Target(
        name=label,
        n_layers=checkpoint.config.n_layers,
        prompt_ids=tokenizer.prompt_ids,
        chat_ids=tokenizer.chat_ids,
        decode=tokenizer.decode,
        eos_ids=tuple(sorted(eos)),
        harmony=harmony,
        takes_tools=tokenizer.takes_tools,
        quant=_quant(checkpoint),
        context_length=int(checkpoint.config.max_position_embeddings or 0),
        load_stages=lambda n, **options: load_stages(name, n, **options),
    )


def context_error(target: Target, prompt_tokens: int, max_new_tokens: int) -> str | None:
    """Why a job of `prompt_tokens` and `max_new_tokens` cannot run on `target`, or None.

    The stages' caches hold at most prompt + max_new_tokens - 1 positions: a round's drafts never
    reach past the token budget, so the draft length adds nothing."""
    need = prompt_tokens + max_new_tokens
    if target.context_length and need > target.context_length:
        return (
            f"the prompt is {prompt_tokens} tokens, and with max_new_tokens {max_new_tokens} "
            f"the job needs {need} positions, beyond the model's context of "
            f"{target.context_length} tokens"
        )
    return None


def _quant(checkpoint) -> str:
    if getattr(checkpoint.config, "mxfp4", False):
        return "mxfp4"
    match = re.search(r"\.(I?Q\d\w*|F16|F32|BF16)\.gguf$", str(checkpoint.path), re.IGNORECASE)
    if match:
        return match.group(1)
    return "gguf" if str(checkpoint.path).endswith(".gguf") else "none"
