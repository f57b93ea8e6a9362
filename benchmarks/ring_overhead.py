"""Per-hop overhead of the Redis ring on loopback, with the toy stages.

Runs the same rounds through N stage worker processes (RedisRing) and through the same N
stages in one process, and reports (ring time - in-process time) / (N + 1) as the overhead per
hop: each round makes N + 1 Redis hops (coordinator -> stage 0 -> … -> tail -> coordinator).
With `--hop-delay-ms`, each stage sleeps that long per round, as a slow link would.

    python benchmarks/ring_overhead.py --stages 4 --rounds 200 --hop-delay-ms 0 10 25

Uses REDIS_URL when set, else starts a private redis-server. Target: <= 1 ms per hop.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specpipe import inventory  # noqa: E402
from specpipe.redis_ring import RedisRing  # noqa: E402
from specpipe.redis_server import RedisServer  # noqa: E402
from specpipe.ring import SamplingParams  # noqa: E402
from specpipe.sampling import Sampler  # noqa: E402
from tests.swarm.toy_stage import ToyConfig, ToyStage  # noqa: E402

PARAMS = SamplingParams(temp=0.8, top_p=0.95, top_k=40, seed=3)


def bounds(n_stages: int, n_layers: int) -> list[tuple[int, int]]:
    """Split n_layers into n_stages contiguous ranges."""
    edges = [round(i * n_layers / n_stages) for i in range(n_stages + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def start_stages(url, swarm, key, ranges, n_layers, dim, delay_ms):
    procs = []
    # One thread per stage: several stage processes share this machine's cores.
    env = {**os.environ, "SPECPIPE_SWARM_KEY": key.decode(), "OMP_NUM_THREADS": "1"}
    for i, (a, b) in enumerate(ranges):
        argv = [
            sys.executable, "-m", "tests.swarm.toy_worker", "--host", f"s{i}",
            "--layers", f"{a}:{b}", "--redis", url, "--swarm", swarm,
            "--n-layers", str(n_layers), "--dim", str(dim), "--delay-ms", str(delay_ms),
        ]  # fmt: skip
        procs.append(subprocess.Popen(argv, cwd=ROOT, env=env))
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 120
    while len(inventory.load(client, swarm)) < len(ranges):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise SystemExit("stage workers did not come up")
        time.sleep(0.1)
    return procs


def run_rounds(ring, session, rounds, k, vocab):
    """A prefill, then `rounds` rounds of 1 + k tokens; returns seconds per round."""
    ring.reset(session, PARAMS)
    ring.round(session, list(range(16)), 0, 0)
    pos, times = 15, []
    for r in range(rounds):
        tokens = [(r * 7 + j) % vocab for j in range(k + 1)]
        started = time.perf_counter()
        ring.round(session, tokens, pos, k)
        times.append(time.perf_counter() - started)
        pos += 1
    ring.drop(session)
    return times


class LocalToyRing:
    """The same stages in this process: the baseline without Redis."""

    def __init__(self, ranges, cfg):
        self.stages = [ToyStage(cfg, a, b) for a, b in ranges]
        self.sampler = None

    def reset(self, session, params):
        self.sampler = Sampler(params.seed, params.temp, params.top_p, params.top_k)

    def round(self, session, tokens, start_pos, n_draft):
        x = torch.tensor(tokens, dtype=torch.int64)
        for stage in self.stages:
            x = stage.forward(session, x, start_pos)
        drafts = tokens[len(tokens) - n_draft :] if n_draft else []
        return self.sampler.accept(x[-(n_draft + 1) :], drafts, start_pos + len(tokens) - n_draft)

    def drop(self, session):
        for stage in self.stages:
            stage.drop(session)


def sleep_overshoot(delay_s: float, n: int = 40) -> float:
    """Median extra time a time.sleep(delay_s) takes here: part of an injected delay's cost."""
    if delay_s <= 0:
        return 0.0
    extra = []
    for _ in range(n):
        started = time.perf_counter()
        time.sleep(delay_s)
        extra.append(time.perf_counter() - started - delay_s)
    return statistics.median(extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64, help="hidden size of the toy model")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--k", type=int, default=4, help="drafts per round")
    parser.add_argument("--hop-delay-ms", type=float, nargs="+", default=[0.0])
    args = parser.parse_args()
    torch.set_num_threads(1)

    server = None
    url = os.environ.get("REDIS_URL")
    if not url:
        server = RedisServer()
        url = server.start()
    ranges = bounds(args.stages, args.layers)
    cfg = ToyConfig(n_layers=args.layers, dim=args.dim)
    local = statistics.median(run_rounds(LocalToyRing(ranges, cfg), "l", args.rounds, args.k,
                                         cfg.vocab))  # fmt: skip
    hops = args.stages + 1
    print(f"{args.stages} stages, {args.layers} layers, dim {args.dim}, K={args.k}, "
          f"{args.rounds} rounds; in-process round {local * 1e3:.3f} ms")  # fmt: skip
    try:
        for delay in args.hop_delay_ms:
            swarm, key = f"bench{uuid.uuid4().hex[:8]}", secrets.token_hex(16).encode()
            procs = start_stages(url, swarm, key, ranges, args.layers, args.dim, delay)
            try:
                ring = RedisRing(inventory.route(inventory.load(redis.Redis.from_url(url), swarm),
                                                 args.layers), swarm, key, url)  # fmt: skip
                run_rounds(ring, "warmup", 20, args.k, cfg.vocab)
                times = run_rounds(ring, "s", args.rounds, args.k, cfg.vocab)
                ring.close()
            finally:
                for p in procs:
                    p.terminate()
                for p in procs:
                    p.wait()
                client = redis.Redis.from_url(url)
                for k in client.scan_iter(f"specpipe:{swarm}:*"):
                    client.delete(k)
            median = statistics.median(times)
            p90 = sorted(times)[int(0.9 * len(times))]
            overshoot = sleep_overshoot(delay / 1e3)
            injected = (delay / 1e3 + overshoot) * args.stages
            per_hop = (median - local - injected) / hops
            print(f"hop delay {delay:5.1f} ms: round median {median * 1e3:7.3f} ms, "
                  f"p90 {p90 * 1e3:7.3f} ms, tok-round rate {1 / median:7.1f}/s, "
                  f"overhead per hop {per_hop * 1e3:.3f} ms ({hops} hops; "
                  f"sleep overshoot here {overshoot * 1e3:.2f} ms)")  # fmt: skip
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
