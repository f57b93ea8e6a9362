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
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specpipe.drafting import NgramDrafter
from specpipe.generation import Generation
from specpipe.proofs.stats import entropy_bits, total_variation, two_sample_p_value
from specpipe.ring import Ring
from specpipe.sampling import SamplingParams

Progress = Callable[[int], None]


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

    def params(self, seed: int) -> SamplingParams:
        return SamplingParams(temp=self.temp, top_p=self.top_p, top_k=self.top_k, seed=seed)

    def work_units(self) -> int:
        """How many progress units a run reports at most: one per candidate stop and per stop."""
        return self.stops * self.candidates_per_stop + self.stops


class StopDrawer:
    """Draws the next token at one context through the ring, under any seed."""

    def __init__(self, ring: Ring, context: Sequence[int], cfg: SwarmProofConfig):
        self.ring, self.context, self.cfg = ring, list(context), cfg
        self.session = f"proof-{uuid.uuid4().hex[:12]}"
        ring.reset(self.session, cfg.params(cfg.seed))
        ring.round(self.session, self.context, 0, 0)  # fills every cache up to the stop

    def draw(self, seed: int, drafts: Sequence[int] = (), params: SamplingParams | None = None):
        """The result vector of one round at the stop: position len(context)."""
        self.ring.reseed(self.session, params or self.cfg.params(seed))
        tokens = [self.context[-1], *drafts]
        return self.ring.round(self.session, tokens, len(self.context) - 1, len(drafts))

    def close(self) -> None:
        self.ring.drop(self.session)


def _seeds(base: int, stream: int, n: int) -> list[int]:
    """n seeds for one purpose (stream) of one stop: 63 random bits each."""
    return np.random.default_rng([base, stream]).integers(0, 2**63, size=n).tolist()


def choose_stops(
    ring: Ring, prompts: Sequence[Sequence[int]], cfg: SwarmProofConfig, progress: Progress
) -> list[dict]:
    """Candidate positions inside real generations, ranked by pilot entropy; the best S."""
    candidates = []
    for i, prompt in enumerate(prompts):
        gen = Generation(
            ring,
            f"proof-gen-{uuid.uuid4().hex[:12]}",
            prompt,
            cfg.params(cfg.seed + i),
            max_new_tokens=cfg.generation_tokens,
            draft_k=cfg.draft_k,
        )
        generated = gen.run()
        ring.drop(gen.session)
        for j in range(1, len(generated)):
            candidates.append(list(prompt) + generated[:j])
    wanted = cfg.stops * cfg.candidates_per_stop
    if len(candidates) > wanted:  # evenly spread over every generation
        candidates = [
            candidates[i] for i in np.linspace(0, len(candidates) - 1, wanted).astype(int)
        ]
    scored = []
    for n, context in enumerate(candidates):
        drawer = StopDrawer(ring, context, cfg)
        tokens = [drawer.draw(s)[0] for s in _seeds(cfg.seed, 10_000 + n, cfg.pilot_draws)]
        drawer.close()
        counts = np.bincount(tokens).astype(np.float64)
        scored.append({"context": context, "pilot_entropy_bits": entropy_bits(counts)})
        progress(1)
    scored.sort(key=lambda c: -c["pilot_entropy_bits"])  # stable: earlier candidates win ties
    return scored[: cfg.stops]


def measure_stop(ring: Ring, index: int, stop: dict, cfg: SwarmProofConfig) -> dict:
    """All draws at one stop, and what they say."""
    context = stop["context"]
    drawer = StopDrawer(ring, context, cfg)
    try:
        greedy = drawer.draw(0, params=SamplingParams(temp=0.0))[0]
        drafter = NgramDrafter()
        drafter.extend(context)
        drafts = drafter.propose(cfg.draft_k) or [greedy]  # a model-free drafter may find none
        seeds = {
            name: _seeds(cfg.seed, 100 * index + k, cfg.draws)
            for k, name in enumerate(("plain", "spec", "floor"))
        }
        plain = [drawer.draw(s)[0] for s in seeds["plain"]]
        floor = [drawer.draw(s)[0] for s in seeds["floor"]]
        spec_results = [drawer.draw(s, drafts) for s in seeds["spec"]]
        same_seed_plain = [drawer.draw(s)[0] for s in seeds["spec"]]
    finally:
        drawer.close()
    spec = [r[0] for r in spec_results]
    # The lossy mutant: on rejection of the first draft, commit the argmax.
    mutant = [greedy if r[0] != drafts[0] else r[0] for r in spec_results]
    vocab = max(plain + floor + spec + mutant) + 1
    hist = {
        name: np.bincount(v, minlength=vocab).astype(np.float64)
        for name, v in (("plain", plain), ("floor", floor), ("spec", spec), ("mutant", mutant))
    }
    return {
        "stop": index,
        "position": len(context),
        "drafts": list(drafts),
        "entropy_bits": entropy_bits(hist["plain"] + hist["floor"]),
        "pilot_entropy_bits": stop["pilot_entropy_bits"],
        "tv_spec_vs_plain": total_variation(hist["spec"], hist["plain"]),
        "tv_plain_vs_plain": total_variation(hist["floor"], hist["plain"]),
        "p_value": two_sample_p_value(hist["spec"], hist["plain"]),
        "p_value_noise_floor": two_sample_p_value(hist["floor"], hist["plain"]),
        "tv_mutant_vs_plain": total_variation(hist["mutant"], hist["plain"]),
        "p_value_mutant": two_sample_p_value(hist["mutant"], hist["plain"]),
        "exact_pairs": len(spec),
        "exact_identical": int(sum(a == b for a, b in zip(spec, same_seed_plain, strict=True))),
        "spec_histogram": {int(t): int(c) for t, c in enumerate(hist["spec"]) if c},
        "plain_histogram": {int(t): int(c) for t, c in enumerate(hist["plain"]) if c},
        "floor_histogram": {int(t): int(c) for t, c in enumerate(hist["floor"]) if c},
    }


def run_swarm_proof(
    ring: Ring,
    prompts: Sequence[Sequence[int]],
    cfg: SwarmProofConfig,
    progress: Progress = lambda _: None,
) -> dict:
    """Run proof 2 on a ring; return `proof_2_on_swarm` and the per-stop details."""
    if not prompts or not all(prompts):
        raise ValueError("proof 2 needs at least one non-empty prompt")
    stops = choose_stops(ring, prompts, cfg, progress)
    if not stops:
        raise ValueError("the generations were too short to hold a stop")
    rows = []
    for i, stop in enumerate(stops):
        rows.append(measure_stop(ring, i, stop, cfg))
        progress(1)
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
        "alpha_per_stop": alpha_per_stop,
        "min_p_value": min(r["p_value"] for r in rows),
        "reasons": reasons,
        "mutant": {
            "name": "greedy_biased_acceptance",
            "stops_flagged": len(flagged),
            "mean_tv_vs_plain": float(np.mean([r["tv_mutant_vs_plain"] for r in rows])),
            "flagged": bool(flagged),
        },
        "exact_check": {"pairs": pairs, "identical": identical},
        "per_stop": rows,
    }
