"""Draft trees against chains, on real stage processes whose tail holds the draft head.

Three methods run side by side (`load.side_by_side`): plain decoding, chains (the n-gram drafter
and the head, each round's K chosen adaptively) and trees (the same, the head proposing a tree
each round, shaped by `drafting.tree_size`), greedy and at temp 0.7 / top_p 0.95 (Gumbel
sampler), on grounded and novel prompts, one job at a time, at each link delay. Per method:
tok/s, tokens per round, rows per round, accepted depth and the share of rounds that carried a
tree. Then `at_once` jobs together, chains and then trees, on the same stages: the aggregate
tok/s of each. Every job's tokens are checked against plain decoding's.

With `fixed` sizes, trees of that many drafts every round run beside them: what trees commit
per round where rows are nearly free (a GPU's forward), and what their rows cost here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from specpipe.bench.load import HEAD_MODES, Log, Method, head_modes, run_job
from specpipe.bench.ring_hops import NOVEL_PROMPT, LocalSwarm
from specpipe.core.sampling import SamplingParams, offset_seed
from specpipe.decoding.target import open_target
from specpipe.drafting.train import EVAL_PROMPTS


def tree_methods(max_k: int, fixed: Sequence[int] = ()) -> list[Method]:
    """Plain decoding, chains and trees, both from the n-gram drafter and the head; and trees
    of each `fixed` number of drafts, whatever their rows cost."""
    return [
        Method("plain", 0),
        Method("chain", max_k, True, "both"),
        Method("tree", max_k, True, "both", trees=True),
        *(Method(f"tree-{n}", max_k, True, "both", trees=True, tree_drafts=n) for n in fixed),
    ]


def trees(
    model: str,
    n_stages: int,
    delays: Sequence[float],
    max_k: int,
    tokens: int,
    seed: int,
    repeats: int,
    at_once: int,
    log: Log,
    draft_head: str | None = None,
    fixed: Sequence[int] = (),
) -> dict:
    """The whole comparison (see the module docstring)."""
    target = open_target(model)
    methods = tree_methods(max_k, fixed)
    rows, together = [], []
    exact = True
    for delay in delays:
        found, same = head_modes(
            model, n_stages, [delay], methods, tokens, seed, repeats, log, draft_head
        )
        exact = exact and same
        for row in found:
            by_method = row["methods"]
            row["tree_vs_chain"] = by_method["tree"]["tok_s"] / by_method["chain"]["tok_s"]
            log(describe(row))
        rows += found
        if at_once > 1:
            novel = [target.prompt_ids(p) for p in (NOVEL_PROMPT, *EVAL_PROMPTS)]
            row = jobs_at_once(
                model, n_stages, delay, novel, methods, tokens, seed, at_once, draft_head
            )
            exact = exact and row["identical_to_plain"]
            together.append(row)
            log(describe_at_once(row))
    return {
        "model": target.name,
        "stages": n_stages,
        "tokens": tokens,
        "max_k": max_k,
        "repeats": repeats,
        "identical_to_plain": exact,
        "runs": rows,
        "at_once": together,
    }


def jobs_at_once(
    model: str,
    n_stages: int,
    delay: float,
    prompts: Sequence[list[int]],
    methods: Sequence[Method],
    tokens: int,
    seed: int,
    n: int,
    draft_head: str | None,
) -> dict:
    """`n` jobs at temp 0.7 / top_p 0.95 started together, each method in turn (plain first,
    the reference), on one set of stages: each method's aggregate tok/s."""
    temp, top_p = HEAD_MODES["temp 0.7 top_p 0.95"]
    params = [
        SamplingParams(temp=temp, top_p=top_p, seed=offset_seed(seed, i), sampler="gumbel")
        for i in range(n)
    ]
    aggregate, outputs = {}, {}
    with LocalSwarm(model, n_stages, link_delay_ms=delay, draft_head=draft_head) as swarm:
        for method in methods:
            rings = [swarm.ring() for _ in range(n)]
            done: list = [None] * n

            def one(i: int, method: Method = method, rings=rings, done=done) -> None:
                try:
                    rings[i].reset(f"at-once-{i}", params[i])
                    done[i] = run_job(
                        rings[i],
                        prompts[i % len(prompts)],
                        params[i],
                        method.draft_k,
                        tokens,
                        method.adaptive,
                        method.drafts_from,
                        method.trees,
                        method.tree_drafts,
                    )
                except Exception as exc:  # reported in the row, not raised from a thread
                    done[i] = exc

            threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
            started = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            wall = time.perf_counter() - started
            for ring in rings:
                ring.close()
            failed = [str(d) for d in done if isinstance(d, Exception)]
            if failed:
                raise RuntimeError(f"{method.name}: {len(failed)} job(s) failed: {failed[0]}")
            outputs[method.name] = [d.tokens for d in done]
            aggregate[method.name] = sum(len(d.tokens) for d in done) / wall
    plain = outputs[methods[0].name]
    return {
        "hop_delay_ms": delay,
        "jobs": n,
        "aggregate_tok_s": aggregate,
        "tree_vs_chain": aggregate["tree"] / aggregate["chain"],
        "identical_to_plain": all(out == plain for out in outputs.values()),
    }


def describe(row: dict) -> str:
    parts = [
        f"{name} {v['tok_s']:.2f} tok/s ({row['vs_plain'][name]:.2f}x plain, "
        f"{v['tokens_per_round']:.2f} tok/round, {v['rows_per_round']:.1f} rows/round, "
        f"depth {v['accepted_depth']:.2f}, trees {100 * v['tree_round_share']:.0f}%)"
        for name, v in row["methods"].items()
    ]
    return (
        f"delay {row['hop_delay_ms']:g} ms, {row['mode']}, {row['kind']}: "
        + "; ".join(parts)
        + f"; tree/chain {row['tree_vs_chain']:.2f}x"
    )


def describe_at_once(row: dict) -> str:
    rates = ", ".join(f"{name} {v:.2f}" for name, v in row["aggregate_tok_s"].items())
    return (
        f"delay {row['hop_delay_ms']:g} ms, {row['jobs']} jobs at once: tok/s in all {rates}; "
        f"tree/chain {row['tree_vs_chain']:.2f}x; identical to plain {row['identical_to_plain']}"
    )
