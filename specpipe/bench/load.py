"""The load benchmark: several jobs at once through one ring of real stage processes.

For each link delay, a `LocalSwarm` (N `specpipe worker stage` processes on a private Redis)
runs 1, 2, 4, … jobs at the same time (1: every job of the largest count, one after another),
each a session of its own driven by its own thread and
`RedisRing`, as the coordinator's threads drive them. Each job is a different open-ended prompt
with a seed of its own, sampled at the given temperature with the n-gram drafter and, as the
coordinator runs a job, each round's draft length chosen up to draft_k (`adaptive`; off, every
round sends what the drafter has, up to draft_k). Reported per
count: aggregate tok/s (every job's new tokens over the wall time from the first start to the
last end), p50 / p95 of time to first token (the prefill round) and of time to done, each
stage's mean batch size (rounds per forward over the run, from the stages' own counters), and
the exactness check: every job's tokens equal its solo run in one process.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specpipe.bench.ring_hops import LocalSwarm
from specpipe.core.sampling import SamplingParams, offset_seed
from specpipe.decoding.generation import Generation
from specpipe.decoding.local_ring import LocalRing
from specpipe.decoding.target import open_target
from specpipe.drafting.sources import named_sources

PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe a city on Mars a hundred years from now.",
    "Invent a new board game and explain its rules.",
    "Write a letter from a cat to its owner.",
    "Tell the history of a made-up island nation.",
    "Describe the taste of a fruit nobody has eaten before.",
    "Write a poem about a train that never arrives.",
    "Explain how a dragon might run a bakery.",
)

Log = Callable[[str], None]
STATS_SETTLE_S = 1.5  # the bench's stages write their counters every second


@dataclass
class JobTiming:
    """One job of a load run: its tokens and when its milestones came."""

    tokens: list[int]
    first_token_s: float  # from its start to the end of its prefill round
    done_s: float  # from its start to its last round
    rounds: int = 0
    head_rounds: int = 0  # rounds whose drafts the tail's draft head proposed
    drafted: int = 0  # draft rows sent (a tree's every row)
    accepted: int = 0  # drafts committed
    tree_rounds: int = 0  # rounds that carried a draft tree


def job_requests(n: int, seed: int) -> list[tuple[str, int]]:
    """The n jobs of a run: (prompt, seed), a different prompt and seed each."""
    return [(PROMPTS[i % len(PROMPTS)], offset_seed(seed, i)) for i in range(n)]


def run_job(
    ring,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    draft_k: int,
    max_new_tokens: int,
    adaptive: bool = False,
    drafts_from: str = "both",
    trees: bool = False,
    tree_drafts: int = 0,
) -> JobTiming:
    """One job to its end on `ring`, timed; `adaptive` chooses each round's K up to draft_k,
    `trees` lets the head propose draft trees (of `tree_drafts` drafts each, when not 0)."""
    generation = Generation(
        ring,
        f"load-{uuid.uuid4().hex[:10]}",
        prompt_ids,
        params,
        max_new_tokens=max_new_tokens,
        draft_k=draft_k,
        adaptive=adaptive,
        sources=named_sources(drafts_from, params),
        trees=trees,
        tree_drafts=tree_drafts,
    )
    started = time.perf_counter()
    first = None
    for _ in generation.rounds():
        first = first if first is not None else time.perf_counter() - started
    done = time.perf_counter() - started
    ring.drop(generation.session)
    stats = generation.stats
    return JobTiming(
        generation.generated,
        first or done,
        done,
        stats.rounds,
        stats.head_rounds,
        stats.drafted,
        stats.accepted,
        stats.tree_rounds,
    )


def solo_tokens(
    model: str,
    requests: Sequence[tuple[str, int]],
    temp: float,
    top_p: float,
    draft_k: int,
    max_new_tokens: int,
) -> list[list[int]]:
    """Each job's tokens run alone in this process: what every loaded run must give."""
    target = open_target(model)
    ring = LocalRing(target.load_stages(1))
    out = []
    for prompt, seed in requests:
        params = SamplingParams(temp=temp, top_p=top_p, seed=seed)
        ring.reset("solo", params)
        out.append(run_job(ring, target.prompt_ids(prompt), params, draft_k, max_new_tokens).tokens)
    return out


