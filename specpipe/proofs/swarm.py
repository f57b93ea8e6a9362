"""Proof 2, on the live ring: speculative draws have the plain draws' law, stop by stop.

1. Generate from each prompt and take the generated positions (never the prompt or its chat
   template, which are deterministic) as candidate stops; a short pilot of plain draws
   estimates each candidate's entropy and the highest-entropy candidates become the stops.
2. At each stop draw N tokens by plain sampling, N by speculative sampling (a real n-gram draft
   verified on the ring) and N more plain for the noise floor, every draw with its own seed,
   all through the ring. Each draw re-seeds the session and re-sends only the stop's last token
   (and the drafts), so the stages truncate their caches to the stop and recompute.
3. Per stop: entropy, TV(spec, plain), TV(plain, plain'), and a two-sample chi-square p-value.
   Bonferroni over the stops.
4. Power: a lossy mutant of the verify path (greedy-biased: on rejection it commits the argmax
   instead of the target's draw), built from the same live results, must be flagged.
5. The exact check: the coupled sampler commits what plain sampling draws for the same seed,
   so the speculative draws are repeated as plain draws with the same seeds; all must match.

Stops are independent, and so are candidates, generations and the draws at a stop: given more
rings over the same route (`lanes`), each is measured in a thread of its own, so that several
sessions are in flight and the stages batch their rounds into one forward; a stop's draws are
cut into parts, each a session of its own, so that the rings stay busy to the end. Every result
is a function of its stop and its seeds alone, so the proof says the same whatever ran beside
it, and however its draws were cut.

With `draft_head` the speculative draws verify the tail's draft head's drafts, which differ seed
by seed (drawn with the target's own Gumbel noise, so the sampler is "gumbel"). The head drafts
for the positions after the token a round commits, so each draw takes two rounds: round A
re-sends the stop's last token asking for `head_k` drafts and commits x0 at the stop; round B
sends [x0, d1 … dK] one position on and commits x1 (and more when d1 is accepted). The plain
side sends [x0] alone in round B. The law compared is the joint law of (x0, x1), pairs as
categories; the exact check compares every token round B committed with plain draws of the
same seed after x0, one round per position. The mutant is a ring whose caches keep an
earlier draw's token at the stop, so that x1 follows the wrong x0: unlike a lossy acceptance
rule, which only acts on rejected drafts, its damage does not fade as the head gets better.
Its pairs are built from live draws (each speculative x0 with the x1 of an independent plain
draw), so it costs no rounds.
A tail without a head sends no drafts: the n-gram's proposal after x0 stands in (the argmax
when it has none), and `head_rounds` says so. With `trees` (the default with the head) round A
asks the head for a tree (`proof_shape`: its chain and the next candidates at the first two
positions) and round B verifies that tree, so the law compared and the exact check cover tree
rounds as jobs run them.
"""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import numpy as np

from specpipe.core.ring import Branches, Ring, Round, RoundResult
from specpipe.core.sampling import SamplingParams, check_sampler, committed_tokens, offset_seed
from specpipe.core.tree import DraftTree, TreeShape
from specpipe.decoding.generation import Generation
from specpipe.drafting.ngram import NgramDrafter
from specpipe.proofs.stats import entropy_bits, total_variation, two_sample_p_value

Progress = Callable[[int], None]
Item = TypeVar("Item")
Outcome = TypeVar("Outcome")


