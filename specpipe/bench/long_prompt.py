"""Long prompts on the running stack: a prefill of thousands of tokens, its effect on a job
already running, and a replay of as many after a stage is killed.

The stack runs as `specpipe up` runs it (`stack.Stack`), on its default settings. Three jobs go
in through the one submission path and are followed in the store, each judged against the same
job run in this process over the whole model (`faults.References`):

- *short*: a job with a short prompt, running when the long one arrives; the gaps between its
  stored rounds, before and while the long prompt's prefill passes, say what a running job's
  round waits for it (a prefill goes through the ring in rounds of at most `PREFILL_CHUNK`
  tokens, so the stages serve the other sessions between them);
- *long*: a prompt of `--prompt-tokens` tokens;
- *replay*: another such prompt; once it generates, one stage is killed (SIGKILL; the supervisor
  restarts it), and the job replays every token it holds on the restarted stage.

Each must end identical to its reference; the bench exits 1 otherwise.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from specpipe.bench.faults import FINAL, PROMPTS, JobPlan, Jobs, References
from specpipe.bench.stack import Stack
from specpipe.decoding.generation import PREFILL_CHUNK

Log = Callable[[str], None]
BASELINE_S = 5.0  # the short job's rounds followed alone, before the long prompt goes in

TOPICS = (
    "the tides",
    "a river delta",
    "the printing press",
    "bread",
    "glaciers",
    "the telegraph",
    "honeybees",
    "a suspension bridge",
)


def long_prompt(prompt_ids: Callable[[str], list[int]], n_tokens: int, seed: int) -> str:
    """A prompt of at least `n_tokens` tokens (as the job's prompt is fed): numbered notes on
    seeded topics, then a question about them."""
    rng = random.Random(seed)
    notes: list[str] = []
    question = "\nWhich of these notes is the most surprising, and why?"
    while len(prompt_ids("".join(notes) + question)) < n_tokens:
        for _ in range(4):  # a note is about 20 tokens
            topic, other = rng.sample(TOPICS, 2)
            notes.append(
                f"Note {len(notes) + 1}: {topic} and {other} share {rng.randrange(2, 90)} "
                f"details; the {rng.choice(('first', 'second', 'last'))} one matters most.\n"
            )
    return "".join(notes) + question


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def _watch(
    jobs: Jobs, short_id: int, submit_long: Callable[[], int], baseline_s: float, timeout_s: float
) -> tuple[int, dict]:
    """Follow the short job's rounds for `baseline_s`, then submit the long job and follow them
    until the long job stores its first round (its prefill has passed); returns the long job's
    id and the short job's round gaps before the long job started and during its prefill."""
    round_times: list[tuple[float, bool]] = []  # (when the short job stored a round, in prefill)
    last_rounds, long_id, prefill_from, prefill_s = None, None, None, None
    watch_from = time.monotonic()
    deadline = watch_from + timeout_s
    while time.monotonic() < deadline:
        now = time.monotonic()
        if long_id is None and now - watch_from >= baseline_s:
            long_id = submit_long()
        short = jobs.read(short_id)
        long = jobs.read(long_id) if long_id is not None else None
        if long is not None and long.status == "running" and prefill_from is None:
            prefill_from = now
        if long_id is not None and (long is None or long.status in FINAL or long.rounds > 0):
            if prefill_from is not None:
                prefill_s = now - prefill_from
            break
        if short is not None and short.status == "running" and short.rounds != last_rounds:
            if last_rounds is not None:
                round_times.append((now, prefill_from is not None))
            last_rounds = short.rounds
        time.sleep(0.02)
    before = [t for t, during in round_times if not during]
    during = [t for t, during in round_times if during]
    if before and during:
        during = [before[-1], *during]  # the first gap in the prefill starts at the last before
    gaps_before, gaps_during = _gaps(before), _gaps(during)
    return long_id, {
        "prefill_s": prefill_s,
        "short_rounds_during_prefill": max(len(during) - 1, 0),
        "short_round_gap_before_s": {
            "p50": statistics.median(gaps_before) if gaps_before else None,
            "max": max(gaps_before, default=None),
        },
        "short_round_gap_during_prefill_s": {
            "p50": statistics.median(gaps_during) if gaps_during else None,
            "max": max(gaps_during, default=None),
        },
        "short_still_running": (jobs.read(short_id).status == "running"),
    }


def run_long_prompt(
    model: str,
    workdir: Path,
    log: Log,
    *,
    stages: int = 4,
    prompt_tokens: int = 6000,
    tokens: int = 32,
    short_tokens: int = 512,
    seed: int = 7,
    deadline_s: float = 1800.0,
) -> dict:
    """Run the three jobs on a fresh stack; returns what became of them and the timings."""
    rng = random.Random(seed)
    references = References(model)
    target = references.target
    limit = target.context_length or None
    if limit is not None and prompt_tokens + tokens > limit:
        raise ValueError(f"{prompt_tokens} + {tokens} tokens are over {model}'s context of {limit}")
    long_plan = JobPlan(long_prompt(target.prompt_ids, prompt_tokens, seed), seed, tokens)
    replay_plan = JobPlan(long_prompt(target.prompt_ids, prompt_tokens, seed + 1), seed + 1, tokens)
    # Long enough to be running still when the long prompt's prefill has passed.
    short_plan = JobPlan(PROMPTS[2], seed + 2, short_tokens)
    log(f"{len(target.prompt_ids(long_plan.prompt))} prompt tokens; references in this process")
    started = time.monotonic()
    for plan in (long_plan, replay_plan, short_plan):
        references.get(plan)
    log(f"references took {time.monotonic() - started:.0f} s")
    result: dict = {
        "model": model,
        "stages": stages,
        "prompt_tokens": len(target.prompt_ids(long_plan.prompt)),
        "prefill_chunk": PREFILL_CHUNK,
        "new_tokens": tokens,
    }
    with Stack(model, stages, workdir / "stack") as stack:
        jobs = Jobs(stack, references, stack.database_url, short_plan.max_new_tokens, rng)
        try:
            short_id = jobs.submit(short_plan)
            if jobs.wait_round(short_id, 5, 300) is None:
                raise RuntimeError("the short job did not start")
            log(f"short job {short_id} running; the long job goes in after {BASELINE_S:g} s")
            long_id, result["prefill"] = _watch(
                jobs, short_id, lambda: jobs.submit(long_plan), BASELINE_S, deadline_s
            )
            outcomes, _ = jobs.follow([long_id], time.monotonic(), deadline_s, 0)
            result["long"] = asdict(outcomes[0])

            replay_id = jobs.submit(replay_plan)
            if jobs.wait_round(replay_id, 2, deadline_s) is None:
                raise RuntimeError("the replay job ended before it generated")
            victim = "stage0" if stages == 1 else f"stage{stages // 2}"
            held = jobs.read(replay_id)
            log(f"replay job {replay_id}: {held.generated_tokens} tokens generated; kill {victim}")
            stack.signal(victim, 9)
            killed_at = time.monotonic()
            outcomes, recover_s = jobs.follow([replay_id], killed_at, deadline_s, held.rounds)
            result["replay"] = {
                **asdict(outcomes[0]),
                "killed": victim,
                "tokens_replayed": result["prompt_tokens"] + held.generated_tokens,
                "recover_s": recover_s,
            }
            short_outcome, _ = jobs.follow([short_id], time.monotonic(), deadline_s, 0)
            result["short"] = asdict(short_outcome[0])
        finally:
            jobs.close()
    judged = [result[name]["outcome"] for name in ("long", "replay", "short")]
    result["verdict"] = "PASS" if all(o == "identical" for o in judged) else "FAIL"
    return result


def report(result: dict) -> list[str]:
    """The result as lines for a terminal."""

    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f} s"

    prefill = result["prefill"]
    before = prefill["short_round_gap_before_s"]
    during = prefill["short_round_gap_during_prefill_s"]
    lines = [
        f"{result['model']} on {result['stages']} stages: a {result['prompt_tokens']}-token "
        f"prompt in prefill rounds of <= {result['prefill_chunk']}",
        f"long prompt: {result['long']['outcome']} ({result['long']['reason'] or 'ok'}), "
        f"prefill {s(prefill['prefill_s'])}",
        f"running job's round gap: before p50 {s(before['p50'])} max {s(before['max'])}; "
        f"during the prefill p50 {s(during['p50'])} max {s(during['max'])} "
        f"({prefill['short_rounds_during_prefill']} rounds stored during it)",
        f"replay of {result['replay']['tokens_replayed']} tokens after killing "
        f"{result['replay']['killed']}: {result['replay']['outcome']} "
        f"({result['replay']['reason'] or 'ok'}), recovered in {s(result['replay']['recover_s'])}",
        f"short job: {result['short']['outcome']} ({result['short']['reason'] or 'ok'})",
    ]
    return lines