def load(
    model: str,
    n_stages: int,
    counts: Sequence[int],
    delays: Sequence[float],
    tokens: int,
    temp: float,
    top_p: float,
    draft_k: int,
    seed: int,
    log: Log,
    adaptive: bool = True,
) -> dict:
    """Every (delay, job count) run; see the module docstring."""
    target = open_target(model)
    requests = job_requests(max(counts), seed)
    log(f"solo runs of {len(requests)} jobs in one process (the exactness reference)")
    expected = solo_tokens(model, requests, temp, top_p, draft_k, tokens)
    results = []
    for delay in delays:
        with LocalSwarm(model, n_stages, link_delay_ms=delay) as swarm:
            for n in counts:
                # One job alone is every job of the run, one after another: the same prompts
                # as the loaded runs', and a mean over them rather than one prompt's luck.
                jobs = len(requests) if n == 1 else n
                row = _loaded_run(
                    swarm,
                    target,
                    requests[:jobs],
                    expected[:jobs],
                    temp,
                    top_p,
                    draft_k,
                    tokens,
                    adaptive,
                    at_once=n > 1,
                )
                row["hop_delay_ms"] = delay
                results.append(row)
                log(_describe(row))
    for row in results:  # the ratio against one job alone at the same delay
        alone = next(r for r in results if r["hop_delay_ms"] == row["hop_delay_ms"])
        row["aggregate_vs_one"] = row["aggregate_tok_s"] / alone["aggregate_tok_s"]
    return {
        "model": target.name,
        "stages": n_stages,
        "tokens": tokens,
        "temp": temp,
        "draft_k": draft_k,
        "adaptive": adaptive,
        "runs": results,
    }