@dataclass
class SwarmProofConfig:
    """Proof 2's parameters; the defaults reproduce the reference run's 12 stops × 140 draws."""

    stops: int = 12
    draws: int = 140
    temp: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    draft_k: int = 4
    seed: int = 0
    generation_tokens: int = 48
    pilot_draws: int = 16
    candidates_per_stop: int = 4
    alpha: float = 0.001
    # The speculative draws verify the tail's draft head's drafts (see the module's docstring).
    draft_head: bool = False
    # "gumbel" or "icdf"; None: "gumbel" with the draft head, whose drafts share its noise.
    sampler: str | None = None
    # With the draft head: its drafts are a tree (`proof_shape(draft_k)`), not a chain.
    trees: bool = True

    def __post_init__(self) -> None:
        if self.sampler is None:
            self.sampler = "gumbel" if self.draft_head else "icdf"
        check_sampler(self.sampler)
        if self.draft_head and self.sampler != "gumbel":
            raise ValueError(
                "the draft head's drafts share the target's noise only under the gumbel "
                f"sampler, not {self.sampler!r}"
            )

    @property
    def drafter(self) -> str:
        """Where the speculative draws' drafts come from: "head" or "ngram"."""
        return "head" if self.draft_head else "ngram"

    def params(self, seed: int) -> SamplingParams:
        return SamplingParams(
            temp=self.temp, top_p=self.top_p, top_k=self.top_k, seed=seed, sampler=self.sampler
        )

    def work_units(self) -> int:
        """How many progress units a run reports at most: one per candidate stop and per stop."""
        return self.stops * self.candidates_per_stop + self.stops


class StopDrawer:
    """Draws the next token at one context through the ring, under any seed."""

    def __init__(self, ring: Ring, context: Sequence[int], cfg: SwarmProofConfig):
        self.ring, self.context, self.cfg = ring, list(context), cfg
        self.session = f"proof-{uuid.uuid4().hex[:12]}"
        ring.reset(self.session, cfg.params(cfg.seed))
        ring.round(Round(self.session, self.context, 0))  # fills every cache up to the stop

    def draw(
        self,
        seed: int,
        drafts: Sequence[int] = (),
        params: SamplingParams | None = None,
        head_k: int = 0,
        shape: TreeShape | None = None,
    ) -> RoundResult:
        """The result vector of one round at the stop: position len(context); with `head_k`
        (or a tree's `shape`), the tail's draft head's drafts for the positions after it ride
        on the result."""
        self.ring.reseed(self.session, params or self.cfg.params(seed))
        tokens = [self.context[-1], *drafts]
        start, n = len(self.context) - 1, len(drafts)
        if shape is None:
            return self.ring.round(Round(self.session, tokens, start, n, head_k))
        return self.ring.round(
            Round(self.session, tokens, start, n, branches=Branches(shape=shape))
        )

    def follow(
        self,
        tokens: Sequence[int],
        drafts: Sequence[int] = (),
        params: SamplingParams | None = None,
        parents: Sequence[int] | None = None,
    ) -> RoundResult:
        """The result vector of a round that commits `tokens` from the stop on and verifies
        `drafts` after them (a tree under the last of them when `parents` are given), under the
        last draw's parameters unless `params`. It re-sends from the stop, which every cache
        holds since the last `draw`."""
        if params is not None:
            self.ring.reseed(self.session, params)
        sent, start = [*tokens, *drafts], len(self.context)
        branches = None if parents is None else Branches(parents=tuple(parents))
        return self.ring.round(Round(self.session, sent, start, len(drafts), branches=branches))

    def plain_run(self, seed: int, n: int, after: Sequence[int] = ()) -> list[int]:
        """n tokens drawn plainly under `seed`, one round each: from the stop on, or after the
        tokens `after` that a draw under the same seed committed there."""
        if after:
            tokens = [*after, self.follow(after, params=self.cfg.params(seed))[0]]
        else:
            tokens = [self.draw(seed)[0]]
        while len(tokens) < len(after) + n:
            tokens.append(self.follow(tokens)[0])
        return tokens[len(after) :]

    def close(self) -> None:
        self.ring.drop(self.session)


def _seeds(base: int, stream: int, n: int) -> list[int]:
    """n seeds for one purpose (stream) of one stop: 63 random bits each."""
    return np.random.default_rng([base, stream]).integers(0, 2**63, size=n).tolist()


