"""The conversation benchmark: a chat of several turns, the first carrying a long document, each
turn run with prefix reuse and without, side by side, on N real stage processes.

For each link delay, a `LocalSwarm` (N `specpipe worker stage` processes on a private Redis,
every link delayed) runs the conversation's turns in order. Each turn runs twice on the same
ring with the same seed, as the coordinator runs a job (the Gumbel sampler, adaptive draft
lengths, the tail's draft trees):

- cold: a fresh session, its whole context prefilled;
- warm: as a conversation's next turn runs with prefix reuse: the turn starts from the longest
  prefix of its tokens the directory (`PrefixDirectory`, one namespace) says its route keeps,
  and at its end its stages keep its cache, which the directory records for the next turn.

Which of the two goes first alternates turn by turn, so the machine's drifts touch both alike.
Time to first token runs from the turn's start (the warm turn's directory lookup, the session's
reset) to its first committed token; the total to its last. The next turn resends the history
as a chat client does: every message so far, each reply the decoded text of the turn's tokens,
then a new question.

Checked: the warm turn commits the cold turn's tokens at every turn, every later turn starts
from a kept prefix, and from turn 2 on the warm/cold ratio of the time to first token is at most
the target at every delay.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import redis

from specpipe.bench.ring_hops import LocalSwarm
from specpipe.core.ring import Prefix, Ring
from specpipe.core.sampling import SamplingParams, offset_seed
from specpipe.decoding.generation import Generation
from specpipe.decoding.target import Target, context_error, open_target
from specpipe.swarm.prefix_directory import PrefixDirectory

Log = Callable[[str], None]

# The long document of the first turn: a chronicle of sentences drawn from these, by the seed.
SUBJECTS = (
    "the river",
    "the old mill",
    "a travelling merchant",
    "the town council",
    "the harbour master",
    "a young carpenter",
    "the valley farmers",
    "the keeper of the library",
    "a band of pilgrims",
    "the widow of the baker",
    "the northern garrison",
    "a stranger from the coast",
)
VERBS = (
    "rebuilt",
    "remembered",
    "measured",
    "guarded",
    "sold",
    "painted",
    "described",
    "abandoned",
)
OBJECTS = (
    "the stone bridge",
    "a ledger of old debts",
    "the winter market",
    "the lighthouse on the point",
    "a field of barley",
    "the road to the capital",
    "the chapel bell",
    "a map of the marshes",
    "the orchard walls",
    "the salt warehouse",
    "a chest of silver coins",
    "the ferry across the lake",
)
WHEN = (
    "before the first snow",
    "in the year of the great flood",
    "for three generations",
    "without a word to anyone",
    "during the long drought",
    "after the fair had ended",
    "while the town slept",
    "at the request of the council",
)
QUESTION = "Read the chronicle above. Who rebuilt the stone bridge, and when?"
FOLLOW_UPS = (
    "Which of the people in the chronicle do you find most interesting, and why?",
    "What happened to the salt warehouse?",
    "Name three places the chronicle mentions.",
    "Summarise the chronicle in two sentences.",
    "Suggest a title for the chronicle.",
    "What might the town look like a hundred years later?",
)


def chronicle(rng: random.Random, paragraphs: int) -> str:
    """`paragraphs` paragraphs of the chronicle, drawn with `rng`."""
    out = []
    for _ in range(paragraphs):
        sentences = []
        for _ in range(rng.randint(4, 7)):
            words = (rng.choice(s) for s in (SUBJECTS, VERBS, OBJECTS, WHEN))
            sentence = " ".join(words)
            sentences.append(sentence[0].upper() + sentence[1:] + ".")
        out.append(" ".join(sentences))
    return "\n\n".join(out)


def first_message(target: Target, context_tokens: int, seed: int) -> str:
    """The first user message: a chronicle long enough that the turn's context, through the
    chat template, holds at least `context_tokens` tokens, and a question about it."""
    rng = random.Random(seed)
    document = "The Chronicle of the Valley Town"
    while True:
        text = f"{document}\n\n{QUESTION}"
        if len(target.chat_ids([{"role": "user", "content": text}])) >= context_tokens:
            return text
        document += "\n\n" + chronicle(rng, 1)


@dataclass
class TurnRun:
    """One run of a turn: its tokens and when its milestones came."""

    tokens: list[int]
    first_token_s: float  # from the turn's start to its first committed token
    done_s: float  # from its start to its end
    reused: int  # positions it started from a kept prefix
    replays: int  # replays after a gap (a kept prefix a stage no longer held)


class Reuse:
    """Prefix reuse as the coordinator does it, in one namespace of the directory."""

    def __init__(self, directory: PrefixDirectory, route: Sequence[str]) -> None:
        self.directory, self.route = directory, list(route)
        self.namespace = f"conversation-{uuid.uuid4().hex[:8]}"

    def start(self, tokens: Sequence[int]) -> Prefix | None:
        """The kept prefix a turn of `tokens` starts from, if any."""
        return self.directory.longest(self.namespace, tokens, self.route)

    def keep(self, ring: Ring, generation: Generation) -> None:
        """End the generation's session, its stages keeping its cache, and record it."""
        if generation.cached <= 0:
            ring.drop(generation.session)
            return
        self.directory.keep(
            ring, generation.session, self.namespace, generation.tokens, generation.cached
        )


