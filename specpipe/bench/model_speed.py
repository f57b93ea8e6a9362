"""Speed of the model shards on the default model, measured side by side with transformers.

    .venv/bin/python specpipe/bench/model_speed.py --threads 1 --tokens 64 [--device cuda]

1. Greedy decode tok/s: our StageModel (one stage, plain loop) and transformers' `generate` on the
   same dequantised weights, same dtype and thread count, alternating runs.
2. The cost of a verify forward of K+1 positions against a single-token step at the same context.
3. Speculative against plain generation through `LocalRing` on an input-grounded prompt.
4. Row stability: logits of positions computed inside a verify forward against one at a time.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from specpipe.core.sampling import SamplingParams
from specpipe.decoding.generation import Generation
from specpipe.decoding.local_ring import LocalRing
from specpipe.transformer.checkpoint import hf_name_map
from specpipe.transformer.layer_range import StageModel, load_stage
from specpipe.transformer.resolve import load_tokenizer, open_checkpoint

STORY = "Write a short story about a robot who learns to paint."
GROUNDED = (
    "Here is a passage:\n\nThe Amazon rainforest covers much of the Amazon basin of South "
    "America. The basin covers seven million square kilometres, of which five and a half million "
    "are covered by the rainforest. The region includes territory belonging to nine nations. "
    "The majority of the forest is contained within Brazil, with 60% of the rainforest, followed "
    "by Peru with 13%, Colombia with 10%, and with minor amounts in Bolivia, Ecuador, French "
    "Guiana, Guyana, Suriname, and Venezuela.\n\nCopy the passage above word for word."
)


def transformers_twin(stage: StageModel):
    """A transformers LlamaForCausalLM holding exactly the stage's weights (an unpacked stage)."""
    import transformers

    cfg = stage.cfg
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    names = hf_name_map(cfg, 0, cfg.n_layers, True, True, packed=False)
    ours = stage.state_dict()
    # Our fused weights (q|k|v, gate|up) split back into transformers' separate ones.
    kv = cfg.n_kv_heads * cfg.head_dim
    sizes = {3: [cfg.n_heads * cfg.head_dim, kv, kv], 2: [cfg.intermediate_size] * 2}
    state = {}
    for key, (srcs, _) in names.items():
        parts = ours[key].split(sizes[len(srcs)]) if len(srcs) > 1 else [ours[key]]
        state.update(zip(srcs, parts, strict=True))
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.LlamaForCausalLM(config).to(stage.device, stage.dtype)
    model.load_state_dict(state, strict=True)
    return model.eval()


def ours_greedy(stage: StageModel, ids: list[int], n: int) -> tuple[list[int], float]:
    started = time.perf_counter()
    stage.drop("bench")
    logits = stage.forward("bench", torch.tensor(ids), 0)
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = stage.forward("bench", torch.tensor(out[-1:]), len(ids) + len(out) - 1)
    return out, n / (time.perf_counter() - started)