def in_flight(
    rings: Sequence[Ring],
    work: Callable[[Ring, Item], Outcome],
    items: Sequence[Item],
    progress: Progress = lambda _: None,
) -> list[Outcome]:
    """`work(ring, item)` for every item, as many at once as there are rings (a ring is used
    by one thread at a time); the outcomes in the items' order. `progress(1)` per item done."""
    if len(rings) == 1:
        outcomes = []
        for item in items:
            outcomes.append(work(rings[0], item))
            progress(1)
        return outcomes
    free: queue.SimpleQueue[Ring] = queue.SimpleQueue()
    for ring in rings:
        free.put(ring)

    def run(item: Item) -> Outcome:
        ring = free.get()
        try:
            return work(ring, item)
        finally:
            free.put(ring)

    pool = ThreadPoolExecutor(len(rings), thread_name_prefix="proof-lane")
    try:
        futures = [pool.submit(run, item) for item in items]
        for future in as_completed(futures):
            future.result()  # the first failure ends the proof
            progress(1)
        return [future.result() for future in futures]
    finally:
        pool.shutdown(cancel_futures=True)


def _generate(ring: Ring, job: tuple[int, Sequence[int]], cfg: SwarmProofConfig) -> list[int]:
    """The tokens generated from prompt number i (its own seed)."""
    i, prompt = job
    gen = Generation(
        ring,
        f"proof-gen-{uuid.uuid4().hex[:12]}",
        prompt,
        cfg.params(offset_seed(cfg.seed, i)),
        max_new_tokens=cfg.generation_tokens,
        draft_k=cfg.draft_k,
    )
    generated = gen.run()
    ring.drop(gen.session)
    return generated


def _pilot(ring: Ring, candidate: tuple[int, list[int]], cfg: SwarmProofConfig) -> dict:
    """A few plain draws at candidate number n: its entropy estimate."""
    n, context = candidate
    drawer = StopDrawer(ring, context, cfg)
    try:
        tokens = [drawer.draw(s)[0] for s in _seeds(cfg.seed, 10_000 + n, cfg.pilot_draws)]
    finally:
        drawer.close()
    counts = np.bincount(tokens).astype(np.float64)
    return {"context": context, "pilot_entropy_bits": entropy_bits(counts)}


def choose_stops(
    rings: Sequence[Ring],
    prompts: Sequence[Sequence[int]],
    cfg: SwarmProofConfig,
    progress: Progress,
) -> list[dict]:
    """Candidate positions inside real generations, ranked by pilot entropy; the best S."""
    generations = in_flight(rings, partial(_generate, cfg=cfg), list(enumerate(prompts)))
    candidates = []
    for prompt, generated in zip(prompts, generations, strict=True):
        for j in range(1, len(generated)):
            candidates.append(list(prompt) + generated[:j])
    wanted = cfg.stops * cfg.candidates_per_stop
    if len(candidates) > wanted:  # evenly spread over every generation
        candidates = [
            candidates[i] for i in np.linspace(0, len(candidates) - 1, wanted).astype(int)
        ]
    scored = in_flight(rings, partial(_pilot, cfg=cfg), list(enumerate(candidates)), progress)
    scored.sort(key=lambda c: -c["pilot_entropy_bits"])  # stable: earlier candidates win ties
    return scored[: cfg.stops]


def _histograms(samples: dict[str, list]) -> tuple[list, dict[str, np.ndarray]]:
    """The categories seen in any sample (tokens, or pairs of tokens), sorted, and each
    sample's counts over them."""
    categories = sorted({c for values in samples.values() for c in values})
    index = {c: i for i, c in enumerate(categories)}
    return categories, {
        name: np.bincount([index[c] for c in values], minlength=len(categories)).astype(np.float64)
        for name, values in samples.items()
    }


def _compare(samples: dict[str, list], label: Callable = int) -> dict:
    """What the plain, floor, spec and mutant samples of one stop say about their laws."""
    categories, hist = _histograms(samples)

    def counts(name: str) -> dict:
        return {label(c): int(n) for c, n in zip(categories, hist[name], strict=True) if n}

    return {
        "entropy_bits": entropy_bits(hist["plain"] + hist["floor"]),
        "tv_spec_vs_plain": total_variation(hist["spec"], hist["plain"]),
        "tv_plain_vs_plain": total_variation(hist["floor"], hist["plain"]),
        "p_value": two_sample_p_value(hist["spec"], hist["plain"]),
        "p_value_noise_floor": two_sample_p_value(hist["floor"], hist["plain"]),
        "tv_mutant_vs_plain": total_variation(hist["mutant"], hist["plain"]),
        "p_value_mutant": two_sample_p_value(hist["mutant"], hist["plain"]),
        "spec_histogram": counts("spec"),
        "plain_histogram": counts("plain"),
        "floor_histogram": counts("floor"),
    }


