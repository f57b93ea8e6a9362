"""The draft head's data, training and evaluation, all offline and on the CPU.

Data: the target continues the project's own prompts (those below; none is downloaded), several
sessions per forward (`StageModel.forward_many`), sampled with the Gumbel-max coupling at a
temperature between 0.7 and 1.0. The whole model is one stage; a hook on its final norm keeps
the residual stream that enters it (the pre-norm feature h_j of every position j), and the
forward's own logits give the target's distribution at every position, of which the top
`TEACHER_TOP` probabilities are kept.

Training (self-distillation): from (h_j, x_{j+1}) the head predicts ĥ_{j+1}; its logits through
the target's norm and head are pulled towards the target's distribution at j+1 (cross-entropy
to the kept top probabilities, renormalised), and rms(ĥ) towards rms(h_{j+1}) (feature
regression, as EAGLE does). The head is then run once more on its own ĥ_{j+1} and x_{j+2}, so it
learns to draft from its own features, as it does from draft 2 on.

Evaluation on held-out prompts: the target generates (Gumbel draws at temp/top_p, or greedy);
at every generated position T the head drafts K tokens from (h_{T-1}, x_T) with the noise of
positions T+1 … T+K, and each draft is compared with the target's own token there. The n-gram
drafter runs on the same text.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from specpipe.core.coupling import gumbel_draw
from specpipe.core.ring import Request
from specpipe.core.sampling import SamplingParams, draw, target_probs, uniform
from specpipe.core.tree import MAX_RANK
from specpipe.drafting.coupled import coupled_draft, ranked_candidates
from specpipe.drafting.head import DraftHead, TargetParts, frequent_tokens
from specpipe.drafting.head_attention import WINDOW, DraftRows, SessionPast, rms
from specpipe.drafting.ngram import NgramDrafter
from specpipe.prompts import DEFAULT_GENERATION_PROMPT, DEFAULT_PROMPTS
from specpipe.transformer import heap

Log = Callable[[str], None]

TEACHER_TOP = 64  # target probabilities kept per position
CONTINUATION_TOKENS = 128  # the longest continuation of a training prompt
TRAIN_TEMPS = (0.0, 0.7, 0.8, 0.9, 1.0)  # the continuations' temperatures in turn; 0: greedy
HEAD_HIDDEN = 1024  # the head's MLP width

# Prompts the training data continues: the project's own, more of other kinds, and the
# requests of TASKS about SUBJECTS. The benches' prompts are not among them.
WRITTEN_PROMPTS = (
    *DEFAULT_PROMPTS,
    DEFAULT_GENERATION_PROMPT,
    "Explain how a refrigerator keeps food cold.",
    "Write a recipe for a vegetable soup.",
    "What are the main causes of the seasons on Earth?",
    "Give five tips for learning a new language.",
    "Describe a busy market in the morning.",
    "Write a dialogue between a teacher and a student about fractions.",
    "Explain what a computer program is to a child.",
    "Write a product description for a waterproof backpack.",
    "Summarise the plot of a detective story you invent.",
    "List the steps to plant a tree.",
    "Write an email asking a colleague to reschedule a meeting.",
    "Why do cats purr? Give a short answer.",
    "Describe the life cycle of a butterfly.",
    "Write a haiku about autumn leaves.",
    "Explain the difference between weather and climate.",
    "Write a short speech for a school graduation.",
    "How does a bicycle stay upright?",
    "Tell a joke about a programmer and a duck.",
    "Write a diary entry of an astronaut on the first day in orbit.",
    "Explain how to make a paper airplane.",
    "What is photosynthesis? Explain in simple words.",
    "Write a review of an imaginary restaurant.",
    "Describe your ideal weekend.",
    "Give advice to someone starting their first job.",
    "Write a Python function that reverses a string, and explain it.",
    "Explain why exercise is good for health.",
    "Describe a thunderstorm from the point of view of a tree.",
    "Write a limerick about a forgetful wizard.",
    "What should I pack for a camping trip?",
    "Explain how the internet sends a message from one computer to another.",
    "Write the opening paragraph of a fantasy novel.",
    "Compare tea and coffee.",
    "Write a thank-you note to a neighbour.",
    "Explain the rules of chess briefly.",
    "Describe a robot that helps in a hospital.",
    "Write a short mystery set on a train.",
    "How do bees make honey?",
    "Write a motivational message for a student before an exam.",
)
TASKS = (
    "Write a short story about {}.",
    "Explain {} to a ten-year-old.",
    "Write a poem about {}.",
    "Give three surprising facts about {}.",
    "Describe {} in vivid detail.",
    "What are the advantages and disadvantages of {}?",
    "Write a news report about {}.",
    "Write a conversation between two friends about {}.",
    "List five questions a curious student might ask about {}, and answer one.",
    "Write a short essay on {}.",
    "Tell the history of {} in a few paragraphs.",
    "Write an advertisement for {}.",
    "Give step-by-step advice for someone who wants to learn about {}.",
    "Write a diary entry of a person who spends a day with {}.",
    "Write a funny anecdote involving {}.",
    "Explain why {} matters to ordinary people.",
)
SUBJECTS = (
    "volcanoes",
    "the honeybee",
    "a small bakery",
    "the printing press",
    "electric cars",
    "a mountain village",
    "the violin",
    "recycling",
    "black holes",
    "a rainy Monday",
    "the postal service",
    "ancient Rome",
    "coral reefs",
    "a chess tournament",
    "solar panels",
    "a city park",
    "the human heart",
    "penguins",
    "a second-hand bookshop",
    "the Silk Road",
    "vaccines",
    "a lost umbrella",
    "the metro at rush hour",
    "glaciers",
    "a family dinner",
    "origami",
    "the first telephone",
    "deserts",
    "a school science fair",
    "wind turbines",
    "a friendly ghost",
    "the Olympic Games",
    "bread",
    "a haunted castle",
    "the water cycle",
    "an old typewriter",
    "space stations",
    "a football match",
    "mushrooms",
    "the compass",
    "a night train",
    "honey",
    "the immune system",
    "a talking parrot",
    "public libraries",
    "earthquakes",
    "a jazz band",
    "the wheel",
    "grasslands",
    "a birthday surprise",
    "artificial intelligence",
    "a snowstorm",
    "the Great Wall of China",
    "octopuses",
    "a farmers' market",
    "the microscope",
    "a harbour crane",
    "pirates",
    "sleep",
    "a robot gardener",
    "the Moon landing",
    "chocolate",
    "a mountain rescue team",
    "rivers",
    "a vintage bicycle",
    "the stock market",
    "dinosaurs",
    "a summer festival",
    "clocks",
    "the Arctic",
    "a street musician",
    "bridges",
    "a time traveller",
    "kindness",
    "a spaceship crew",
    "maps",
    "a small dog",
    "the ocean floor",
    "a village fair",
)
TRAIN_PROMPTS = (
    *WRITTEN_PROMPTS,
    *(task.format(subject) for subject in SUBJECTS for task in TASKS),
)

# Held out: never continued for training.
EVAL_PROMPTS = (
    "Describe an underwater city and the people who live there.",
    "Write a story about a clock that runs backwards.",
    "Explain how a lighthouse lens works.",
    "Write a letter to your future self.",
    "What would happen if the moon disappeared?",
    "Invent a holiday and describe how people celebrate it.",
    "Write a poem about a quiet library.",
    "Give a tour of a museum of lost socks.",
)


@dataclass
class Sequences:
    """Generated text with what the target computed at each position, flattened.

    A sequence's rows run from its last prompt token (position n-1) to its last token. Row j:
    the token at that position, the pre-norm feature there [D], the target's top probabilities
    for the next position, and `left[j]`: rows after j in the same sequence."""

    tokens: np.ndarray  # [M] int64
    features: torch.Tensor  # [M, D] float32
    top_ids: torch.Tensor  # [M, TEACHER_TOP] int64
    top_probs: torch.Tensor  # [M, TEACHER_TOP] float32
    left: np.ndarray  # [M] int64
    positions: np.ndarray  # [M] int64: the absolute position of each row
    seeds: np.ndarray  # [M] uint64: the seed its sequence was sampled with (any 64-bit seed)
    starts: list[int] = field(default_factory=list)  # the first row of each sequence
    prompts: list[list[int]] = field(default_factory=list)  # each sequence's prompt
    # The states entering the layers an EAGLE-3 head taps, side by side [M, taps x D], float16;
    # None unless asked for (`generate`'s `taps`).
    taps: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def generated(self) -> int:
        """Tokens the target sampled (the rows that are not a prompt's last token)."""
        return len(self.tokens) - len(self.starts)


@dataclass
class _Session:
    name: str
    prompt: list[int]
    seed: int
    temp: float
    tokens: list[int] = field(default_factory=list)  # from the prompt's last token on
    features: list[torch.Tensor] = field(default_factory=list)
    top_ids: list[torch.Tensor] = field(default_factory=list)
    top_probs: list[torch.Tensor] = field(default_factory=list)
    taps: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class Continuation:
    """One sequence to generate: a prompt's ids, the seed and temperature of its draws."""

    prompt: list[int]
    seed: int
    temp: float  # <= 0: greedy


def generate(
    stage,
    jobs: Sequence[Continuation],
    top_p: float,
    max_new: int,
    width: int = 48,
    eos_ids: Sequence[int] = (),
    log: Log | None = None,
    taps: tuple[int, ...] = (),
) -> Sequences:
    """Continue each job's prompt on `stage` (the whole model) by max_new tokens or to EOS,
    with Gumbel draws at its seed and temp; up to `width` sessions in each forward. Keeps each
    position's pre-norm feature and the target's top probabilities, and with `taps` the states
    entering those layers (an EAGLE-3 head's)."""
    captured: list[torch.Tensor] = []
    hook = stage.norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    queue = [
        _Session(f"draft-data-{i}", list(job.prompt), job.seed, job.temp)
        for i, job in enumerate(jobs)
    ]
    sessions, active, sampled = list(queue), [], 0
    queue.reverse()
    started, reported = time.perf_counter(), 0
    try:
        while queue or active:
            while queue and len(active) < width:
                active.append(queue.pop())
            # A new session sends its prompt and keeps only the last row; the others their token.
            requests = [
                Request(s.name, torch.tensor(s.prompt), 0, 1, taps=taps)
                if not s.tokens
                else Request(
                    s.name,
                    torch.tensor(s.tokens[-1:]),
                    len(s.prompt) + len(s.tokens) - 2,
                    taps=taps,
                )
                for s in active
            ]
            captured.clear()
            outs = stage.forward_many(requests)
            (features,) = captured  # [one row per session, D]: what entered the final norm
            still = []
            for s, row, logits in zip(active, features, outs, strict=True):
                if isinstance(logits, BaseException):
                    raise logits
                if not s.tokens:
                    s.tokens.append(s.prompt[-1])
                s.features.append(row[None].float().clone())
                if taps:  # the round's last row: the prompt's last token, or the token sent
                    s.taps.append(stage.tapped.pop(s.name)[-1:].to(torch.float16))
                top = torch.softmax(logits.float(), dim=-1).topk(TEACHER_TOP, dim=-1)  # temp 1
                s.top_ids.append(top.indices)
                s.top_probs.append(top.values)
                if len(s.tokens) > max_new or (len(s.tokens) > 1 and s.tokens[-1] in eos_ids):
                    stage.drop(s.name)
                    continue
                pos = len(s.prompt) + len(s.tokens) - 1
                s.tokens.append(_target_draw(logits[-1].numpy(), s.temp, top_p, s.seed, pos))
                sampled += 1
                still.append(s)
            if len(still) < len(active):
                heap.trim()  # the caches of the sessions that ended, else the heap keeps them
            active = still
            if log and sampled - reported >= 500:
                reported = sampled
                rate = sampled / (time.perf_counter() - started)
                log(f"  generated {sampled} tokens ({rate:.1f} tok/s)")
    finally:
        hook.remove()
    return _flatten(sessions)


def _target_draw(logits: np.ndarray, temp: float, top_p: float, seed: int, pos: int) -> int:
    if temp <= 0:
        return int(np.argmax(logits))
    return gumbel_draw(target_probs(logits, temp, top_p), seed, pos)


def _flatten(sessions: Sequence[_Session]) -> Sequences:
    tokens, left, positions, seeds, starts = [], [], [], [], []
    for s in sessions:
        s.tokens = s.tokens[: len(s.features)]  # the last draw was never fed back
        starts.append(len(tokens))
        tokens += s.tokens
        length = len(s.tokens)
        left += [length - 1 - j for j in range(length)]
        positions += [len(s.prompt) - 1 + j for j in range(length)]
        seeds += [s.seed] * length
    return Sequences(
        tokens=np.array(tokens, dtype=np.int64),
        features=torch.cat([f for s in sessions for f in s.features]),
        top_ids=torch.cat([t for s in sessions for t in s.top_ids]),
        top_probs=torch.cat([t for s in sessions for t in s.top_probs]),
        left=np.array(left, dtype=np.int64),
        positions=np.array(positions, dtype=np.int64),
        seeds=np.array(seeds, dtype=np.uint64),
        starts=starts,
        prompts=[s.prompt for s in sessions],
        taps=torch.cat([t for s in sessions for t in s.taps]) if sessions[0].taps else None,
    )


# ---------------------------------------------------------------------------------------------
# Training


def training_parts(stage) -> TargetParts:
    """The target's embedding, norm and head as plain, frozen products for training."""
    stage.requires_grad_(False)
    embed_weight = stage.embed.weight  # [V, D]
    head_weight = stage.head.weight if stage.head.weight is not None else embed_weight
    return TargetParts(
        embed=lambda ids: F.embedding(ids, embed_weight),
        norm=stage.norm,
        head=lambda x: F.linear(x, head_weight),
        head_weight=head_weight,
    )


def teacher(vocab: torch.Tensor | None, data: Sequences, rows: torch.Tensor):
    """The target's kept top probabilities at `rows` [...] as (probabilities, head columns)
    [..., TOP]: for a head drafting only the tokens `vocab` (sorted ids; None: all), its mass
    on them, renormalised."""
    probs, columns = data.top_probs[rows], data.top_ids[rows]
    if vocab is not None:
        size = int(max(data.top_ids.max(), vocab.max())) + 1
        column_of = torch.full((size,), -1, dtype=torch.long)  # token -> column, or -1
        column_of[vocab] = torch.arange(len(vocab))
        columns = column_of[columns]
        probs = torch.where(columns >= 0, probs, 0.0)
        columns = columns.clamp(min=0)
    return probs / probs.sum(-1, keepdim=True).clamp(min=1e-9), columns


def _step_loss(
    head: DraftHead,
    parts: TargetParts,
    data: Sequences,
    h: torch.Tensor,
    rows: torch.Tensor,
    mask: torch.Tensor | None,
    feature_weight: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, cross-entropy) of predicted features h [..., D] for the target's rows [...]:
    cross-entropy to its distribution there plus the feature regression, averaged over the
    rows `mask` [...] keeps (all when None)."""
    target, columns = teacher(head.vocab, data, rows)
    log_q = torch.log_softmax(head.read(parts, h), dim=-1).gather(-1, columns)  # [..., TOP]
    ce = -(target * log_q).sum(-1)
    regression = (rms(h) - rms(data.features[rows])).pow(2).mean(-1)
    if mask is None:
        return ce.mean() + feature_weight * regression.mean(), ce.mean()
    count = mask.sum().clamp(min=1)
    ce, regression = (ce * mask).sum() / count, (regression * mask).sum() / count
    return ce + feature_weight * regression, ce


def distill_loss(
    head: DraftHead,
    parts: TargetParts,
    data: Sequences,
    rows: torch.Tensor,
    unroll: int,
    feature_weight: float = 1.0,
) -> tuple[torch.Tensor, list[float]]:
    """The loss of a head without attention on training rows j (each with `unroll` rows
    after it), and each step's cross-entropy."""
    h = data.features[rows]  # [B, D]: h_j
    loss, ces = torch.zeros(()), []
    for r in range(1, unroll + 1):
        nxt = rows + r
        h, _ = head.step(parts, h, torch.as_tensor(data.tokens[nxt]))  # ĥ_{j+r}
        step_loss, ce = _step_loss(head, parts, data, h, nxt, None, feature_weight)
        loss = loss + step_loss
        ces.append(float(ce.detach()))
    return loss / unroll, ces


def window_loss(
    head: DraftHead,
    parts: TargetParts,
    data: Sequences,
    firsts: torch.Tensor,
    unroll: int,
    feature_weight: float = 1.0,
) -> tuple[torch.Tensor, list[float]]:
    """The loss of a head with attention on windows of rows from `firsts` [B] to the end of
    their sequences (at most the head's window of pairs), and each step's cross-entropy.

    Pair i of a window is (h at row f+i, the token at row f+i+1) and predicts row f+i+1; step
    s runs the head on its own step s-1 features with the tokens one row on, each row seeing
    the real pairs up to its own and its own earlier steps (`PastAttention.attend_window`)."""
    attention = head.attention
    left = torch.as_tensor(data.left[firsts.numpy()])  # [B]: rows after each first
    length = int(min(attention.window, int(left.max())))
    offsets = torch.arange(length)
    rows = (firsts[:, None] + offsets).clamp(max=len(data) - 1)  # [B, L]
    tokens = torch.as_tensor(data.tokens)
    h = data.features[rows]  # [B, L, D]
    loss, ces, real, own = torch.zeros(()), [], None, []
    for s in range(1, unroll + 1):
        nxt = (rows + s).clamp(max=len(data) - 1)
        mask = (offsets[None, :] + s <= left[:, None]).float()  # row f+i+s is in the sequence
        x = head.pair(h, parts.embed(tokens[nxt]).float())
        x, kv = attention.attend_window(x, s, real, own)
        if real is None:
            real = kv
        else:
            own.append(kv)
        h = head.block(x)
        step_loss, ce = _step_loss(head, parts, data, h, nxt, mask, feature_weight)
        loss = loss + step_loss
        ces.append(float(ce.detach()))
    return loss / unroll, ces


def train_head(
    parts: TargetParts,
    data: Sequences,
    steps: int,
    batch: int = 128,
    unroll: int = 2,
    lr: float = 2e-3,
    seed: int = 0,
    hidden: int = HEAD_HIDDEN,
    draft_vocab: int = 0,
    heads: int = 0,
    window: int = WINDOW,
    log: Log | None = None,
) -> tuple[DraftHead, list[float]]:
    """Train a head on `data` for `steps` AdamW steps (cosine decay); the loss per step. With
    `draft_vocab` > 0 it drafts only that many tokens, those the target gave most mass. With
    `heads` > 0 it has an attention layer of that many heads over the last `window` pairs, and
    learns on windows of that many rows, `batch` // `window` of them a step; else on `batch`
    rows."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    vocab = None
    if draft_vocab > 0 and parts.head_weight is not None:
        vocab = frequent_tokens(data.top_ids, data.top_probs, len(parts.head_weight), draft_vocab)
    head = DraftHead(data.features.shape[1], hidden, vocab, heads, window)
    usable = np.flatnonzero(data.left >= unroll)
    if len(usable) == 0:
        raise ValueError(f"no sequence is longer than {unroll + 1} tokens: nothing to train on")

    def step_loss() -> tuple[torch.Tensor, list[float]]:
        if heads:
            count = min(max(1, batch // window), len(usable))
            firsts = torch.as_tensor(rng.choice(usable, size=count, replace=False))
            return window_loss(head, parts, data, firsts, unroll)
        rows = torch.as_tensor(rng.choice(usable, size=min(batch, len(usable)), replace=False))
        return distill_loss(head, parts, data, rows, unroll)

    losses = fit(head, steps, lr, step_loss, log)
    return head.eval(), losses


def fit(
    model: torch.nn.Module,
    steps: int,
    lr: float,
    step_loss: Callable[[], tuple[torch.Tensor, list[float]]],
    log: Log | None = None,
) -> list[float]:
    """Train `model` for `steps` AdamW steps on the loss `step_loss()` draws a batch for (with
    each draft step's cross-entropy): cosine decay to a tenth of `lr` after a short warm-up,
    gradients clipped at 1. The loss per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses, started = [], time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            warm = min(1.0, (step + 1) / max(1, steps // 20))
            group["lr"] = lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        loss, ces = step_loss()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if log and (step % 25 == 0 or step == steps - 1):
            spent = time.perf_counter() - started
            log(
                f"  step {step + 1}/{steps}: loss {np.mean(losses[-25:]):.3f}, cross-entropy per "
                f"draft step {', '.join(f'{c:.2f}' for c in ces)} ({spent:.0f} s)"
            )
    return losses


# ---------------------------------------------------------------------------------------------
# Evaluation


@dataclass
class DrafterScore:
    """Per draft position j = 1..K: how often drafts 1..j all equal the target's tokens."""

    accepted: list[float]  # P(drafts 1..j accepted)
    rounds: int  # positions a round was started from

    @property
    def per_position(self) -> list[float]:
        """P(draft j accepted | drafts before it were)."""
        before = [1.0, *self.accepted[:-1]]
        return [a / b if b else 0.0 for a, b in zip(self.accepted, before, strict=True)]

    def tokens_per_round(self, k: int) -> float:
        """Expected committed tokens per round with K = k: the target's own plus accepted."""
        return 1.0 + sum(self.accepted[:k])

    def as_dict(self) -> dict[str, object]:
        k = len(self.accepted)
        return {
            "rounds": self.rounds,
            "accepted_through": self.accepted,
            "per_position": self.per_position,
            "tokens_per_round": {str(i): self.tokens_per_round(i) for i in range(1, k + 1)},
        }


def score(matches: np.ndarray) -> DrafterScore:
    """matches [N, K] bool: draft j of round n equals the target's token."""
    through = np.cumprod(matches, axis=1).mean(axis=0) if len(matches) else np.zeros(0)
    return DrafterScore([float(a) for a in through], len(matches))


def round_rows(data: Sequences, k: int) -> np.ndarray:
    """The rows j = T-1 for every generated position T of every sequence that has K tokens
    after it: a round whose last committed token is x_T drafts positions T+1 … T+K."""
    rows = []
    for start in data.starts:
        # Row start + i is position n-1+i; T runs over the generated positions n … with
        # T + K at most the last, so the rows are start … start + length - 2 - K.
        rows += range(start, start + int(data.left[start]) - k)
    return np.array(rows, dtype=np.int64)


@torch.inference_mode()
def head_drafts(
    head: DraftHead,
    parts: TargetParts,
    data: Sequences,
    rows: np.ndarray,
    k: int,
    params: SamplingParams,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Drafts [N, K] from each row j = T-1 (h_{T-1}, and x_T at row j+1) with its sequence's
    seed; the overlap Σ_i min(p_i, q_i) [N] of the head's first draft distribution q with the
    target's p at T+1 (computed from the target's own h_T); and [N] whether the inverse-CDF
    draws of p and q at the sampler's u_{T+1} would agree. A head with attention sees the
    real pairs of its sequence before T, as at a tail."""
    h = data.features[rows]  # [N, D]
    tokens = torch.as_tensor(data.tokens[rows + 1])  # [N]: x_T
    pasts = None if head.attention is None else _pasts(head, parts, data, rows)
    target = parts.head(parts.norm(data.features[rows + 1])).float().numpy()  # [N, V]
    drafts = np.zeros((len(rows), k), dtype=np.int64)
    overlap = np.zeros(len(rows))
    inverse_cdf = np.zeros(len(rows), dtype=bool)
    ids = head.token_ids()
    for j in range(1, k + 1):
        h, logits = _draft_step(head, parts, data, rows, pasts, h, tokens, j)
        z = logits.numpy()
        for n, row in enumerate(rows):
            seed, position = int(data.seeds[row]), int(data.positions[row]) + 1 + j
            seeded = SamplingParams(params.temp, params.top_p, params.top_k, seed)
            drafts[n, j - 1] = coupled_draft(z[n], seeded, position, ids)
            if j == 1:
                p = target_probs(target[n], params.temp, params.top_p, params.top_k)
                q = target_probs(z[n], params.temp, params.top_p, params.top_k)
                if ids is not None:  # on the whole vocabulary, zero off the head's tokens
                    q = np.zeros_like(p)
                    q[ids] = target_probs(z[n], params.temp, params.top_p, params.top_k)
                overlap[n] = np.minimum(p, q).sum()
                # Today's coupling for comparison: both inverse CDFs at the shared u_t (for
                # greedy both are one-hot and any u gives their argmax).
                u = np.array(uniform(seed, position))
                inverse_cdf[n] = draw(p, u) == draw(q, u)
        tokens = torch.as_tensor(drafts[:, j - 1])
    return drafts, overlap, inverse_cdf


def _draft_step(
    head: DraftHead,
    parts: TargetParts,
    data: Sequences,
    rows: np.ndarray,
    pasts: list[DraftRows] | None,
    h: torch.Tensor,
    tokens: torch.Tensor,
    j: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft step j of every round row: (ĥ_{T+j-1} [N, D], logits for position T+j [N, V'])
    from h [N, D] and the tokens at T+j-1 [N]."""
    if pasts is None:
        return head.step(parts, h, tokens)
    for row, past in zip(rows, pasts, strict=True):  # one row at a time: each has its own past
        past.position = int(data.positions[row]) + j  # T + j - 1
    steps = [head.step(parts, h[n : n + 1], tokens[n : n + 1], pasts[n]) for n in range(len(rows))]
    return torch.cat([a for a, _ in steps]), torch.cat([b for _, b in steps])


@torch.inference_mode()
def path_ranks(
    head: DraftHead,
    parts: TargetParts,
    data: Sequences,
    rows: np.ndarray,
    depth: int,
    params: SamplingParams,
) -> np.ndarray:
    """[N, depth]: from each round row j = T-1, the walk a tree takes under the coupling,
    which follows the target's own tokens: at depth d (0-based) the rank of x_{T+1+d} among
    the head's `MAX_RANK` best candidates (`ranked_candidates`) at the node the walk is at, the
    head having been fed x_{T+1} … x_{T+d}; -1 where it is not among them, and at every depth
    after. All zeros through depth d is a chain's drafts 1 … d+1 accepted."""
    h = data.features[rows]
    tokens = torch.as_tensor(data.tokens[rows + 1])  # x_T
    pasts = None if head.attention is None else _pasts(head, parts, data, rows)
    ranks = np.full((len(rows), depth), -1, dtype=np.int64)
    alive = np.ones(len(rows), dtype=bool)
    ids = head.token_ids()
    for d in range(depth):
        h, logits = _draft_step(head, parts, data, rows, pasts, h, tokens, d + 1)
        z = logits.numpy()
        truth = data.tokens[rows + 2 + d]  # x_{T+1+d}
        for n in np.flatnonzero(alive):
            row = int(rows[n])
            seeded = SamplingParams(params.temp, params.top_p, params.top_k, int(data.seeds[row]))
            position = int(data.positions[row]) + 2 + d
            ranked = ranked_candidates(z[n], seeded, position, ids, MAX_RANK)
            if int(truth[n]) in ranked:
                ranks[n, d] = ranked.index(int(truth[n]))
            else:
                alive[n] = False
        tokens = torch.as_tensor(truth)  # the walk goes on along the target's tokens
    return ranks


def best_trees(ranks: np.ndarray, halves: np.ndarray, sizes: Sequence[int]) -> dict[str, float]:
    """Expected tokens per round of the best tree of each size N (drafts) for the walks `ranks`
    ([N, depth], `path_ranks`): a tree is a set of rank paths closed under prefixes, and a round
    commits one token more than the nodes its walk passes, so the best tree of N drafts is the
    N rank paths walked most often. They are chosen on one half of the rounds (`halves`, bool)
    and scored on the other, then the other way round, averaged: the choice is not scored on
    the noise it was fitted to. "any" is every tree at once (each node's `MAX_RANK` candidates to
    the full depth): no tree of this head at this depth commits more."""

    def walked(part: np.ndarray) -> dict[tuple[int, ...], int]:
        counts: dict[tuple[int, ...], int] = {}
        for walk in part:
            for d in range(len(walk)):
                if walk[d] < 0:
                    break
                key = tuple(int(r) for r in walk[: d + 1])
                counts[key] = counts.get(key, 0) + 1
        return counts

    first, second = walked(ranks[halves]), walked(ranks[~halves])
    folds = []  # (paths best first as one half walked them, how often the other half did)
    for fitted, seen in ((first, second), (second, first)):
        # A path is walked no more often than its prefix: on a tie the shorter goes first, so
        # every cut of this order is a tree.
        order = sorted(fitted, key=lambda path: (-fitted[path], len(path), path))
        folds.append((order, seen))
    scores: dict[str, float] = {}
    for n in sizes:
        # Nodes passed by the walks of the half each tree was not chosen on.
        passed = sum(seen.get(path, 0) for order, seen in folds for path in order[:n])
        scores[str(n)] = 1.0 + passed / max(len(ranks), 1)
    scores["any"] = 1.0 + float((np.cumprod(ranks >= 0, axis=1)).sum(axis=1).mean())
    return scores


TREE_SIZES = (4, 8, 16, 32, 64)  # drafts in the trees `evaluate` scores


def _pasts(
    head: DraftHead, parts: TargetParts, data: Sequences, rows: np.ndarray
) -> list[DraftRows]:
    """For each round row j = T-1, what its first draft step attends: the head's window of real
    pairs of its sequence before position T (pair i: the feature at row i, the token at i+1)."""
    pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a sequence's first row -> k, v
    pasts = []
    for row in rows:
        start = int(data.starts[np.searchsorted(data.starts, row, side="right") - 1])
        if start not in pairs:  # keys and values [H, n, hd] of all the sequence's pairs
            pair_rows = torch.arange(start, start + int(data.left[start]))
            embedded = parts.embed(torch.as_tensor(data.tokens[pair_rows + 1]))
            x = head.pair(data.features[pair_rows], embedded)
            positions = torch.as_tensor(data.positions[pair_rows] + 1)
            _, k, v = head.attention.project(x, positions)
            pairs[start] = (k.transpose(0, 1), v.transpose(0, 1))
        k, v = pairs[start]
        i = int(row) - start  # the pairs of rows start … row-1 come before T
        a = max(0, i - head.attention.window)
        position = int(data.positions[row]) + 1  # T
        pasts.append(DraftRows(SessionPast(k[:, a:i], v[:, a:i], position), position))
    return pasts


def ngram_matches(data: Sequences, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The n-gram drafter on the same rounds: [N, K] whether its draft j equals the target's
    token, and [N] whether it proposed anything. It sees each sequence up to x_T."""
    hits = np.zeros((len(rows), k), dtype=bool)
    proposed = np.zeros(len(rows), dtype=bool)
    sequence_of = {start: i for i, start in enumerate(data.starts)}
    drafter, seen = NgramDrafter(), None  # seen: the last row whose next token it holds
    for n, row in enumerate(rows):
        if (
            seen is None or row != seen + 1 or row in sequence_of
        ):  # a new sequence: the prompt, then its tokens up to x_T
            start = data.starts[int(np.searchsorted(data.starts, row, side="right")) - 1]
            drafter = NgramDrafter()
            drafter.extend(data.prompts[sequence_of[start]][:-1])
            drafter.extend(data.tokens[start : row + 2].tolist())
        else:
            drafter.extend([int(data.tokens[row + 1])])
        seen = row
        proposal = drafter.propose(k)
        proposed[n] = bool(proposal)
        truth = data.tokens[row + 2 : row + 2 + k]
        for j, token in enumerate(proposal[: len(truth)]):
            hits[n, j] = token == truth[j]
    return hits, proposed


def evaluate(
    head: DraftHead, parts: TargetParts, data: Sequences, k: int, params: SamplingParams
) -> dict[str, object]:
    """Agreement per draft position for the head, the n-gram drafter and both (the n-gram
    where it proposes, the head elsewhere), over every generated round start of `data`; the
    head's mean overlap Σ min(p, q) at draft 1, the ceiling of any coupling; and the tokens per
    round of the head's best trees of K levels (`best_trees`), the ceiling of any tree."""
    rows = round_rows(data, k)
    drafts, overlap, inverse_cdf = head_drafts(head, parts, data, rows, k, params)
    truth = np.stack([data.tokens[rows + 1 + j] for j in range(1, k + 1)], axis=1)  # [N, K]
    ranks = path_ranks(head, parts, data, rows, k, params)
    return {
        **round_scores(data, rows, drafts == truth, ranks),
        "head_ceiling_draft_1": float(overlap.mean()) if len(rows) else 0.0,
        "head_inverse_cdf_draft_1": float(inverse_cdf.mean()) if len(rows) else 0.0,
    }


def round_scores(
    data: Sequences, rows: np.ndarray, head_hits: np.ndarray, ranks: np.ndarray
) -> dict[str, object]:
    """What any head scores on the rounds `rows` of `data`, from its hits [N, K] (draft j
    equals the target's token) and its walks' ranks [N, K] (`path_ranks`): agreement per draft
    position for the head, the n-gram drafter and both (the n-gram where it proposes, the head
    elsewhere), and the tokens per round of the head's best trees."""
    k = head_hits.shape[1]
    ngram_hits, proposed = ngram_matches(data, rows, k)
    both_hits = np.where(proposed[:, None], ngram_hits, head_hits)
    sequence = np.searchsorted(np.asarray(data.starts), rows, side="right") - 1
    return {
        "rounds": len(rows),
        "head": score(head_hits).as_dict(),
        "ngram": score(ngram_hits).as_dict(),
        "ngram_proposes": float(proposed.mean()) if len(rows) else 0.0,
        "both": score(both_hits).as_dict(),
        "head_trees": best_trees(ranks, sequence % 2 == 0, TREE_SIZES),
    }


# ---------------------------------------------------------------------------------------------
# What a round's tail costs


def _median_ms(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return float(np.median(times) * 1e3)


def tail_costs(
    stage, head: DraftHead, prompt: Sequence[int], k: int, params: SamplingParams, repeats: int = 20
) -> dict[str, float]:
    """Median milliseconds of the tail's sampling work for one round of K drafts on `prompt`:
    the verify with today's sampler and with the Gumbel one (every draft accepted: all K+1 rows
    drawn), the head's K drafts, and the Gumbel noise of one position over the whole vocabulary
    and over the support temp / top-p / top-k leave."""
    from specpipe.core.coupling import GumbelSampler, gumbel_noise
    from specpipe.core.sampling import Sampler

    session = "tail-costs"
    captured: list[torch.Tensor] = []
    hook = stage.norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    try:
        logits = stage.forward(session, torch.tensor(list(prompt)), 0, last_rows=k + 1)
    finally:
        hook.remove()
        stage.drop(session)
    features = captured[0]  # [K+1, D]
    start = len(prompt) - k
    plain = Sampler.from_params(params)
    gumbel = GumbelSampler.from_params(params)
    # Each sampler's own draws as drafts: accepted all the way.
    own_plain = [plain.sample(logits[j], start + j) for j in range(k)]
    own = [gumbel.sample(logits[j], start + j) for j in range(k)]
    token = gumbel.sample(logits[-1], len(prompt))  # x_T, sampled from the last row
    parts = TargetParts.from_stage(stage)
    support = np.flatnonzero(
        target_probs(logits[0].numpy(), params.temp, params.top_p, params.top_k)
    )
    vocab = np.arange(logits.shape[1])
    return {
        "verify_inverse_cdf_ms": _median_ms(
            lambda: plain.accept(logits, own_plain, start), repeats
        ),
        "verify_gumbel_ms": _median_ms(lambda: gumbel.accept(logits, own, start), repeats),
        "head_drafts_ms": _median_ms(
            lambda: head.draft(parts, features[-1], token, len(prompt), k, params), repeats
        ),
        "noise_whole_vocab_ms": _median_ms(lambda: gumbel_noise(params.seed, 7, vocab), repeats),
        "noise_support_ms": _median_ms(lambda: gumbel_noise(params.seed, 7, support), repeats),
        "support_size": float(len(support)),
        "vocab": float(len(vocab)),
    }