def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], float]:
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids], device=model.device),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist(), n / (time.perf_counter() - started)


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work, so a timer measures it (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def verify_cost(stage: StageModel, ids: list[int], k: int, repeats: int) -> tuple[float, float]:
    """Median seconds of a 1-token step and of a (k+1)-token verify at the same context."""
    stage.drop("v")
    stage.forward("v", torch.tensor(ids), 0)
    p = len(ids)
    one, many = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        stage.forward("v", torch.tensor(ids[:1]), p)
        synchronize(stage.device)
        one.append(time.perf_counter() - t)
        t = time.perf_counter()
        stage.forward("v", torch.tensor(ids[: k + 1]), p)
        synchronize(stage.device)
        many.append(time.perf_counter() - t)
    return statistics.median(one), statistics.median(many)


def row_stability(stage: StageModel, ids: list[int], n: int, k: int) -> tuple:
    """Rows differing, argmax flips, max |diff|, max and mean TV: verify chunks vs single steps."""
    seq, _ = ours_greedy(stage, ids, n)
    stage.drop("a")
    stage.forward("a", torch.tensor(ids), 0)
    single = torch.cat(
        [stage.forward("a", torch.tensor([t]), len(ids) + i) for i, t in enumerate(seq)]
    )
    stage.drop("b")
    stage.forward("b", torch.tensor(ids), 0)
    chunks = [
        stage.forward("b", torch.tensor(seq[i : i + k + 1]), len(ids) + i)
        for i in range(0, n, k + 1)
    ]
    verify = torch.cat(chunks)[:n]
    diff = (verify - single).abs().amax(-1)
    flips = int((verify.argmax(-1) != single.argmax(-1)).sum())
    # Under coupled sampling at temp 1, the chance that one uniform draws different tokens from
    # the two rows is at most their total variation distance.
    p, q = torch.softmax(verify.double(), -1), torch.softmax(single.double(), -1)
    tv = 0.5 * (p - q).abs().sum(-1)
    return int((diff > 0).sum()), flips, float(diff.max()), float(tv.max()), float(tv.mean())


def generation(stages, tok, prompt: str, n: int, draft_k: int, params: SamplingParams):
    ids = tok.prompt_ids(prompt)
    run = Generation(
        LocalRing(stages),
        "g",
        ids,
        params,
        max_new_tokens=n,
        draft_k=draft_k,
        eos_ids=[tok.token_id(tok.eos_token)],
    )
    out = run.run()
    return out, run.stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft-k", type=int, default=8)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = open_checkpoint("default")
    tok = load_tokenizer(checkpoint)
    on = {"dtype": args.dtype, "device": args.device}
    stage = load_stage(checkpoint, 0, checkpoint.config.n_layers, **on)
    fast = load_stage(
        open_checkpoint("default"), 0, checkpoint.config.n_layers, **on, row_stable=False
    )
    plain = load_stage(checkpoint, 0, checkpoint.config.n_layers, **on, pack=False)
    twin = transformers_twin(plain)  # packed weights have no plain copy to hand over
    del plain
    ids = tok.prompt_ids(STORY)
    print(
        f"default model, {args.dtype} on {args.device}, {args.threads} thread(s), "
        f"prompt {len(ids)} tokens"
    )
    modes = {"row-stable": stage, "fast rows": fast}

    for model in modes.values():  # warm up
        ours_greedy(model, ids, 2)
    hf_greedy(twin, ids, 2)
    rates: dict[str, list[float]] = {name: [] for name in [*modes, "transformers"]}
    tokens = {}
    for _ in range(args.repeats):  # interleave, so background load hits all alike
        for name, model in modes.items():
            tokens[name], rate = ours_greedy(model, ids, args.tokens)
            rates[name].append(rate)
        tokens["transformers"], rate = hf_greedy(twin, ids, args.tokens)
        rates["transformers"].append(rate)
    theirs = statistics.median(rates["transformers"])
    for name in modes:
        ours = statistics.median(rates[name])
        print(
            f"1. greedy decode, {args.tokens} tokens (prefill included), {name}: "
            f"{ours:.2f} tok/s vs transformers {theirs:.2f} tok/s = {ours / theirs:.2f}x; "
            f"same tokens: {tokens[name] == tokens['transformers']}"
        )

    for name, model in modes.items():
        one, many = verify_cost(model, ids, args.draft_k, repeats=10)
        print(
            f"2. {name}: verify of K={args.draft_k} drafts ({args.draft_k + 1} positions) "
            f"{many * 1e3:.1f} ms vs one-token step {one * 1e3:.1f} ms = {many / one:.2f}x"
        )

    for name, prompt, params in (
        ("grounded, greedy", GROUNDED, SamplingParams(temp=0.0)),
        ("grounded, temp 0.7", GROUNDED, SamplingParams(temp=0.7, top_p=0.95, seed=1)),
        ("story, greedy", STORY, SamplingParams(temp=0.0)),
    ):
        plain, ps = generation([stage], tok, prompt, args.tokens, 0, params)
        spec, ss = generation([stage], tok, prompt, args.tokens, args.draft_k, params)
        print(
            f"3. {name} (row-stable): plain {ps.tok_s:.2f} tok/s ({ps.rounds} rounds), "
            f"speculative {ss.tok_s:.2f} tok/s ({ss.rounds} rounds, "
            f"{ss.tokens_per_round:.2f} tokens per round), speed-up "
            f"{ss.tok_s / ps.tok_s:.2f}x, same tokens: {plain == spec}"
        )

    for name, model in modes.items():
        rows, flips, worst, tv_max, tv_mean = row_stability(model, ids, args.tokens, args.draft_k)
        print(
            f"4. {name}: verify vs single-step logits over {args.tokens} positions: "
            f"{rows} rows differ, {flips} argmax flips, max |diff| {worst:.3g}, "
            f"total variation at temp 1 max {tv_max:.3g} mean {tv_mean:.3g}"
        )


if __name__ == "__main__":
    main()