def _stop_seeds(cfg: SwarmProofConfig, index: int, part: slice) -> dict[str, list[int]]:
    """The seeds of one stop's draws, each purpose its own stream; `part`: the draws wanted."""
    return {
        name: _seeds(cfg.seed, 100 * index + k, cfg.draws)[part]
        for k, name in enumerate(("plain", "spec", "floor"))
    }


def _fixed_drafts(context: Sequence[int], k: int, argmax: Callable[[], int]) -> list[int]:
    """The n-gram drafter's proposal after `context`, else the target's argmax there."""
    drafter = NgramDrafter()
    drafter.extend(context)
    return drafter.propose(k) or [argmax()]  # a model-free drafter may find none


def draw_stop(ring: Ring, index: int, stop: dict, cfg: SwarmProofConfig, part: slice) -> dict:
    """The draws numbered `part` at one stop: plain, floor, speculative (verifying the n-gram's
    fixed drafts) and the mutant's, and how many same-seed pairs were identical."""
    context = stop["context"]
    drawer = StopDrawer(ring, context, cfg)
    try:
        greedy = drawer.draw(0, params=SamplingParams(temp=0.0))[0]
        drafts = _fixed_drafts(context, cfg.draft_k, lambda: greedy)
        seeds = _stop_seeds(cfg, index, part)
        plain = [drawer.draw(s)[0] for s in seeds["plain"]]
        floor = [drawer.draw(s)[0] for s in seeds["floor"]]
        spec_results = [drawer.draw(s, drafts) for s in seeds["spec"]]
        same_seed_plain = [drawer.draw(s)[0] for s in seeds["spec"]]
    finally:
        drawer.close()
    spec = [r[0] for r in spec_results]
    return {
        "drafts": drafts,
        "plain": plain,
        "floor": floor,
        "spec": spec,
        # The lossy mutant: on rejection of the first draft, commit the argmax.
        "mutant": [greedy if r[0] != drafts[0] else r[0] for r in spec_results],
        "exact_pairs": len(spec),
        "exact_identical": int(sum(a == b for a, b in zip(spec, same_seed_plain, strict=True))),
    }


def draw_head_stop(ring: Ring, index: int, stop: dict, cfg: SwarmProofConfig, part: slice) -> dict:
    """The draws numbered `part` at one stop with the tail's draft head (see the module's
    docstring): pairs (x0, x1) plain, floor, speculative and the mutant's, the exact check over
    every committed token, the head's acceptance."""
    context = stop["context"]
    drawer = StopDrawer(ring, context, cfg)
    argmax_after: dict[int, int] = {}

    def argmax_after_token(x0: int) -> int:
        """The target's argmax one position past the stop, once x0 is committed there."""
        if x0 not in argmax_after:
            argmax_after[x0] = drawer.follow([x0], params=SamplingParams(temp=0.0))[0]
        return argmax_after[x0]

    seeds = _stop_seeds(cfg, index, part)
    shape = proof_shape(cfg.draft_k) if cfg.trees else None
    spec, exact_identical = [], 0
    head_rounds = tree_rounds = drafted = accepted = first_accepted = 0
    try:
        plain = [tuple(drawer.plain_run(s, 2)) for s in seeds["plain"]]
        floor = [tuple(drawer.plain_run(s, 2)) for s in seeds["floor"]]
        for s in seeds["spec"]:
            first = drawer.draw(s, head_k=cfg.draft_k, shape=shape)
            x0, tree = first[0], first.draft_tree
            from_head = bool(tree.tokens)
            if not from_head:
                drafts = _fixed_drafts([*context, x0], cfg.draft_k, partial(argmax_after_token, x0))
                tree = DraftTree.chain(drafts)
            if tree.is_chain:
                drafts = list(tree.tokens)
                result = drawer.follow([x0], drafts, params=cfg.params(s))
                committed = committed_tokens(drafts, result)
            else:
                result = drawer.follow([x0], tree.tokens, cfg.params(s), tree.parents)
                committed = [t for t in result if t >= 0]
                tree_rounds += 1
            spec.append((x0, committed[0]))
            if from_head:
                head_rounds += 1
                drafted += len(tree.tokens)
                accepted += len(committed) - 1
                first_accepted += len(committed) > 1
            # x0 was a plain draw (its round verified nothing): the check starts after it.
            exact_identical += drawer.plain_run(s, len(committed), after=[x0]) == committed
    finally:
        drawer.close()
    return {
        "plain": plain,
        "floor": floor,
        "spec": spec,
        # The lossy mutant: a ring whose caches keep an earlier draw's token at the stop (a
        # truncation that fails), so x1 follows the wrong x0. It changes the pair's law however
        # often the head is right, unlike an acceptance rule that a good head rarely gets to
        # break. Its draws need no rounds of their own: the noise floor's x1 followed the
        # floor's own x0, a draw independent of the speculative x0 it is paired with here.
        "mutant": [(x0, other[1]) for (x0, _), other in zip(spec, floor, strict=True)],
        "exact_pairs": len(spec),
        "exact_identical": int(exact_identical),
        "head_rounds": head_rounds,
        "head_tree_rounds": tree_rounds,
        "head_drafted": drafted,
        "head_accepted": accepted,
        "head_first_accepted": int(first_accepted),
    }