def _loaded_run(
    swarm: LocalSwarm,
    target,
    requests,
    expected,
    temp,
    top_p,
    draft_k,
    tokens,
    adaptive,
    at_once: bool = True,
) -> dict:
    timings: list[JobTiming | BaseException | None] = [None] * len(requests)
    rings = [swarm.ring() for _ in requests]

    def one(i: int) -> None:
        prompt, seed = requests[i]
        params = SamplingParams(temp=temp, top_p=top_p, seed=seed)
        try:
            rings[i].reset(f"load-{i}", params)
            timings[i] = run_job(
                rings[i], target.prompt_ids(prompt), params, draft_k, tokens, adaptive
            )
        except BaseException as exc:  # reported in the row, not raised from a thread
            timings[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    before = _settled_stats(swarm)
    started = time.perf_counter()
    for thread in threads:
        thread.start()
        if not at_once:
            thread.join()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    for ring in rings:
        ring.close()
    failed = [str(t) for t in timings if not isinstance(t, JobTiming)]
    done = [t for t in timings if isinstance(t, JobTiming)]
    new_tokens = sum(len(t.tokens) for t in done)
    return {
        "jobs": len(requests) if at_once else 1,
        "one_at_a_time": 0 if at_once else len(requests),
        "failed": failed,
        "aggregate_tok_s": new_tokens / wall,
        "wall_s": wall,
        "first_token_s": _percentiles([t.first_token_s for t in done]),
        "done_s": _percentiles([t.done_s for t in done]),
        "identical_to_solo": not failed
        and all(t.tokens == want for t, want in zip(done, expected, strict=True)),
        "stage_batch_size": _batch_sizes(before, _settled_stats(swarm)),
    }


def _settled_stats(swarm: LocalSwarm) -> list[dict[str, float]]:
    time.sleep(STATS_SETTLE_S)
    return swarm.stage_stats()


def _batch_sizes(before: list[dict], after: list[dict]) -> list[float | None]:
    """Per stage, the rounds it processed between two readings over the forwards they took."""
    sizes = []
    for old, new in zip(before, after, strict=True):
        rounds = new.get("processed", 0) - old.get("processed", 0)
        forwards = new.get("forwards", 0) - old.get("forwards", 0)
        sizes.append(round(rounds / forwards, 2) if forwards else None)
    return sizes


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p95": float("nan")}
    if len(values) == 1:
        return {"p50": values[0], "p95": values[0]}
    cuts = statistics.quantiles(values, n=20, method="inclusive")
    return {"p50": statistics.median(values), "p95": cuts[18]}


def _describe(row: dict) -> str:
    return (
        f"delay {row['hop_delay_ms']:g} ms, {row['jobs']} job(s)"
        + (f" ({row['one_at_a_time']} one at a time)" if row["one_at_a_time"] else "")
        + f": {row['aggregate_tok_s']:.2f} "
        f"tok/s in all; first token p50 {row['first_token_s']['p50']:.2f} s, p95 "
        f"{row['first_token_s']['p95']:.2f} s; done p50 {row['done_s']['p50']:.2f} s, p95 "
        f"{row['done_s']['p95']:.2f} s; batch per stage {row['stage_batch_size']}; "
        f"identical to solo {row['identical_to_solo']}"
        + (f"; FAILED {len(row['failed'])}: {row['failed'][0]}" if row["failed"] else "")
    )


# The adaptive-K comparison: (name, draft_k, adaptive) of each way a job is run.
@dataclass(frozen=True)
class Method:
    """One way of running a job in a side-by-side comparison."""

    name: str
    draft_k: int  # 0: plain decoding
    adaptive: bool = False  # choose each round's K up to draft_k
    drafts_from: str = "both"  # see `specpipe.drafting.sources.DRAFT_SOURCES`
    trees: bool = False  # the head proposes draft trees (with adaptive)
    tree_drafts: int = 0  # with trees: 0, each tree sized by its cost; N, N drafts every time


def k_methods(fixed: Sequence[int], max_k: int) -> list[Method]:
    """Plain decoding, each fixed K, and the adaptive rule up to `max_k`."""
    methods = [Method("plain", 0)]
    methods += [Method(f"K={k}", k) for k in sorted(set(fixed)) if k > 0]
    return methods + [Method(f"adaptive<={max_k}", max_k, True)]


def source_methods(max_k: int) -> list[Method]:
    """Plain decoding, and adaptive K up to `max_k` with drafts from each source."""
    return [Method("plain", 0)] + [
        Method(source, max_k, True, source) for source in ("ngram", "head", "both")
    ]


def side_by_side(
    model: str,
    n_stages: int,
    delay: float,
    prompts: dict[str, Sequence[list[int]]],
    methods: Sequence[Method],
    params_for: Callable[[int], SamplingParams],
    tokens: int,
    repeats: int,
    log: Log,
    draft_head: str | None = None,
) -> tuple[dict[str, dict[str, dict[str, float]]], bool]:
    """Every method on every kind of prompt, one job at a time on real stage processes at one
    link delay; a kind's prompts are taken in turn, one a repeat. The methods of a (prompt,
    repeat) run back to back with the same sampling parameters
    (`params_for(repeat)`), in an order that rotates, so a machine's drift touches them alike.
    Per prompt kind and method: tok/s (all its tokens over all its time), tokens per round,
    the share of rounds the draft head proposed, rows per round (the root and the drafts),
    accepted depth (drafts committed per round) and the share of rounds that carried a tree;
    and whether every method gave plain's tokens."""
    totals = {(kind, m.name): [0, 0.0, 0, 0, 0, 0, 0] for kind in prompts for m in methods}
    exact = True
    with LocalSwarm(model, n_stages, link_delay_ms=delay, draft_head=draft_head) as swarm:
        ring = swarm.ring()
        try:
            for r in range(repeats):
                params = params_for(r)
                for kind, kind_prompts in prompts.items():
                    prompt_ids = kind_prompts[r % len(kind_prompts)]
                    order = list(methods[r % len(methods) :]) + list(methods[: r % len(methods)])
                    outputs = {}
                    for method in order:
                        ring.reset("side-by-side", params)
                        timing = run_job(
                            ring,
                            prompt_ids,
                            params,
                            method.draft_k,
                            tokens,
                            method.adaptive,
                            method.drafts_from,
                            method.trees,
                            method.tree_drafts,
                        )
                        outputs[method.name] = timing.tokens
                        total = totals[(kind, method.name)]
                        total[0] += len(timing.tokens)
                        total[1] += timing.done_s
                        total[2] += timing.rounds
                        total[3] += timing.head_rounds
                        total[4] += timing.drafted
                        total[5] += timing.accepted
                        total[6] += timing.tree_rounds
                    same = all(t == outputs[methods[0].name] for t in outputs.values())
                    exact = exact and same
                    log(
                        f"delay {delay:g} ms, {kind}, seed {params.seed}: identical to "
                        f"{methods[0].name} {same}"
                    )
        finally:
            ring.close()
    out: dict[str, dict[str, dict[str, float]]] = {}
    for kind in prompts:
        out[kind] = {}
        for m in methods:
            n, seconds, rounds, head_rounds, drafted, accepted, trees = totals[(kind, m.name)]
            out[kind][m.name] = {
                "tok_s": n / seconds if seconds else 0.0,
                "tokens_per_round": n / max(rounds, 1),
                "head_round_share": head_rounds / max(rounds, 1),
                "rows_per_round": 1 + drafted / max(rounds, 1),
                "accepted_depth": accepted / max(rounds, 1),
                "tree_round_share": trees / max(rounds, 1),
            }
    return out, exact


def adaptive_k(
    model: str,
    n_stages: int,
    delays: Sequence[float],
    fixed: Sequence[int],
    max_k: int,
    tokens: int,
    temp: float,
    top_p: float,
    seed: int,
    repeats: int,
    log: Log,
) -> dict:
    """Adaptive K against plain and fixed K on grounded and novel prompts at each link delay
    (`side_by_side`): tok/s, the ratios to plain and to the best fixed K, tokens per round;
    every method's tokens must equal plain's (the same seed)."""
    from specpipe.bench.ring_hops import GROUNDED_PROMPT, NOVEL_PROMPT

    target = open_target(model)
    methods = k_methods(fixed, max_k)
    prompts = {
        "grounded": [target.prompt_ids(GROUNDED_PROMPT)],
        "novel": [target.prompt_ids(NOVEL_PROMPT)],
    }
    rows, exact = [], True
    for delay in delays:
        measured, same = side_by_side(
            model,
            n_stages,
            delay,
            prompts,
            methods,
            lambda r: SamplingParams(temp=temp, top_p=top_p, seed=offset_seed(seed, r)),
            tokens,
            repeats,
            log,
        )
        exact = exact and same
        for kind, by_method in measured.items():
            rates = {name: v["tok_s"] for name, v in by_method.items()}
            plain = rates["plain"]
            best_fixed = max(v for name, v in rates.items() if name.startswith("K="))
            adaptive = rates[methods[-1].name]
            row = {
                "hop_delay_ms": delay,
                "kind": kind,
                "tok_s": rates,
                "tokens_per_round": {n: v["tokens_per_round"] for n, v in by_method.items()},
                "vs_plain": {name: v / plain for name, v in rates.items()},
                "adaptive_vs_best_fixed": adaptive / best_fixed,
            }
            rows.append(row)
            log(_describe_k(row))
    return {
        "model": target.name,
        "stages": n_stages,
        "tokens": tokens,
        "temp": temp,
        "repeats": repeats,
        "identical_to_plain": exact,
        "runs": rows,
    }


# The draft head's sampling modes: greedy, and a temperature under the Gumbel sampler, whose
# noise the head drafts with.
HEAD_MODES = {"greedy": (0.0, 1.0), "temp 0.7 top_p 0.95": (0.7, 0.95)}


def draft_sources(
    model: str,
    n_stages: int,
    delays: Sequence[float],
    max_k: int,
    tokens: int,
    seed: int,
    repeats: int,
    log: Log,
    draft_head: str | None = None,
) -> dict:
    """The tail's draft head (`draft_head`, or the model's shipped one) against the n-gram
    drafter and both together, each with adaptive K, against plain decoding: greedy and at
    temp 0.7 / top_p 0.95 (Gumbel sampler), on a grounded and a novel prompt, at each link
    delay (`side_by_side`)."""
    rows, exact = head_modes(
        model, n_stages, delays, source_methods(max_k), tokens, seed, repeats, log, draft_head
    )
    for row in rows:
        log(_describe_sources(row))
    return {
        "model": open_target(model).name,
        "stages": n_stages,
        "tokens": tokens,
        "max_k": max_k,
        "repeats": repeats,
        "identical_to_plain": exact,
        "runs": rows,
    }


def head_modes(
    model: str,
    n_stages: int,
    delays: Sequence[float],
    methods: Sequence[Method],
    tokens: int,
    seed: int,
    repeats: int,
    log: Log,
    draft_head: str | None = None,
) -> tuple[list[dict], bool]:
    """`methods` side by side (plain first) greedy and at temp 0.7 / top_p 0.95 (Gumbel
    sampler), on a grounded prompt and on novel ones, at each link delay: a row per (delay,
    mode, kind of prompt) with each method's figures and its tok/s against plain; and whether
    every method gave plain's tokens."""
    from specpipe.bench.ring_hops import GROUNDED_PROMPT, NOVEL_PROMPT
    from specpipe.drafting.train import EVAL_PROMPTS

    target = open_target(model)
    # Novel: prompts the head never read, nor anything about their subjects, one a repeat.
    novel = (NOVEL_PROMPT, *EVAL_PROMPTS)
    prompts = {
        "grounded": [target.prompt_ids(GROUNDED_PROMPT)],
        "novel": [target.prompt_ids(p) for p in novel],
    }
    rows, exact = [], True
    for delay in delays:
        for mode, (temp, top_p) in HEAD_MODES.items():
            measured, same = side_by_side(
                model,
                n_stages,
                delay,
                prompts,
                methods,
                lambda r, t=temp, p=top_p: SamplingParams(
                    temp=t, top_p=p, seed=offset_seed(seed, r), sampler="gumbel"
                ),
                tokens,
                repeats,
                log,
                draft_head,
            )
            exact = exact and same
            for kind, by_method in measured.items():
                plain = by_method["plain"]["tok_s"]
                rows.append(
                    {
                        "hop_delay_ms": delay,
                        "mode": mode,
                        "kind": kind,
                        "methods": by_method,
                        "vs_plain": {n: v["tok_s"] / plain for n, v in by_method.items()},
                    }
                )
    return rows, exact


def _describe_sources(row: dict) -> str:
    parts = [
        f"{name} {v['tok_s']:.2f} tok/s ({row['vs_plain'][name]:.2f}x, "
        f"{v['tokens_per_round']:.2f} tok/round, head {100 * v['head_round_share']:.0f}%)"
        for name, v in row["methods"].items()
    ]
    return f"delay {row['hop_delay_ms']:g} ms, {row['mode']}, {row['kind']}: " + "; ".join(parts)


def _describe_k(row: dict) -> str:
    rates = ", ".join(f"{name} {v:.2f}" for name, v in row["tok_s"].items())
    ratios = ", ".join(f"{name} {v:.2f}x" for name, v in row["vs_plain"].items() if name != "plain")
    return (
        f"delay {row['hop_delay_ms']:g} ms, {row['kind']}: tok/s {rates}; vs plain {ratios}; "
        f"adaptive vs best fixed {row['adaptive_vs_best_fixed']:.2f}x; tokens per round "
        + ", ".join(f"{name} {v:.2f}" for name, v in row["tokens_per_round"].items())
    )
