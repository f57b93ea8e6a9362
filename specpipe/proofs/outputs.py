"""Proof 3: the same prompt generated greedy and with two sampled seeds, each speculative and
plain, side by side. Speculative and plain texts must be identical; the tok/s show the gain.

With `draft_head` the speculative runs take drafts from the tail's draft head where the n-gram
has none (`drafts_from="both"`), and the sampled modes draw with the "gumbel" sampler, whose
noise the head shares; each mode records its sampler, where its drafts came from and how many
rounds the head drafted for (0 when the tail has no head)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

from specpipe.core.ring import Ring
from specpipe.core.sampling import SamplingParams
from specpipe.decoding.generation import Generation
from specpipe.drafting.sources import named_sources


def _one(
    ring: Ring,
    prompt: Sequence[int],
    params: SamplingParams,
    draft_k: int,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    decode: Callable[[list[int]], str],
    drafts_from: str,
) -> dict:
    gen = Generation(
        ring,
        f"proof3-{uuid.uuid4().hex[:12]}",
        prompt,
        params,
        max_new_tokens=max_new_tokens,
        draft_k=draft_k,
        eos_ids=eos_ids,
        sources=named_sources(drafts_from, params),
    )
    try:
        tokens = gen.run()
    finally:
        ring.drop(gen.session)
    return {
        "text": decode(tokens),
        "tokens": tokens,
        "tok_s": gen.stats.tok_s,
        "rounds": gen.stats.rounds,
        "tokens_per_round": gen.stats.tokens_per_round,
        "head_rounds": gen.stats.head_rounds,
        "draft_acceptance": gen.stats.draft_acceptance,
    }


def run_generation_proof(
    ring: Ring,
    prompt: Sequence[int],
    decode: Callable[[list[int]], str],
    *,
    temp: float = 0.7,
    top_p: float = 0.95,
    top_k: int = 0,
    seeds: Sequence[int] = (7, 99),
    draft_k: int = 4,
    max_new_tokens: int = 64,
    eos_ids: Sequence[int] = (),
    draft_head: bool = False,
) -> dict:
    """`proof_3_generation`: one entry per mode, each with its speculative and plain run."""
    sampler = "gumbel" if draft_head else "icdf"
    drafts_from = "both" if draft_head else "ngram"
    modes = {"greedy_temp0": SamplingParams(temp=0.0)}
    for seed in seeds:
        modes[f"sampled_temp{temp:g}_seed{seed}"] = SamplingParams(
            temp, top_p, top_k, seed, sampler=sampler
        )
    out: dict = {}
    for name, params in modes.items():
        spec = _one(ring, prompt, params, draft_k, max_new_tokens, eos_ids, decode, drafts_from)
        plain = _one(ring, prompt, params, 0, max_new_tokens, eos_ids, decode, drafts_from)
        out[name] = {
            "text": spec["text"],
            "tok_s": spec["tok_s"],
            "plain_tok_s": plain["tok_s"],
            "speedup": spec["tok_s"] / plain["tok_s"] if plain["tok_s"] else None,
            "tokens_per_round": spec["tokens_per_round"],
            "identical": spec["tokens"] == plain["tokens"],
            "draft_head": draft_head,
            "sampler": params.sampler,
            "drafts_from": drafts_from,
            "head_rounds": spec["head_rounds"],
            "draft_acceptance": spec["draft_acceptance"],
            "spec": spec,
            "plain": plain,
        }
    out["verdict"] = "PASS" if all(m["identical"] for m in out.values()) else "FAIL"
    return out
