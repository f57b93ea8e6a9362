"""A stage keeps an ended session's cache when its drop names a prefix, starts a new session from
it when a reset names it, counts both, and lets kept prefixes go first when its caches hold more
than its KV budget (real Redis, a real stage model)."""

from __future__ import annotations

import time
from dataclasses import replace

import redis

from specpipe.swarm import streams, wire
from tests.swarm.handling import handle
from tests.swarm.test_stage_worker import (
    RESET,
    deliver,
    replies,
    round_message,
    signed,
    tiny_worker,
)


def run_round(worker, session: str, tokens, start_pos: int = 0) -> wire.Message:
    message = round_message(None, [worker.config.host], tokens=tokens, start_pos=start_pos)
    handle(worker, signed(worker, replace(message, session=session, round_id=session)))
    return replies(worker.config.redis_url, worker.config.swarm, worker.keys, session)[-1]


def stats(worker) -> dict[str, float]:
    client = redis.Redis.from_url(worker.config.redis_url)
    try:
        raw = client.hgetall(streams.stats_key(worker.config.swarm, worker.config.host))
    finally:
        client.close()
    return {k.decode(): float(v) for k, v in raw.items()}


def test_a_session_started_from_a_kept_prefix_answers_as_a_cold_one(
    swarm, key, redis_url, tmp_path
):
    worker = tiny_worker(tmp_path, "t", swarm, key, redis_url)
    first = (5, 6, 7, 8, 9, 10, 11, 12)
    deliver(worker, wire.Message(kind="reset", session="turn-1", params=RESET))
    run_round(worker, "turn-1", first)
    deliver(worker, wire.Message(kind="drop", session="turn-1", prefix="p", start_pos=6))
    assert worker.stage.kept_tokens() == {"p": 6} and "turn-1" not in worker.stage.sessions
    assert stats(worker)["kept_tokens"] == 6 and stats(worker)["kept_prefixes"] == 1

    prompt = first[:6] + (20, 21)
    deliver(worker, wire.Message(kind="reset", session="cold", params=RESET))
    want = run_round(worker, "cold", prompt)
    deliver(
        worker, wire.Message(kind="reset", session="warm", params=RESET, prefix="p", start_pos=6)
    )
    got = run_round(worker, "warm", prompt[6:], start_pos=6)
    assert got.kind == want.kind == "result" and got.tokens == want.tokens
    # A prefix this stage does not hold starts the session empty: its round is a gap.
    reset = wire.Message(kind="reset", session="lost", params=RESET, prefix="gone", start_pos=6)
    deliver(worker, reset)
    assert run_round(worker, "lost", prompt[6:], start_pos=6).kind == "gap"
    assert (stats(worker)["prefix_hits"], stats(worker)["prefix_misses"]) == (1, 1)


def test_kept_prefixes_give_their_room_first_and_go_when_unused(
    swarm, key, redis_url, tmp_path, monkeypatch
):
    monkeypatch.setenv("SPECPIPE_KV_BUDGET_TOKENS", "12")
    worker = tiny_worker(tmp_path, "t", swarm, key, redis_url)
    for name in ("a", "b"):
        deliver(worker, wire.Message(kind="reset", session=name, params=RESET))
        run_round(worker, name, (1, 2, 3, 4, 5))
        deliver(worker, wire.Message(kind="drop", session=name, prefix=f"kept-{name}", start_pos=5))
    deliver(worker, wire.Message(kind="reset", session="live", params=RESET))
    run_round(worker, "live", (1, 2, 3, 4, 5))
    now = time.monotonic()
    worker.prefixes.used.last_used.update({"kept-a": now - 1, "kept-b": now - 2})
    # 15 tokens against 12: the prefix used longest ago goes, though used a moment ago, and
    # the live session stays.
    assert worker.prefixes.within(worker.kv_budget_tokens, now) == ["kept-b"]
    assert worker.stage.kept_tokens() == {"kept-a": 5} and "live" in worker.stage.sessions
    assert worker.prefixes.within(worker.kv_budget_tokens, now) == []
    later = now + worker.config.prefix_keep_s + 1
    assert worker.prefixes.within(0, later) == ["kept-a"] and worker.stage.kept_tokens() == {}
    assert stats(worker)["kept_tokens"] == 0


def test_a_stage_keeps_at_most_so_many_prefixes_the_least_used_going_first(
    swarm, key, redis_url, tmp_path, monkeypatch
):
    monkeypatch.setenv("SPECPIPE_KEPT_PREFIXES", "2")
    worker = tiny_worker(tmp_path, "t", swarm, key, redis_url)
    for name in ("a", "b", "c"):
        deliver(worker, wire.Message(kind="reset", session=name, params=RESET))
        run_round(worker, name, (1, 2, 3))
        if name == "c":  # "a" was started from since it was kept: "b" is the least used
            deliver(worker, wire.Message(kind="reset", session="x", params=RESET, prefix="p-a"))
        deliver(worker, wire.Message(kind="drop", session=name, prefix=f"p-{name}", start_pos=3))
    assert set(worker.stage.kept_tokens()) == {"p-a", "p-c"}
    assert stats(worker)["kept_prefixes"] == 2
