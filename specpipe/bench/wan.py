"""`specpipe bench wan`: speculative against plain on the lab with a geography's link delays.

The lab (`specpipe/ops/lab_hosts.py`) puts each stage on a network stack of its own, and each stage
delays its outgoing link by its share of the geography (the reference run's WA → MN → NC → NJ
and back: one way 11, 8, 3.4 and 19 ms). The ring is built from the lab's inventory, as a
coordinator builds it; for each prompt (input-grounded, open-ended) and temperature it runs the
same generation plain and speculative and reports tok/s, tokens per round, and the latency
ceilings the stages measured, with the ratio of the measured tok/s to each: the ring's
(tokens per round over the ring's time: every link one way, from the stages' PINGs and the
lab's delays, and every stage's forward and handling, read right after that mode's generation) and
the links' alone (tokens per round over the links' time: what a round allows when compute is
free: the target on fast hardware). Speculative and plain must give the same tokens (the
same seed).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import redis

from specpipe.bench.ring_hops import GROUNDED_PROMPT, NOVEL_PROMPT, Timed, timed_generation
from specpipe.core.sampling import SamplingParams
from specpipe.decoding.target import open_target
from specpipe.ops.lab_hosts import Lab
from specpipe.settings import COORDINATOR_PUB_FILE, SWARM_KEY_FILE, Settings
from specpipe.swarm import inventory, streams, trust
from specpipe.swarm.dialing import Dialer
from specpipe.swarm.redis_ring import RedisRing

REFERENCE_DELAYS_MS = (11.0, 8.0, 3.4, 19.0)  # WA -> MN -> NC -> NJ -> WA, one way
PROMPTS = {"grounded": GROUNDED_PROMPT, "novel": NOVEL_PROMPT}
MEASURE_S = 1.5  # long enough for every stage to beat (0.5 s) with its latest timings


def lab_settings(lab: Lab) -> Settings:
    """Settings pointing at `lab`: its registry, swarm, key and folder (the coordinator's key,
    and the pin of it: it logs in to the hosts' Redis as the coordinator) and the CA their TLS
    servers verify against (this process is none of the lab's, so its own environment has none
    of these)."""
    key = (lab.home / SWARM_KEY_FILE).read_text().strip()
    pin = (lab.home / COORDINATOR_PUB_FILE).read_text().strip()
    settings = Settings.from_env().for_swarm(
        lab.state["registry_url"], lab.state["swarm"], key, coordinator_public_key=pin
    )
    return replace(settings, home=lab.home, redis_password=None, tls_ca=str(lab.ca_cert()))


def ring_latency_now(
    settings: Settings, link_delays_ms: Mapping[str, float]
) -> inventory.RingLatency | None:
    """The latency the lab's stages measured, with their timings from their own Redis and the
    delay each adds to its link (`link_delays_ms`, by host), which no PING sees."""
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=5, socket_timeout=5)
    try:
        found = inventory.read(client, settings.swarm, trust.keyring(settings))
    finally:
        client.close()
    ring = inventory.measured_ring(found.nodes, found.now, found.latency_ms)
    if ring is None:
        return None
    stats = streams.read_stages_stats(
        [(n.host, n.redis_url) for n in ring],
        settings.swarm,
        5.0,
        Dialer.for_settings(settings),
        found.roster,
    )
    return with_link_delays(inventory.ring_latency(ring, stats), link_delays_ms)


def with_link_delays(
    latency: inventory.RingLatency, link_delays_ms: Mapping[str, float]
) -> inventory.RingLatency:
    """`latency` with each hop's link slower by the delay its host adds (`link_delays_ms`)."""
    return inventory.RingLatency(
        [
            replace(hop, link_ms=hop.link_ms + link_delays_ms.get(hop.host, 0.0))
            for hop in latency.hops
        ]
    )


def run(
    settings: Settings,
    model: str,
    *,
    tokens: int,
    temps: Sequence[float],
    seed: int,
    draft_k: int,
    link_delays_ms: Mapping[str, float],
    log: Callable[[str], None],
) -> dict:
    """Every (prompt, temperature), plain then speculative, on the lab's ring (its hosts
    adding `link_delays_ms` to their links); the rows."""
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
                # The stages' timings are running means of their latest rounds: each mode's
                # ring time is read right after its own generation.
                plain = timed_generation(ring, ids, params, 0, tokens)
                time.sleep(MEASURE_S)
                plain_latency = ring_latency_now(settings, link_delays_ms)
                spec = timed_generation(ring, ids, params, draft_k, tokens)
                time.sleep(MEASURE_S)
                spec_latency = ring_latency_now(settings, link_delays_ms)
                rows.append(_row(name, temp, (plain, plain_latency), (spec, spec_latency)))
                log(_line(rows[-1]))
    finally:
        ring.close()
    return {"route": [hop.host for hop in ring.route], "rows": rows}


def _row(
    name: str,
    temp: float,
    plain: tuple[Timed, inventory.RingLatency | None],
    spec: tuple[Timed, inventory.RingLatency | None],
) -> dict:
    """One (prompt, temperature): each mode's tok/s against two ceilings: the ring's (its
    links and its stages' measured times) and the links' alone (compute for free)."""
    row = {"prompt": name, "temp": temp, "identical": spec[0].tokens == plain[0].tokens}
    for mode, (timed, latency) in (("plain", plain), ("spec", spec)):
        per_round = timed.tokens_per_round
        ceiling = latency.ceiling_tok_s(per_round) if latency else 0.0
        link_ms = sum(h.link_ms for h in latency.hops) if latency else 0.0
        link_ceiling = per_round * 1000 / link_ms if link_ms else 0.0
        row[mode] = {
            "tok_s": round(timed.tok_s, 2),
            "tokens_per_round": round(per_round, 2),
            "round_ms": round(timed.round_ms, 2),
            "ring_ms": round(latency.ring_ms, 2) if latency else None,
            "link_ms": round(link_ms, 2) if latency else None,
            "ceiling_tok_s": round(ceiling, 2) if ceiling else None,
            "of_ceiling": round(timed.tok_s / ceiling, 3) if ceiling else None,
            "link_ceiling_tok_s": round(link_ceiling, 2) if link_ceiling else None,
            "of_link_ceiling": round(timed.tok_s / link_ceiling, 3) if link_ceiling else None,
        }
    row["speedup"] = round(spec[0].tok_s / plain[0].tok_s, 2) if plain[0].tok_s else None
    return row


def _line(row: dict) -> str:
    def part(label: str, r: dict) -> str:
        share = f", {r['of_ceiling']:.0%} of {r['ceiling_tok_s']:.1f}" if r["of_ceiling"] else ""
        return (
            f"{label} {r['tok_s']:.1f} tok/s ({r['tokens_per_round']:.2f}/round{share}, "
            f"ring {r['ring_ms']} ms)"
        )

    plain, spec = part("plain", row["plain"]), part("spec", row["spec"])
    return (
        f"{row['prompt']:8} temp {row['temp']:g}: {plain}, {spec}, {row['speedup']}x, "
        f"identical {row['identical']}"
    )


def table(result: dict) -> list[str]:
    """The rows as a Markdown table."""
    lines = [
        "| prompt | temp | mode | tok/s | tokens/round | ring ms | ceiling tok/s | of ceiling | "
        "links ms | links-only ceiling | of it | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        for mode in ("plain", "spec"):
            r = row[mode]
            cells = [
                row["prompt"],
                f"{row['temp']:g}",
                mode,
                r["tok_s"],
                r["tokens_per_round"],
                r["ring_ms"],
                r["ceiling_tok_s"],
                r["of_ceiling"],
                r["link_ms"],
                r["link_ceiling_tok_s"],
                r["of_link_ceiling"],
                row["identical"],
            ]
            lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return lines