def run_turn(
    ring: Ring,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    draft_k: int,
    tokens: int,
    eos_ids: Sequence[int],
    reuse: Reuse | None = None,
) -> TurnRun:
    """One turn to its end on `ring`, timed: cold, or warm with `reuse`."""
    started = time.perf_counter()
    generation = Generation(
        ring,
        f"conversation-{uuid.uuid4().hex[:10]}",
        prompt_ids,
        params,
        prefix=None if reuse is None else reuse.start(prompt_ids),
        max_new_tokens=tokens,
        draft_k=draft_k,
        adaptive=True,  # as a job runs: each round's K chosen, the head's proposals trees
        trees=True,
        eos_ids=eos_ids,
    )
    first = None
    for _ in generation.rounds():
        first = first if first is not None else time.perf_counter() - started
    done = time.perf_counter() - started
    if reuse is None:
        ring.drop(generation.session)
    else:
        reuse.keep(ring, generation)
    stats = generation.stats
    return TurnRun(generation.generated, first or done, done, stats.reused, stats.replays)


@dataclass(frozen=True)
class Plan:
    """What a conversation run does, the same at every delay."""

    turns: int
    context_tokens: int
    tokens: int  # new tokens per turn at most
    params: SamplingParams  # the seed is each turn's own, offset from this one's
    draft_k: int


def conversation_at(
    swarm: LocalSwarm, target: Target, plan: Plan, flip: bool, log: Log
) -> list[dict]:
    """The conversation on `swarm`, each turn cold and warm (`flip`: the first turn's warm run
    goes first); a row per turn."""
    ring = swarm.ring()
    client = redis.Redis.from_url(swarm.url)
    try:
        reuse = Reuse(PrefixDirectory(client, swarm.swarm), [hop.host for hop in ring.route])
        first = first_message(target, plan.context_tokens, plan.params.seed)
        messages = [{"role": "user", "content": first}]
        rows = []
        for turn in range(1, plan.turns + 1):
            prompt_ids = target.chat_ids(messages)
            problem = context_error(target, len(prompt_ids), plan.tokens)
            if problem:
                raise ValueError(f"turn {turn}: {problem}")
            params = replace(plan.params, seed=offset_seed(plan.params.seed, turn))
            warm_first = (turn + flip) % 2 == 0
            runs = _cold_and_warm(ring, prompt_ids, params, plan, target, reuse, warm_first)
            rows.append(_row(turn, len(prompt_ids), *runs))
            log(_describe(swarm.link_delay_ms, rows[-1]))
            reply = [t for t in runs[0].tokens if t not in target.eos_ids]
            messages.append({"role": "assistant", "content": target.decode(reply)})
            messages.append({"role": "user", "content": FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]})
    finally:
        ring.close()
        client.close()
    return rows


def _cold_and_warm(
    ring: Ring,
    prompt_ids: list[int],
    params: SamplingParams,
    plan: Plan,
    target: Target,
    reuse: Reuse,
    warm_first: bool,
) -> tuple[TurnRun, TurnRun]:
    """The turn cold and warm, in the order asked."""
    eos = target.eos_ids

    def cold() -> TurnRun:
        return run_turn(ring, prompt_ids, params, plan.draft_k, plan.tokens, eos)

    def warm() -> TurnRun:
        return run_turn(ring, prompt_ids, params, plan.draft_k, plan.tokens, eos, reuse)

    if warm_first:
        warm_run = warm()
        return cold(), warm_run
    cold_run = cold()
    return cold_run, warm()


