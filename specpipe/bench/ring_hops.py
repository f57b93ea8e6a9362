"""The ring benchmarks: a model as N real stage processes on this machine, over Redis Streams.

- Overhead: the same plain greedy generation through N `specpipe worker stage` processes and
  through the same model in one process, in lockstep (a round of one, then the same round of the
  other); the median over rounds of (ring round - local round) / (N + 1) is the cost of one hop
  (a round makes N + 1: coordinator -> stage 0 -> … -> tail -> coordinator), with a ~95%
  interval. It is split three ways: cutting the model into N stages (the N stages in one
  process, against the whole model), the stages' forwards running slower in N processes (their
  own running means, against that one-process split), and the rest: the transport, waking each
  process, checking, encoding and decoding messages, which is what a hop adds around the
  forward.
- Latency: every link delayed by D ms (each stage and the coordinator wait D before sending),
  speculative against plain on an input-grounded and on an open-ended prompt, with tokens per
  round and the latency ceiling (tokens per round / ring latency, the tok/s a round trip allows
  when compute is free).
- Exactness: speculative and plain generations through the ring must give the same tokens for
  every (prompt, seed), and greedy through the ring the same tokens as in one process.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import redis

from specpipe.core.ring import Ring
from specpipe.core.sampling import SamplingParams
from specpipe.decoding.generation import Generation
from specpipe.decoding.local_ring import LocalRing
from specpipe.decoding.target import open_target
from specpipe.ops import roster
from specpipe.ops.link_delay import DelayedRing
from specpipe.ops.redis_server import RedisServer
from specpipe.ops.supervisor import terminate_all
from specpipe.settings import COORDINATOR_PUB_FILE, Settings
from specpipe.swarm import inventory, streams, trust
from specpipe.swarm.redis_ring import RedisRing
from specpipe.transformer.resolve import even_split

GROUNDED_PROMPT = (
    "Repeat the following text exactly, word for word:\n\n"
    "The Amazon rainforest covers much of the Amazon basin of South America. The basin covers "
    "seven million square kilometres, of which five and a half million are covered by the "
    "rainforest. The region includes territory belonging to nine nations. The majority of the "
    "forest is contained within Brazil, with 60% of the rainforest, followed by Peru with 13%, "
    "and Colombia with 10%."
)
NOVEL_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
EXACT_PROMPTS = (
    GROUNDED_PROMPT,
    NOVEL_PROMPT,
    "Explain why the sky is blue to a ten-year-old.",
    "List five uses for a paperclip.",
    "Summarise: The cat sat on the mat. The dog sat on the rug. They were both happy.",
)

Log = Callable[[str], None]
STATS_FLUSH_S = 2.5  # more than a bench stage's heartbeat (1 s) plus its read timeout (1 s)


class LocalSwarm:
    """N `specpipe worker stage` processes of one model on a private Redis (context manager),
    with host identities as `specpipe up` runs them: each stage signs with its own key, and
    this process, the coordinator, with the coordinator's (all in a folder of its own)."""

    def __init__(
        self,
        model: str,
        n_stages: int,
        link_delay_ms: float = 0.0,
        threads: int = 1,
        draft_head: str | None = None,
    ) -> None:
        self.model, self.n_stages = model, n_stages
        self.draft_head = draft_head  # the tail's (`worker stage --draft-head`); None: default
        self.link_delay_ms, self.threads = link_delay_ms, threads
        self.swarm = f"bench{uuid.uuid4().hex[:8]}"
        self.key = secrets.token_hex(32)
        self.redis = RedisServer()
        self.procs: list[subprocess.Popen] = []
        self.home = Path(tempfile.mkdtemp(prefix="specpipe-bench-"))

    def __enter__(self) -> LocalSwarm:
        self.url = self.redis.start()
        self.data_url = self.redis.socket_url or self.url  # the streams' Redis, as in `up`
        target = open_target(self.model)
        self.n_layers, self.model_label = target.n_layers, target.name
        client = redis.Redis.from_url(self.url)
        try:
            hosts = [f"s{i}" for i in range(self.n_stages)]
            roster.admit_own_hosts(client, self.swarm, hosts, self.home)
        finally:
            client.close()
        self.pin = (self.home / COORDINATOR_PUB_FILE).read_text().strip()
        env = {
            **os.environ,
            "SPECPIPE_HOME": str(self.home),
            "REDIS_URL": self.url,
            "SPECPIPE_SWARM": self.swarm,
            "SPECPIPE_SWARM_KEY": self.key,
            "OMP_NUM_THREADS": str(self.threads),
        }
        try:
            for i, (a, b) in enumerate(even_split(self.n_layers, self.n_stages)):
                argv = [
                    sys.executable,
                    "-m",
                    "specpipe.cli.delayed_stage",
                    "--host",
                    f"s{i}",
                    "--layers",
                    f"{a}:{b}",
                    "--model",
                    self.model,
                    "--redis",
                    self.data_url,
                    "--threads",
                    str(self.threads),
                    "--heartbeat-s",
                    "1",
                    "--link-delay-ms",
                    str(self.link_delay_ms),
                ]
                if self.draft_head is not None:
                    argv += ["--draft-head", self.draft_head]
                self.procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL))
            self._wait_online()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_online(self, timeout_s: float = 300.0) -> None:
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                keys = trust.keyring(self.settings())
                if len(inventory.load(client, self.swarm, keys)) == self.n_stages:
                    return
                if any(p.poll() is not None for p in self.procs):
                    raise RuntimeError("a stage worker exited while loading")
                time.sleep(0.2)
        finally:
            client.close()
        raise RuntimeError(f"the stages were not online within {timeout_s:g} s")

    def stage_stats(self) -> list[dict[str, float]]:
        """Each stage's counters and running means (see `streams.stats_key`), in ring order."""
        client = redis.Redis.from_url(self.data_url)
        try:
            return [streams.read_stats(client, self.swarm, f"s{i}") for i in range(self.n_stages)]
        finally:
            client.close()

    def settings(self) -> Settings:
        """A coordinator's settings for this swarm: its key, and its host identities."""
        found = Settings.from_env().for_swarm(
            self.url, self.swarm, self.key, coordinator_public_key=self.pin
        )
        return replace(found, home=self.home)

    def ring(self) -> RedisRing:
        """A coordinator's ring over the stages, its link to stage 0 as slow as theirs."""
        return DelayedRing.from_inventory(
            self.settings(),
            self.model_label,
            self.n_layers,
            reply_url=self.data_url,
            timeout_s=120,
            delay_s=self.link_delay_ms / 1000,
        )

    def __exit__(self, *exc) -> None:
        terminate_all(self.procs)
        self.redis.stop()
        shutil.rmtree(self.home, ignore_errors=True)


