"""Training an EAGLE-3 head for a model, offline on the CPU, and measuring it on held-out text.

Data: `train.generate` with the head's taps: per row j of a generated sequence, the states
entering the three tapped layers at that position [3·D], its token, and the target's top
probabilities for the next position.

Training-time test (EAGLE-3, section 3.2): the head is trained as it drafts. Step 0 runs every
row of a batch of whole sequences at once, row j fed fuse(taps_j) and the token x_{j+1}, and
attends causally to the rows before it, as the committed rows of a session do at the tail.
Step d ≥ 1 feeds row j the head's own step d-1 output at row j and the true token x_{j+1+d},
one position further on: a draft d deep after the committed row j. It attends the committed
rows 0 … j and its own chain (the same row at steps 1 … d, itself last), nothing else:

    keys of step d, row j:  step 0 rows 0 … j   |  step 1 row j  …  step d row j

Every step's logits over the draft vocabulary are pulled towards the target's distribution
`TEACHER_TOP` probabilities there (cross-entropy, the draft vocabulary's mass renormalised).

The head starts from the target: its lm_head the target's head at the draft vocabulary, its
final norm the target's, fc passing the deepest tap through, and the layer's outputs small, so
that at first it reads the deepest tap with the target's own head.

Evaluation walks each held-out round along the target's own tokens through `Eagle3Drafter`,
as the tail drafts: the rank of each true token among the head's candidates at every depth
(`train.best_trees` turns the ranks into chains' and trees' tokens per round).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from specpipe.core.sampling import SamplingParams
from specpipe.core.tree import MAX_RANK
from specpipe.drafting.coupled import ranked_candidates
from specpipe.drafting.eagle3 import Eagle3Config, Eagle3Head, default_taps
from specpipe.drafting.eagle3_drafter import Eagle3Drafter
from specpipe.drafting.eagle3_format import LAYER
from specpipe.drafting.eagle3_synth import head_config, model_fields
from specpipe.drafting.head import frequent_tokens
from specpipe.drafting.target_parts import TargetParts
from specpipe.drafting.train import (
    Log,
    Sequences,
    fit,
    round_rows,
    round_scores,
    teacher,
)
from specpipe.transformer.config import ModelConfig
from specpipe.transformer.rope import apply_rope

TTT_STEPS = 4  # draft depths trained at once
SEQUENCES_PER_STEP = 8


def head_settings(cfg: ModelConfig, draft_vocab: int, intermediate: int = 0) -> Eagle3Config:
    """An EAGLE-3 head for the model of `cfg`, shaped as the published heads are: the model's
    width and attention, its RoPE, the default taps (each once, in layer order: a model of
    under six layers has fewer than three), one norm over the taps before fc."""
    return Eagle3Config(
        hidden=cfg.dim,
        heads=cfg.n_heads,
        kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        intermediate=intermediate or cfg.intermediate_size,
        draft_vocab=min(draft_vocab, cfg.vocab_size) or cfg.vocab_size,  # 0: every token
        target_vocab=cfg.vocab_size,
        taps=tuple(sorted(set(default_taps(cfg.n_layers)))),
        norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling,
        max_positions=cfg.max_position_embeddings,
        norm_before_fc=True,
    )


def new_head(settings: Eagle3Config, parts: TargetParts, vocab: torch.Tensor | None) -> Eagle3Head:
    """A head of `settings` started from the target (see the module docstring); `vocab` the
    sorted target ids of its draft columns (None: every token)."""
    head = Eagle3Head(settings)
    H = settings.hidden
    ids = torch.arange(settings.target_vocab) if vocab is None else vocab
    with torch.no_grad():
        head.d2t.copy_(ids - torch.arange(len(ids)))
        head.lm_head.weight.copy_(parts.head_weight[ids].float())
        head.norm.weight.copy_(parts.norm.weight.float())
        head.fc.weight.zero_()
        head.fc.weight[:, -H:] = torch.eye(H)  # the deepest tap, through
        head.o_proj.weight.mul_(0.1)
        head.down_proj.weight.mul_(0.1)
    return head


def ttt_outputs(
    head: Eagle3Head,
    parts: TargetParts,
    data: Sequences,
    starts: list[int],
    steps: int = TTT_STEPS,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The training-time test on whole sequences (their first rows `starts`, B of them, padded
    to the longest, N rows): per draft depth d, the layer's output [B, N, H] of every row j,
    the rows it predicts (j+1+d) [B, N] and which of them count [B, N] (inside the sequence).
    See the module docstring for what each row attends."""
    cfg = head.cfg
    lengths = torch.tensor([int(data.left[s]) + 1 for s in starts])  # [B] rows
    B, N = len(starts), int(lengths.max())
    offsets = torch.arange(N)
    rows = (torch.tensor(starts)[:, None] + offsets).clamp(max=len(data) - 1)  # [B, N]
    tokens = torch.as_tensor(data.tokens)
    positions = torch.as_tensor(data.positions)[rows]  # [B, N]
    cos_table, sin_table = head.rotary(0, int(positions.max()) + steps + 1, torch.float32)
    group, scale = cfg.heads // cfg.kv_heads, 1.0 / math.sqrt(cfg.head_dim)
    causal = torch.ones(N, N, dtype=torch.bool).tril()  # [query, key]

    g = head.fuse(data.taps[rows].float())  # [B, N, H]
    keys: list[torch.Tensor] = []  # step s's keys [B, nh, N, hd], values likewise
    values: list[torch.Tensor] = []
    outputs = []
    for d in range(steps):
        nxt = (rows + 1 + d).clamp(max=len(data) - 1)  # the token fed, and the row predicted
        h = head.hidden_norm(g)
        x = torch.cat([head.input_layernorm(parts.embed(tokens[nxt]).float()), h], dim=-1)
        cos, sin = cos_table[positions + d][:, None], sin_table[positions + d][:, None]
        q = head.q_proj(x).view(B, N, cfg.heads, cfg.head_dim).transpose(1, 2)  # [B, nh, N, hd]
        k = head.k_proj(x).view(B, N, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        v = head.v_proj(x).view(B, N, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys.append(k.repeat_interleave(group, dim=1))  # query head i reads KV head i // group
        values.append(v.repeat_interleave(group, dim=1))
        committed = (q @ keys[0].transpose(-1, -2)) * scale  # [B, nh, N, N]
        committed = committed.masked_fill(~causal, float("-inf"))
        chain = [(q * kk).sum(-1, keepdim=True) * scale for kk in keys[1:]]  # [B, nh, N, 1]
        weights = torch.softmax(torch.cat([committed, *chain], dim=-1), dim=-1)
        attn = weights[..., :N] @ values[0]
        for s in range(1, d + 1):
            attn = attn + weights[..., N + s - 1 : N + s] * values[s]
        a = head.o_proj(attn.transpose(1, 2).reshape(B, N, cfg.heads * cfg.head_dim))
        r = (h if cfg.norm_before_residual else g) + a
        m = head.post_attention_layernorm(r)
        out = r + head.down_proj(F.silu(head.gate_proj(m)) * head.up_proj(m))
        counts = offsets[None, :] + 1 + d < lengths[:, None]  # row j+1+d is in the sequence
        outputs.append((out, nxt, counts))
        g = head.feed_back(out)
    return outputs


def ttt_loss(
    head: Eagle3Head,
    parts: TargetParts,
    data: Sequences,
    starts: list[int],
    steps: int = TTT_STEPS,
) -> tuple[torch.Tensor, list[float]]:
    """The training-time test's loss on whole sequences (their first rows `starts`): each
    depth's cross-entropy to the target's distribution, averaged over depths; and each depth's
    cross-entropy."""
    vocab = _vocab(head)
    loss, ces = torch.zeros(()), []
    for out, nxt, counts in ttt_outputs(head, parts, data, starts, steps):
        probs, columns = teacher(vocab, data, nxt)
        log_q = torch.log_softmax(head.logits(out).float(), dim=-1).gather(-1, columns)
        mask = counts.float()
        ce = (-(probs * log_q).sum(-1) * mask).sum() / mask.sum().clamp(min=1)
        loss = loss + ce
        ces.append(float(ce.detach()))
    return loss / steps, ces


def _vocab(head: Eagle3Head) -> torch.Tensor | None:
    """The target ids of the head's draft columns, sorted; None when it drafts them all."""
    if head.cfg.draft_vocab == head.cfg.target_vocab:
        return None
    return torch.as_tensor(head.token_ids())


def train_eagle3(
    settings: Eagle3Config,
    parts: TargetParts,
    data: Sequences,
    steps: int,
    sequences: int = SEQUENCES_PER_STEP,
    ttt_steps: int = TTT_STEPS,
    lr: float = 1e-3,
    seed: int = 0,
    log: Log | None = None,
) -> tuple[Eagle3Head, list[float]]:
    """Train a head of `settings` on `data` (generated with its taps) for `steps` AdamW steps
    of `sequences` whole sequences each (cosine decay after a warm-up); the loss per step. A
    head drafting part of the vocabulary drafts the tokens the target gave most mass."""
    if data.taps is None:
        raise ValueError("the data holds no taps: generate it with the head's taps")
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    vocab = None
    if settings.draft_vocab < settings.target_vocab:
        vocab = frequent_tokens(
            data.top_ids, data.top_probs, settings.target_vocab, settings.draft_vocab
        )
    head = new_head(settings, parts, vocab)
    usable = [s for s in data.starts if data.left[s] >= 2]
    if not usable:
        raise ValueError("no sequence is longer than 2 tokens: nothing to train on")

    def step_loss() -> tuple[torch.Tensor, list[float]]:
        picked = rng.choice(len(usable), size=min(sequences, len(usable)), replace=False)
        return ttt_loss(head, parts, data, [usable[i] for i in picked], ttt_steps)

    losses = fit(head, steps, lr, step_loss, log)
    return head.eval(), losses


def save_head(head: Eagle3Head, model: ModelConfig, folder: Path, meta: dict) -> Path:
    """Write `head` to `folder` in the speculators format (config.json, model.safetensors with
    `meta` as its metadata), as released heads are laid out and `load_eagle3` reads them. (The
    EAGLE format would read a first tap of 1 as SpecForge's counting, one layer on.)"""
    cfg = head.cfg
    folder.mkdir(parents=True, exist_ok=True)
    config = head_config(
        model_fields(model), "speculators", cfg.intermediate, cfg.draft_vocab, cfg.taps
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    ours_to_theirs = {ours: f"layers.0.{theirs}" for theirs, ours in LAYER.items()}
    tensors = {
        ours_to_theirs.get(name, name): tensor.detach().contiguous()
        for name, tensor in head.state_dict().items()
    }
    tensors = {n: t if n == "d2t" else t.to(torch.bfloat16) for n, t in tensors.items()}
    save_file(tensors, folder / "model.safetensors", metadata={"specpipe": json.dumps(meta)})
    return folder


def head_meta(folder: Path) -> dict:
    """What `save_head` recorded of how a head was trained ({} for a released head)."""
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", framework="pt") as handle:
        return json.loads((handle.metadata() or {}).get("specpipe", "{}"))


@torch.inference_mode()
def walk_ranks(
    drafter: Eagle3Drafter, data: Sequences, rows: np.ndarray, depth: int, params: SamplingParams
) -> np.ndarray:
    """[N, depth]: from each round row j = T-1 (its sequence remembered up to it, as a tail
    holds it), the walk a tree takes along the target's tokens: at depth d the rank of
    x_{T+1+d} among the head's `MAX_RANK` best candidates (`ranked_candidates`, led by the
    coupled draft), -1 where it is not among them and at every depth after. Rank 0 through
    depth d is a chain's drafts 1 … d+1 accepted."""
    head = drafter.head
    ranks = np.full((len(rows), depth), -1, dtype=np.int64)
    sequence_of = np.searchsorted(np.asarray(data.starts), rows, side="right") - 1
    remembered = -1
    for n, row in enumerate(rows):
        start = data.starts[sequence_of[n]]
        if sequence_of[n] != remembered:  # the whole sequence once: each walk reads its part
            drafter.forget("eval")
            end = start + int(data.left[start]) + 1
            drafter.remember(
                "eval",
                data.taps[start : end - 1].float(),
                data.tokens[start + 1 : end].tolist(),
                int(data.positions[start]) + 1,
            )
            remembered = sequence_of[n]
        position = int(data.positions[row])  # T - 1
        past = drafter.past_before("eval", position)
        g = head.fuse(data.taps[row : row + 1].float())
        token = int(data.tokens[row + 1])  # x_T
        seeded = SamplingParams(params.temp, params.top_p, params.top_k, int(data.seeds[row]))
        for d in range(depth):
            out, past = head(g, drafter.embed([token]), position + d, past)
            ranked = ranked_candidates(
                drafter.logits(out)[0].numpy(), seeded, position + 2 + d, drafter.ids, MAX_RANK
            )
            truth = int(data.tokens[row + 2 + d])  # x_{T+1+d}
            if truth not in ranked:
                break
            ranks[n, d] = ranked.index(truth)
            g, token = head.feed_back(out), truth
    drafter.forget("eval")
    return ranks


def evaluate_eagle3(
    drafter: Eagle3Drafter, data: Sequences, k: int, params: SamplingParams
) -> dict[str, object]:
    """`train.evaluate`'s scores for an EAGLE-3 head (generated with its taps), but for the
    draft-1 ceilings: agreement per draft position for the head's chains, the n-gram drafter
    and both, over every generated round start of `data`, and the tokens per round of the
    head's best trees of K levels."""
    rows = round_rows(data, k)
    ranks = walk_ranks(drafter, data, rows, k, params)
    return round_scores(data, rows, ranks == 0, ranks)  # rank 0: the coupled draft