SAMPLES = ("plain", "floor", "spec", "mutant")


def stop_row(index: int, stop: dict, parts: Sequence[dict], pairs: bool) -> dict:
    """What one stop's draws (its parts, in order) say: the laws compared, the exact check and
    the counts; `pairs`: the samples are pairs of tokens (the head's proof)."""
    samples = {name: [value for part in parts for value in part[name]] for name in SAMPLES}
    counted = {
        key: sum(part[key] for part in parts)
        for key in parts[0]
        if key not in SAMPLES and key != "drafts"
    }
    label = (lambda pair: f"{pair[0]} {pair[1]}") if pairs else int
    return {
        "stop": index,
        "position": len(stop["context"]),
        **({} if pairs else {"drafts": list(parts[0]["drafts"])}),
        "pilot_entropy_bits": stop["pilot_entropy_bits"],
        **_compare(samples, label=label),
        **counted,
    }


def split_draws(draws: int, stops: int, rings: int) -> list[slice]:
    """Each stop's draws cut into parts, each measured in a session of its own, so that about
    three parts per ring wait to be measured: the rings stay busy until the last few parts,
    whichever stops ran long (the head's draws take a round more per accepted draft)."""
    n = max(1, min(draws, -(-3 * rings // stops))) if rings > 1 else 1
    bounds = np.linspace(0, draws, n + 1).astype(int).tolist()
    return [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True) if hi > lo]


def run_swarm_proof(
    ring: Ring,
    prompts: Sequence[Sequence[int]],
    cfg: SwarmProofConfig,
    progress: Progress = lambda _: None,
    lanes: Sequence[Ring] = (),
) -> dict:
    """Run proof 2 on a ring; return `proof_2_on_swarm` and the per-stop details. `lanes`:
    more rings over the same route, each driven by a thread of its own beside the first, so
    that stops (and candidates, and generations) are measured in flight together."""
    if not prompts or not all(prompts):
        raise ValueError("proof 2 needs at least one non-empty prompt")
    rings = [ring, *lanes]
    stops = choose_stops(rings, prompts, cfg, progress)
    if not stops:
        raise ValueError("the generations were too short to hold a stop")
    draw = draw_head_stop if cfg.draft_head else draw_stop
    parts = split_draws(cfg.draws, len(stops), len(rings))
    parts_left, counting = [len(parts)] * len(stops), threading.Lock()

    def measure(lane: Ring, job: tuple[int, dict, slice]) -> dict:
        index, stop, part = job
        drawn = draw(lane, index, stop, cfg, part)
        with counting:  # progress counts stops: one when its last part is drawn
            parts_left[index] -= 1
            if not parts_left[index]:
                progress(1)
        return drawn

    jobs = [(index, stop, part) for index, stop in enumerate(stops) for part in parts]
    drawn = in_flight(rings, measure, jobs)
    rows = [
        stop_row(index, stop, drawn[index * len(parts) : (index + 1) * len(parts)], cfg.draft_head)
        for index, stop in enumerate(stops)
    ]
    alpha_per_stop = cfg.alpha / len(rows)
    failing = [r["stop"] for r in rows if r["p_value"] <= alpha_per_stop]
    flagged = [r["stop"] for r in rows if r["p_value_mutant"] <= alpha_per_stop]
    pairs = sum(r["exact_pairs"] for r in rows)
    identical = sum(r["exact_identical"] for r in rows)
    reasons = []
    if failing:
        reasons.append(f"spec differs from plain at stops {failing}")
    if identical != pairs:
        reasons.append(f"{pairs - identical} of {pairs} same-seed draws differ")
    if not flagged:
        reasons.append("the lossy mutant was not flagged: the test showed no power")
    entropies = [r["entropy_bits"] for r in rows]
    return {
        "proof_2_on_swarm": {
            "temp": cfg.temp,
            "top_p": cfg.top_p,
            "draws_per_mode_per_stop": cfg.draws,
            "stops": len(rows),
            "high_entropy_stops_ge_1bit": sum(e >= 1 for e in entropies),
            "max_entropy_bits": max(entropies),
            "mean_tv_spec_vs_plain": float(np.mean([r["tv_spec_vs_plain"] for r in rows])),
            "mean_tv_noise_floor_plain_vs_plain": float(
                np.mean([r["tv_plain_vs_plain"] for r in rows])
            ),
            "verdict": "FAIL" if reasons else "PASS",
        },
        "top_k": cfg.top_k,
        "draft_k": cfg.draft_k,
        "sampler": cfg.sampler,
        "drafter": cfg.drafter,
        # The head's drafts were trees (`proof_shape`), not chains.
        "draft_trees": bool(cfg.draft_head and cfg.trees),
        # What each stop's law is over: the token at the stop, or with the head the pair of
        # tokens at the stop and after it.
        "law": "pair" if cfg.draft_head else "token",
        "alpha_per_stop": alpha_per_stop,
        "min_p_value": min(r["p_value"] for r in rows),
        "reasons": reasons,
        "mutant": {
            "name": "stale_token_at_stop" if cfg.draft_head else "greedy_biased_acceptance",
            "stops_flagged": len(flagged),
            "mean_tv_vs_plain": float(np.mean([r["tv_mutant_vs_plain"] for r in rows])),
            "flagged": bool(flagged),
        },
        "exact_check": {"pairs": pairs, "identical": identical},
        **({"head": _head_summary(rows)} if cfg.draft_head else {}),
        "per_stop": rows,
    }


def proof_shape(k: int) -> TreeShape:
    """The tree proof 2's head draws verify: the head's chain of k, its next two candidates at
    the first position and its next one at the second, where a walk that took a sibling after
    a miss, or kept the wrong branch, would show."""
    parents, ranks = list(range(k)), [0] * k
    parents += [0, 0] + ([1] if k >= 2 else [])
    ranks += [1, 2] + ([1] if k >= 2 else [])
    return TreeShape(tuple(parents), tuple(ranks))


def _head_summary(rows: list[dict]) -> dict:
    """The draft head's part over every stop: how many speculative draws it drafted for (0: the
    tail has no head, and the n-gram stood in) and how many of its drafts were accepted."""
    total = {
        name: sum(r[f"head_{name}"] for r in rows)
        for name in ("rounds", "tree_rounds", "drafted", "accepted", "first_accepted")
    }
    return {
        **total,
        "draws": sum(r["exact_pairs"] for r in rows),
        "acceptance": total["accepted"] / total["drafted"] if total["drafted"] else 0.0,
        "first_draft_acceptance": (
            total["first_accepted"] / total["rounds"] if total["rounds"] else 0.0
        ),
    }