@dataclass
class Timed:
    """One generation: its tokens and what it cost."""

    tokens: list[int]
    tok_s: float
    rounds: int
    tokens_per_round: float
    round_ms: float
    round_ms_each: list[float]  # every decode round, in order (the prefill is not one)


def lockstep(
    rings: dict[str, Ring],
    prompt_ids: Sequence[int],
    params: SamplingParams,
    draft_k: int,
    max_new_tokens: int,
) -> dict[str, Timed]:
    """The same generation on every ring, one round of each in turn.

    Taking turns round by round puts the machine's slow drifts (other load, clock changes) on
    every ring alike, so that round i on one ring can be compared with round i on another."""
    gens = {
        name: Generation(
            ring,
            f"bench-{uuid.uuid4().hex[:10]}",
            prompt_ids,
            params,
            max_new_tokens=max_new_tokens,
            draft_k=draft_k,
        )
        for name, ring in rings.items()
    }
    steps = {name: gen.rounds() for name, gen in gens.items()}
    times: dict[str, list[float]] = {name: [] for name in gens}
    counts: dict[str, list[int]] = {name: [] for name in gens}
    running = set(gens)
    while running:
        for name in [n for n in gens if n in running]:
            started = time.perf_counter()
            committed = next(steps[name], None)
            if committed is None:
                running.discard(name)
                continue
            times[name].append((time.perf_counter() - started) * 1000)
            counts[name].append(len(committed))
    for gen in gens.values():
        gen.ring.drop(gen.session)
    timed = {}
    for name, gen in gens.items():
        each = times[name][1:]
        decode_s = sum(each) / 1000
        timed[name] = Timed(
            tokens=gen.generated,
            tok_s=sum(counts[name][1:]) / decode_s if decode_s > 0 else 0.0,
            rounds=gen.stats.rounds,
            tokens_per_round=gen.stats.tokens_per_round,
            round_ms=statistics.fmean(each) if each else 0.0,
            round_ms_each=each,
        )
    return timed


def timed_generation(
    ring: Ring, prompt_ids: Sequence[int], params: SamplingParams, draft_k: int, max_new_tokens: int
) -> Timed:
    """Generate once; time the rounds after the first (the prefill is not a decode round)."""
    return lockstep({"ring": ring}, prompt_ids, params, draft_k, max_new_tokens)["ring"]


