"""`specpipe bench wan`: speculative against plain on the lab with a geography's link delays.

The lab (`specpipe/lab.py`) puts each stage on a network stack of its own, and each stage
delays its outgoing link by its share of the geography (the reference run's WA → MN → NC → NJ
and back: one way 11, 8, 3.4 and 19 ms). The ring is built from the lab's inventory, as a
coordinator builds it; for each prompt (input-grounded, open-ended) and temperature it runs the
same generation plain and speculative and reports tok/s, tokens per round, and the latency
ceiling the stages measured (tokens per round over the ring's time: every link one way, from
the stages' PINGs and delays, and every stage's forward and handling), with the ratio of the
measured tok/s to it. Speculative and plain must give the same tokens (the same seed).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import redis

from specpipe import inventory, streams
from specpipe.redis_ring import RedisRing
from specpipe.ringbench import GROUNDED_PROMPT, NOVEL_PROMPT, Timed, timed_generation
from specpipe.sampling import SamplingParams
from specpipe.settings import Settings
from specpipe.target import open_target

REFERENCE_DELAYS_MS = (11.0, 8.0, 3.4, 19.0)  # WA -> MN -> NC -> NJ -> WA, one way
PROMPTS = {"grounded": GROUNDED_PROMPT, "novel": NOVEL_PROMPT}
MEASURE_S = 1.5  # long enough for every stage to beat (0.5 s) with its latest timings


def lab_settings(state: dict, key: str) -> Settings:
    """Settings pointing at the lab whose state is `state`."""
    return Settings.from_env().for_swarm(state["registry_url"], state["swarm"], key)


def ring_latency_now(settings: Settings) -> inventory.RingLatency | None:
    """The latency the lab's stages measured, with their timings from their own Redis."""
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=5, socket_timeout=5)
    try:
        nodes = inventory.load(client, settings.swarm, settings.accepted_swarm_keys)
    finally:
        client.close()
    ring = inventory.measured_ring(nodes)
    if ring is None:
        return None
    stats = {}
    for node in ring:
        stage_redis = redis.Redis.from_url(node.redis_url, socket_connect_timeout=5)
        try:
            stats[node.host] = streams.read_stats(stage_redis, settings.swarm, node.host)
        except (redis.RedisError, ValueError):
            stats[node.host] = None
        finally:
            stage_redis.close()
    return inventory.ring_latency(ring, stats)


def run(settings: Settings, model: str, *, tokens: int, temps: Sequence[float], seed: int,
        draft_k: int, log: Callable[[str], None]) -> dict:  # fmt: skip
    """Every (prompt, temperature), plain then speculative, on the lab's ring; the rows."""
    target = open_target(model)
    ring = RedisRing.from_inventory(settings, target.name, target.n_layers)
    rows = []
    try:
        hosts = " -> ".join(hop.host for hop in ring.route)
        log(f"ring {hosts} -> back, {tokens} tokens per generation, K={draft_k}")
        for name, text in PROMPTS.items():
            ids = target.prompt_ids(text)
            for temp in temps:
                params = SamplingParams(temp=temp, top_p=1.0 if temp == 0 else 0.95, seed=seed)
                plain = timed_generation(ring, ids, params, 0, tokens)
                spec = timed_generation(ring, ids, params, draft_k, tokens)
                time.sleep(MEASURE_S)
                latency = ring_latency_now(settings)
                rows.append(_row(name, temp, plain, spec, latency))
                log(_line(rows[-1]))
    finally:
        ring.close()
    return {"route": [hop.host for hop in ring.route], "rows": rows}


def _row(name: str, temp: float, plain: Timed, spec: Timed,
         latency: inventory.RingLatency | None) -> dict:  # fmt: skip
    row = {"prompt": name, "temp": temp, "identical": spec.tokens == plain.tokens}
    for mode, timed in (("plain", plain), ("spec", spec)):
        ceiling = latency.ceiling_tok_s(timed.tokens_per_round) if latency else None
        row[mode] = {
            "tok_s": round(timed.tok_s, 2),
            "tokens_per_round": round(timed.tokens_per_round, 2),
            "round_ms": round(timed.round_ms, 2),
            "ceiling_tok_s": round(ceiling, 2) if ceiling else None,
            "of_ceiling": round(timed.tok_s / ceiling, 3) if ceiling else None,
        }
    row["ring_ms"] = round(latency.ring_ms, 2) if latency else None
    row["link_ms"] = round(sum(h.link_ms for h in latency.hops), 2) if latency else None
    row["speedup"] = round(spec.tok_s / plain.tok_s, 2) if plain.tok_s else None
    return row


def _line(row: dict) -> str:
    plain, spec = row["plain"], row["spec"]

    def part(label: str, r: dict) -> str:
        share = f", {r['of_ceiling']:.0%} of {r['ceiling_tok_s']:.1f}" if r["of_ceiling"] else ""
        return f"{label} {r['tok_s']:.1f} tok/s ({r['tokens_per_round']:.2f}/round{share})"

    return (f"{row['prompt']:8} temp {row['temp']:g}: {part('plain', plain)}, "
            f"{part('spec', spec)}, {row['speedup']}x, identical {row['identical']}; "
            f"ring {row['ring_ms']} ms (links {row['link_ms']} ms)")  # fmt: skip


def table(result: dict) -> list[str]:
    """The rows as a Markdown table."""
    lines = [
        "| prompt | temp | plain tok/s | spec tok/s | speedup | tokens/round (spec) | "
        "ring ms | ceiling spec tok/s | spec / ceiling | identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        spec = row["spec"]
        ceiling = spec["ceiling_tok_s"] if spec["ceiling_tok_s"] is not None else "-"
        share = f"{spec['of_ceiling']:.2f}" if spec["of_ceiling"] is not None else "-"
        lines.append(
            f"| {row['prompt']} | {row['temp']:g} | {row['plain']['tok_s']} | {spec['tok_s']} | "
            f"{row['speedup']} | {spec['tokens_per_round']} | {row['ring_ms']} | {ceiling} | "
            f"{share} | {row['identical']} |"
        )
    return lines