def _row(turn: int, context: int, cold: TurnRun, warm: TurnRun) -> dict:
    return {
        "turn": turn,
        "context_tokens": context,
        "reused": warm.reused,
        "warm_replays": warm.replays,
        "new_tokens": len(cold.tokens),
        "first_token_s": {"cold": cold.first_token_s, "warm": warm.first_token_s},
        "first_token_ratio": warm.first_token_s / cold.first_token_s,
        "done_s": {"cold": cold.done_s, "warm": warm.done_s},
        "identical": warm.tokens == cold.tokens,
    }


def conversation(
    model: str,
    n_stages: int,
    delays: Sequence[float],
    plan: Plan,
    target_ratio: float,
    log: Log,
) -> dict:
    """The conversation at every delay, and its checks; see the module docstring."""
    target = open_target(model)
    runs = []
    for i, delay in enumerate(delays):
        with LocalSwarm(model, n_stages, link_delay_ms=delay) as swarm:
            rows = conversation_at(swarm, target, plan, bool(i % 2), log)
        later = [row["first_token_ratio"] for row in rows[1:]]
        worst = max(later) if later else None
        runs.append(
            {
                "hop_delay_ms": delay,
                "turns": rows,
                "worst_later_first_token_ratio": worst,
                "target_met": worst is not None and worst <= target_ratio,
            }
        )
    identical = all(row["identical"] for run in runs for row in run["turns"])
    reused = all(row["reused"] > 0 for run in runs for row in run["turns"][1:])
    met = all(run["target_met"] for run in runs)
    return {
        "model": target.name,
        "stages": n_stages,
        "turns": plan.turns,
        "context_tokens": plan.context_tokens,
        "tokens": plan.tokens,
        "temp": plan.params.temp,
        "top_p": plan.params.top_p,
        "sampler": plan.params.sampler,
        "draft_k": plan.draft_k,
        "seed": plan.params.seed,
        "target_ratio": target_ratio,
        "runs": runs,
        "identical": identical,
        "reused_every_later_turn": reused,
        "verdict": "PASS" if identical and reused and met else "FAIL",
    }


def _describe(delay: float, row: dict) -> str:
    first, done = row["first_token_s"], row["done_s"]
    return (
        f"delay {delay:g} ms, turn {row['turn']}: {row['context_tokens']} tokens, "
        f"{row['reused']} reused; first token cold {first['cold']:.2f} s, warm "
        f"{first['warm']:.2f} s ({row['first_token_ratio']:.3f}x); done cold {done['cold']:.2f} s, "
        f"warm {done['warm']:.2f} s; identical {row['identical']}"
    )


def report(result: dict) -> list[str]:
    """The result as lines for a terminal: a table per delay, then the checks."""
    lines = [
        f"{result['model']} on {result['stages']} stages: {result['turns']} turns, the first "
        f">= {result['context_tokens']} tokens of context, <= {result['tokens']} new tokens a "
        f"turn, temp {result['temp']:g} ({result['sampler']}), adaptive K <= {result['draft_k']}"
    ]
    head = (
        "turn  context  reused  first token s: cold    warm  ratio  total s: cold    warm  "
        "identical"
    )
    for run in result["runs"]:
        lines += [f"{run['hop_delay_ms']:g} ms per hop", head]
        for row in run["turns"]:
            first, done = row["first_token_s"], row["done_s"]
            same = "yes" if row["identical"] else "NO"
            lines.append(
                f"{row['turn']:>4}  {row['context_tokens']:>7}  {row['reused']:>6}  "
                f"{first['cold']:>19.2f}  {first['warm']:>6.2f}  {row['first_token_ratio']:>5.3f}  "
                f"{done['cold']:>13.2f}  {done['warm']:>6.2f}  {same}"
            )
    for run in result["runs"]:
        worst = run["worst_later_first_token_ratio"]
        shown = "-" if worst is None else f"{worst:.3f}"
        lines.append(
            f"{run['hop_delay_ms']:g} ms per hop: time to first token warm/cold from turn 2 on, "
            f"at most {shown} (target <= {result['target_ratio']:g}): "
            + ("met" if run["target_met"] else "NOT met")
        )
    lines.append(
        f"identical tokens with and without reuse: {'yes' if result['identical'] else 'NO'}; "
        f"every later turn reused a prefix: {'yes' if result['reused_every_later_turn'] else 'NO'}"
    )
    return lines