def median_interval(values: Sequence[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free ~95% interval for the median: two order statistics of the sample."""
    ordered = sorted(values)
    n = len(ordered)
    half = z * math.sqrt(n) / 2
    low, high = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half))
    return ordered[low], ordered[high]


def wire_costs(dim: int, rows: Sequence[int] = (1, 512), repeats: int = 200) -> dict:
    """What the wire format costs a hop, in this process: one message of `rows` hidden-state
    rows of width `dim` sealed and signed by its sender, then opened and verified by its
    receiver, with the swarm key alone and with host identities (the sender's Ed25519 signature
    and its check), timed in alternation; the median µs of each, per row count."""
    import torch

    from specpipe.swarm import identity, wire

    key = secrets.token_bytes(32)
    host = identity.Signer("s0", identity.Ed25519PrivateKey.generate())
    coordinator = identity.Signer(identity.COORDINATOR, identity.Ed25519PrivateKey.generate())
    admitted = identity.Roster("bench", 1, {"s0": host.public_hex})
    sender = {
        "swarm key": wire.Keyring([key]),
        "host identities": wire.Keyring([key], signer=host),
    }
    receiver = {
        "swarm key": wire.Keyring([key]),
        "host identities": wire.Keyring(
            [key], coordinator=coordinator.key.public_key(), roster=admitted
        ),
    }
    found: dict = {}
    for n in rows:
        message = wire.Message(
            kind="round",
            session="bench",
            seq=1,
            to="s1",
            sender="s0",
            tokens=tuple(range(n)),
            tensor=torch.randn(n, dim),
        )
        times: dict[str, list[float]] = {name: [] for name in sender}
        for _ in range(max(1, repeats if n < 64 else repeats // 10)):
            for name in sender:
                started = time.perf_counter()
                wire.decode(wire.encode(message, "bench", sender[name]), "bench", receiver[name])
                times[name].append((time.perf_counter() - started) * 1e6)
        us = {name: statistics.median(t) for name, t in times.items()}
        us["signature"] = us["host identities"] - us["swarm key"]
        found[f"{n}_rows_us"] = us
    return found


def overhead(
    model: str, n_stages: int, tokens: int, threads: int, log: Log, repeats: int = 5
) -> dict:
    """Per-hop cost of the ring against the same model in one process (plain greedy).

    The whole model in one process, the same model split into stages in one process, and the
    ring generate in lockstep (see `lockstep`), `repeats` times. Each decode round on the ring
    is paired with the same round in one process; the median of those differences, over every
    round of every repeat, divided by the hops of a round, is the overhead per hop, given with
    a ~95% interval for that median."""
    import torch

    torch.set_num_threads(threads)
    target = open_target(model)
    prompt = target.prompt_ids(NOVEL_PROMPT)
    greedy = SamplingParams(temp=0.0)
    whole = LocalRing(target.load_stages(1))
    split = LocalRing(target.load_stages(n_stages))
    runs: dict[str, list[Timed]] = {"whole": [], "split": [], "ring": []}
    forwards = []  # per ring run: the stages' forwards summed, ms per round
    with LocalSwarm(model, n_stages, threads=threads) as swarm:
        ring = swarm.ring()
        for _ in range(repeats):
            timed = lockstep(
                {"whole": whole, "split": split, "ring": ring}, prompt, greedy, 0, tokens
            )
            for name, t in timed.items():
                runs[name].append(t)
            time.sleep(STATS_FLUSH_S)  # the stages publish their running means at heartbeats
            forwards.append(sum(stats.get("forward_ms", 0.0) for stats in swarm.stage_stats()))
        ring.close()
    each = {name: [ms for t in timed for ms in t.round_ms_each] for name, timed in runs.items()}
    over_whole = {
        name: [a - b for a, b in zip(each[name], each["whole"], strict=False)]
        for name in ("split", "ring")
    }
    median = {name: statistics.median(ms) for name, ms in each.items()}
    hops = n_stages + 1
    per_hop = statistics.median(over_whole["ring"]) / hops
    low, high = (ms / hops for ms in median_interval(over_whole["ring"]))
    split_per_hop = statistics.median(over_whole["split"]) / hops
    stage_forwards = statistics.median(forwards)
    slower_forwards_per_hop = (stage_forwards - median["split"]) / hops
    log(
        f"one process: {median['whole']:.1f} ms per plain round; split into {n_stages} stages: "
        f"{median['split']:.1f} ms; {n_stages} stage processes: {median['ring']:.1f} ms, of "
        f"which the stages' forwards {stage_forwards:.1f} ms ({len(each['ring'])} rounds of each, "
        f"in lockstep, {repeats} runs)"
    )
    tok_s = {name: statistics.median(t.tok_s for t in timed) for name, timed in runs.items()}
    all_runs = [t for timed in runs.values() for t in timed]
    return {
        "stages": n_stages,
        "hops_per_round": hops,
        "rounds_paired": len(each["ring"]),
        "local_round_ms": median["whole"],
        "local_split_round_ms": median["split"],
        "ring_round_ms": median["ring"],
        "ring_stage_forwards_ms": stage_forwards,
        "overhead_per_hop_ms": per_hop,
        "overhead_per_hop_ms_interval": [low, high],
        # The same overhead in three parts (they add up to it); the last is what is left.
        "split_per_hop_ms": split_per_hop,
        "slower_forwards_per_hop_ms": slower_forwards_per_hop,
        "transport_per_hop_ms": per_hop - split_per_hop - slower_forwards_per_hop,
        "tok_s_ratio_ring_vs_local": tok_s["ring"] / tok_s["whole"] if tok_s["whole"] else None,
        "same_tokens": all(t.tokens == all_runs[0].tokens for t in all_runs),
        "local_round_ms_runs": [t.round_ms for t in runs["whole"]],
        "local_split_round_ms_runs": [t.round_ms for t in runs["split"]],
        "ring_round_ms_runs": [t.round_ms for t in runs["ring"]],
        "ring_stage_forwards_ms_runs": forwards,
    }


def latency(
    model: str,
    n_stages: int,
    delays_ms: Sequence[float],
    tokens: int,
    params: dict,
    draft_k: int,
    threads: int,
    log: Log,
) -> list[dict]:
    """Speculative against plain through the ring, each link delayed by D ms."""
    target = open_target(model)
    prompts = {"grounded": GROUNDED_PROMPT, "novel": NOVEL_PROMPT}
    rows = []
    for delay in delays_ms:
        with LocalSwarm(model, n_stages, link_delay_ms=delay, threads=threads) as swarm:
            ring = swarm.ring()
            for name, text in prompts.items():
                ids = target.prompt_ids(text)
                sampling = SamplingParams(**params)
                plain = timed_generation(ring, ids, sampling, 0, tokens)
                spec = timed_generation(ring, ids, sampling, draft_k, tokens)
                ring_latency_s = (n_stages + 1) * delay / 1000
                row = {
                    "hop_delay_ms": delay,
                    "prompt": name,
                    "plain_tok_s": plain.tok_s,
                    "spec_tok_s": spec.tok_s,
                    "speedup": spec.tok_s / plain.tok_s if plain.tok_s else None,
                    "tokens_per_round": spec.tokens_per_round,
                    "latency_ceiling_tok_s": (
                        spec.tokens_per_round / ring_latency_s if ring_latency_s else None
                    ),
                    "identical": spec.tokens == plain.tokens,
                }
                rows.append(row)
                log(
                    f"delay {delay:g} ms, {name}: plain {plain.tok_s:.2f} tok/s, spec "
                    f"{spec.tok_s:.2f} tok/s ({row['speedup']:.2f}x), "
                    f"{spec.tokens_per_round:.2f} tokens/round, identical {row['identical']}"
                )
            ring.close()
    return rows


def exactness(
    model: str,
    n_stages: int,
    pairs: int,
    tokens: int,
    params: dict,
    draft_k: int,
    threads: int,
    log: Log,
) -> dict:
    """Speculative == plain through the ring for `pairs` (prompt, seed) pairs; greedy through
    the ring == greedy in one process."""
    import torch

    torch.set_num_threads(threads)
    target = open_target(model)
    local_ring = LocalRing(target.load_stages(1))
    mismatched, greedy_mismatched = [], []
    with LocalSwarm(model, n_stages, threads=threads) as swarm:
        ring = swarm.ring()
        for i, text in enumerate(EXACT_PROMPTS):
            ids = target.prompt_ids(text)
            greedy = SamplingParams(temp=0.0)
            on_ring = timed_generation(ring, ids, greedy, draft_k, tokens).tokens
            if on_ring != timed_generation(local_ring, ids, greedy, 0, tokens).tokens:
                greedy_mismatched.append(i)
        for i in range(pairs):
            text, seed = EXACT_PROMPTS[i % len(EXACT_PROMPTS)], 1000 + i
            sampling = SamplingParams(seed=seed, **params)
            ids = target.prompt_ids(text)
            spec = timed_generation(ring, ids, sampling, draft_k, tokens).tokens
            plain = timed_generation(ring, ids, sampling, 0, tokens).tokens
            if spec != plain:
                mismatched.append({"prompt": i % len(EXACT_PROMPTS), "seed": seed})
            log(f"pair {i + 1}/{pairs}: {'identical' if spec == plain else 'DIFFERENT'}")
        ring.close()
    return {
        "pairs": pairs,
        "tokens": tokens,
        "params": params,
        "spec_vs_plain_mismatches": mismatched,
        "greedy_prompts": len(EXACT_PROMPTS),
        "greedy_ring_vs_local_mismatches": greedy_mismatched,
        "verdict": "PASS" if not mismatched and not greedy_mismatched else "FAIL",
    }
