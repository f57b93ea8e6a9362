"""A learned draft head: from the target's last hidden state and the token it just sampled,
predict the next hidden state, and read drafts through the target's own final norm and head.

The design is EAGLE's (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty"): drafting at the feature level, conditioned on the sampled token, with the
target's frozen LM head turning features into tokens. EAGLE's attention layer over the
session's past pairs is there when the head has `heads` (`specpipe/drafting/head_attention.py`; the
tail keeps each session's keys and values); without it the head is an MLP, as Medusa's heads
(Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads") are, and keeps nothing between rounds.

    h      [D]   the target's residual stream before the final norm, at position T-1
                 (the row whose logits sampled x_T)
    e      [D]   the target's embedding of x_T
    x    = fc([rms(h) * w_h ; rms(e) * w_e])                       [2D] -> [D]
    x   += W_o attention(x; the session's past pairs, the row's own path)    (with heads)
    ĥ    = x + W_down(silu(W_gate x') * W_up x'),  x' = rms(x) * w_x      [D] -> [D]
    q    = softmax(head(norm(ĥ)) / temp) …                          the target's norm and head
    draft y_{T+1} from q, then feed (ĥ, y_{T+1}) back for y_{T+2}, … up to K.

Only the head's own weights are stored (safetensors, with metadata naming the model, its shape,
the training command, the data and the seed); the embedding, final norm and head are the
target's, so a head is a few MB.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specpipe.core.sampling import SamplingParams
from specpipe.core.tree import DraftTree, TreeShape
from specpipe.drafting.coupled import coupled_draft
from specpipe.drafting.head_attention import WINDOW, DraftRows, PastAttention, SessionPast, rms
from specpipe.drafting.sources import TailDrafter
from specpipe.drafting.target_parts import DraftHeadError, TargetParts
from specpipe.drafting.tree_growth import RankedTrees, grow_tree

FORMAT = "specpipe-draft-head-1"
SHIPPED = Path(__file__).resolve().parent / "heads"  # the heads the package ships


def shipped_head(label: str) -> Path:
    """Where the package keeps the trained head of the model called `label`."""
    return SHIPPED / f"{label}.safetensors"


class DraftHead(nn.Module):
    """The trainable part: [D] feature + [D] token embedding -> [D] predicted next feature;
    with `heads` > 0, through an attention layer over the session's past pairs first."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        vocab: torch.Tensor | None = None,
        heads: int = 0,
        window: int = WINDOW,
    ) -> None:
        super().__init__()
        self.dim, self.hidden, self.heads, self.window = dim, hidden, heads, window
        # The tokens it drafts (the target's most likely ones): reading a few rows of the
        # target's head instead of all V is most of a draft step's cost. None: all of them.
        self.vocab = None if vocab is None else torch.as_tensor(vocab, dtype=torch.long)
        self._rows: tuple[int, torch.Tensor] | None = None  # (id of the weight, its rows)
        self.w_h = nn.Parameter(torch.ones(dim))  # the scales of the two normed inputs
        self.w_e = nn.Parameter(torch.ones(dim))
        self.fc = nn.Linear(2 * dim, dim, bias=False)
        self.attention = PastAttention(dim, heads, window) if heads else None
        self.w_x = nn.Parameter(torch.ones(dim))
        self.w_gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)
        nn.init.zeros_(self.w_down.weight)  # the block starts as the identity around fc

    def pair(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """h [..., D] (pre-norm feature at T-1), e [..., D] (embedding of x_T) -> x_T [..., D]."""
        return self.fc(torch.cat([rms(h) * self.w_h, rms(e) * self.w_e], dim=-1))

    def block(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP with its residual: x [..., D] -> ĥ_T [..., D]."""
        gate, up = self.w_gate_up(rms(x) * self.w_x).chunk(2, dim=-1)  # [..., I] each
        return x + self.w_down(F.silu(gate) * up)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """h [N, D], e [N, D] -> ĥ_T [N, D] for rows that see nothing but themselves."""
        x = self.pair(h, e)  # [N, D]
        if self.attention is not None:
            x, _ = self.attention.attend_rows(x, DraftRows(None, 0))
        return self.block(x)

    def step(
        self,
        parts: TargetParts,
        h: torch.Tensor,
        tokens: torch.Tensor,
        rows: DraftRows | None = None,
    ):
        """One draft step for N rows: (ĥ [N, D], logits [N, V']) from h [N, D] and ids [N];
        column c of the logits is token `self.vocab[c]` (all V tokens when vocab is None).
        With an attention layer the rows attend what `rows` says (nothing else when None), and
        `rows.own` becomes their paths' keys and values, theirs appended."""
        if self.attention is None or rows is None:
            h_next = self(h.float(), parts.embed(tokens).float())
        else:
            x = self.pair(h.float(), parts.embed(tokens).float())
            x, rows.own = self.attention.attend_rows(x, rows)
            h_next = self.block(x)
        return h_next, self.read(parts, h_next)

    def read(self, parts: TargetParts, h: torch.Tensor) -> torch.Tensor:
        """Logits [..., V'] of predicted features h [..., D], through the target's norm and
        head (the rows of this head's vocabulary)."""
        normed = parts.norm(h.to(_dtype_of(parts)))
        if self.vocab is None:
            return parts.head(normed).float()
        return F.linear(normed, self._head_rows(parts)).float()

    def _head_rows(self, parts: TargetParts) -> torch.Tensor:
        """The rows of the target's head for this head's vocabulary [V', D], taken once."""
        if parts.head_weight is None:
            raise DraftHeadError("this tail holds no plain head weight to draft part of it")
        if self._rows is None or self._rows[0] != id(parts.head_weight):
            weight = parts.head_weight.detach()
            rows = weight[self.vocab.to(weight.device)].contiguous()
            self._rows = (id(parts.head_weight), rows)
        return self._rows[1]

    def token_ids(self) -> np.ndarray | None:
        """The token of each logits column, or None when the columns are the whole vocabulary."""
        return None if self.vocab is None else self.vocab.numpy()

    @torch.inference_mode()
    def draft(
        self,
        parts: TargetParts,
        h_last: torch.Tensor,
        token: int,
        token_pos: int,
        k: int,
        params: SamplingParams,
        past: SessionPast | None = None,
    ) -> list[int]:
        """K drafts for the positions after `token` (at absolute position `token_pos`).

        h_last [D] is the target's pre-norm feature at token_pos - 1; `past` the session's
        committed pairs before token_pos, for a head with attention. Draft j (at token_pos + j)
        is the Gumbel-max draw of the head's distribution with the noise the target draws that
        position with (`specpipe.core.coupling`), or its argmax when greedy: so it agrees with the
        target's own draw as often as the two distributions allow.
        """
        drafts: list[int] = []
        h = h_last.reshape(1, -1)
        rows = DraftRows(past, token_pos)
        for j in range(1, k + 1):
            rows.position = token_pos + j - 1
            h, logits = self.step(parts, h, torch.tensor([token], device=h.device), rows)
            token = coupled_draft(logits[0].cpu().numpy(), params, token_pos + j, self.token_ids())
            drafts.append(token)
        return drafts

    @torch.inference_mode()
    def draft_tree(
        self,
        parts: TargetParts,
        h_last: torch.Tensor,
        token: int,
        token_pos: int,
        shape: TreeShape,
        params: SamplingParams,
        past: SessionPast | None = None,
    ) -> tuple[DraftTree, dict[tuple[int, ...], list[int]]]:
        """A draft tree of `shape` under `token` (at absolute position `token_pos`), and the
        candidates ranked at each node it expanded, keyed by the node's tokens below the root
        (`tree_growth.grow_tree`). h_last [D] is the target's pre-norm feature at token_pos - 1;
        `past` as for `draft`, and a node attends it and the pairs on its own path. A node's
        state is its predicted feature and, with an attention layer, its path's keys and
        values."""

        def step(states: list, ids: list[int], depth: int):
            # One product of the head for every node of this depth.
            h = torch.stack([feature for feature, _ in states])
            rows = DraftRows(past, token_pos + depth)
            if depth and self.attention is not None:
                rows.own = (
                    torch.stack([own[0] for _, own in states]),
                    torch.stack([own[1] for _, own in states]),
                )
            h_next, logits = self.step(parts, h, torch.tensor(ids, device=h.device), rows)
            after = [
                (h_next[i], None if rows.own is None else (rows.own[0][i], rows.own[1][i]))
                for i in range(len(ids))
            ]
            return after, logits.cpu().numpy()

        root = (h_last.reshape(-1), None)
        return grow_tree(shape, token, token_pos, params, self.token_ids(), root, step)

    # -- files ------------------------------------------------------------------------------

    def save(self, path: str | Path, meta: dict[str, object]) -> None:
        """Write the head's weights (float16) and `meta` (JSON-able) to a safetensors file."""
        from safetensors.torch import save_file

        header = {
            "format": FORMAT,
            "dim": str(self.dim),
            "hidden": str(self.hidden),
            "heads": str(self.heads),
            "window": str(self.window),
            "meta": json.dumps(meta, sort_keys=True),
        }
        tensors = {
            name: t.detach().to(torch.float16).contiguous() for name, t in self.state_dict().items()
        }
        if self.vocab is not None:
            tensors["vocab"] = self.vocab.to(torch.int32).contiguous()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=header)

    @classmethod
    def load(cls, path: str | Path) -> tuple[DraftHead, dict[str, object]]:
        """The head in float32 and its metadata; DraftHeadError with a one-line reason."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                header = f.metadata() or {}
            tensors = load_file(str(path))
        except (OSError, SafetensorError) as exc:
            raise DraftHeadError(f"{path}: cannot read a draft head ({exc})") from None
        if header.get("format") != FORMAT:
            raise DraftHeadError(f"{path}: not a draft head file (format {header.get('format')!r})")
        try:
            vocab = tensors.pop("vocab", None)
            heads = int(header.get("heads", 0))  # heads written before attention have none
            window = int(header.get("window", WINDOW))
            head = cls(int(header["dim"]), int(header["hidden"]), vocab, heads, window)
            head.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
            meta = json.loads(header["meta"])
        except (KeyError, ValueError, RuntimeError) as exc:
            raise DraftHeadError(f"{path}: malformed draft head ({str(exc)[:200]})") from None
        return head.eval(), meta


def _dtype_of(parts: TargetParts) -> torch.dtype:
    weight = getattr(parts.norm, "weight", None)
    return weight.dtype if weight is not None else torch.float32


def check_fits(meta: dict[str, object], model: str, dim: int, vocab: int) -> None:
    """DraftHeadError unless a head trained for (model, dim, vocab) is what `meta` records."""
    got = (meta.get("model"), meta.get("dim"), meta.get("vocab"))
    if got != (model, dim, vocab):
        raise DraftHeadError(
            f"the head was trained for model {got[0]!r} (dim {got[1]}, vocab {got[2]}), "
            f"not {model!r} (dim {dim}, vocab {vocab})"
        )


def frequent_tokens(top_ids: torch.Tensor, top_probs: torch.Tensor, vocab: int, n: int):
    """The n tokens with the most target probability over some positions ([M, k] each), as a
    sorted id tensor; None when n covers the vocabulary."""
    if n >= vocab:
        return None
    mass = torch.zeros(vocab).index_add_(0, top_ids.reshape(-1), top_probs.reshape(-1).float())
    return torch.sort(mass.topk(n).indices).values


def open_head(path: str | Path | None, label: str, dim: int, vocab: int):
    """The head at `path` (or shipped for the model `label`) and its metadata, checked against
    the model; DraftHeadError with a one-line reason when it cannot be used."""
    head, meta = DraftHead.load(path or shipped_head(label))
    check_fits(meta, label, dim, vocab)
    return head, meta


def load_with_head(
    load: Callable[..., Sequence],
    path: str | Path | None,
    label: str,
    checkpoint=None,
    pack: bool = True,
) -> tuple[list, TailDrafter | None]:
    """The stages `load(**options)` gives, and the drafter on their tail as a stage worker
    holds it: the head at `path` (a folder: a released EAGLE-3 head, `Eagle3Drafter`; a file:
    a head of ours, `TailHead`), none for "none", else the one the package ships for the model
    `label` if there is one; None too when no stage is the tail.

    The head takes the tail's plain head weight, so with a head the stages load unpacked
    (`pack=False`) and are packed after it is attached (`pack=False`: never, as on a GPU), an
    EAGLE-3 head's own weights with them. A tail whose head is not tied to the embedding
    borrows stage 0's embedding table when it was loaded too, else reads the table from
    `checkpoint`."""
    if path == "none" or (path is None and not shipped_head(label).exists()):
        return list(load() if pack else load(pack=False)), None
    stages, head = list(load(pack=False)), None
    tail = stages[-1]
    if tail.last:
        embed_weight = None
        if tail.embed is None and not tail.cfg.tie_word_embeddings:
            embed_weight = _embedding(stages[0], tail, checkpoint)
        if path is not None and Path(path).is_dir():
            from specpipe.drafting.eagle3_drafter import Eagle3Drafter

            head = Eagle3Drafter.for_stage(tail, path, embed_weight, pack)
        else:
            head = TailHead.for_stage(tail, path, label, embed_weight)
    for stage in stages:
        if pack:
            stage.pack()
    return stages, head


def _embedding(first, tail, checkpoint) -> torch.Tensor | None:
    """The token embedding table for `tail`'s head: stage 0's, or read from `checkpoint` and
    kept in host memory. The head embeds a few tokens a round, so on a GPU the card keeps the
    table's memory for KV (gpt-oss-120b's: 1.08 GiB of a 24 GiB card)."""
    if first.embed is not None:
        return first.embed.weight
    if checkpoint is None:
        return None  # TargetParts.from_stage says what is missing
    from specpipe.transformer.layer_range import load_embedding

    return load_embedding(checkpoint, tail.dtype).to("cpu")


class TailHead:
    """A draft head at the tail: right after a verify it drafts the next round's tokens from
    the feature of the row that sampled the last committed token, so they travel back with the
    result and drafting costs no hop of its own. For a tree it remembers, per session, the
    candidates it ranked, to say at the next round which rank the target's tokens had; with an
    attention layer, the keys and values of the session's last committed pairs."""

    taps: tuple[int, ...] = ()  # it drafts from the tail's own features

    def __init__(self, head: DraftHead, parts: TargetParts) -> None:
        self.head, self.parts = head, parts
        if head.vocab is not None:
            head._head_rows(parts)  # taken now, while the stage's head is still plain
        self.ranked = RankedTrees(MAX_RANKED_SESSIONS)
        self._past: OrderedDict[str, SessionPast] = OrderedDict()

    @classmethod
    def for_stage(
        cls, stage, path: str | Path | None, label: str, embed_weight: torch.Tensor | None = None
    ) -> TailHead:
        """The head at `path` (or the model's shipped one) on `stage`, a tail whose weights are
        not packed yet (`embed_weight`: the embedding table, unless the head is tied to it);
        the stage keeps its features from now on."""
        head, _ = open_head(path, label, stage.cfg.dim, stage.cfg.vocab_size)
        tail = cls(head.to(stage.device), TargetParts.from_stage(stage, embed_weight))
        stage.keep_features = True
        return tail

    @torch.inference_mode()
    def remember(
        self, session: str, features: torch.Tensor, tokens: Sequence[int], first_pos: int
    ) -> None:
        """Tokens the session committed at first_pos …, each with the feature [m, D] of the
        row before it (the row that sampled it): their pairs join the session's past, which
        the head's attention sees. A head without attention keeps nothing."""
        attention = self.head.attention
        if attention is None or not len(tokens):
            return
        ids = torch.tensor([int(t) for t in tokens], device=features.device)
        x = self.head.pair(features.float(), self.parts.embed(ids).float())
        self._past[session] = attention.remember(self._past.get(session), x, first_pos)
        self._past.move_to_end(session)
        while len(self._past) > MAX_PAST_SESSIONS:
            self._past.popitem(last=False)

    def starts_round(self, session: str, token: int, token_pos: int) -> None:
        """Nothing: the head's past keeps its pairs as they came, so a prefill chunk's last
        row stays paired with the token its round sampled and the loop dropped, one of the
        head's last pairs until as many more came (its acceptance was measured so)."""

    def _past_before(self, session: str, token_pos: int) -> SessionPast | None:
        past = self._past.get(session)
        return None if past is None else past.before(token_pos)

    def drafts_after(
        self,
        session: str,
        feature: torch.Tensor,
        token: int,
        token_pos: int,
        k: int,
        params: SamplingParams,
    ) -> list[int]:
        """K drafts in a chain after the last committed `token`, at `token_pos`, drawn from the
        row whose `feature` [D] (before the final norm) sampled it."""
        if k <= 0:
            return []
        past = self._past_before(session, token_pos)
        return self.head.draft(self.parts, feature, int(token), token_pos, k, params, past)

    def draft_tree(
        self,
        session: str,
        feature: torch.Tensor,
        token: int,
        token_pos: int,
        shape: TreeShape,
        params: SamplingParams,
    ) -> DraftTree:
        """A tree of `shape` after the last committed `token` (see `DraftHead.draft_tree`); its
        candidates are remembered for `ranks_of` until the session's next tree."""
        past = self._past_before(session, token_pos)
        tree, candidates = self.head.draft_tree(
            self.parts, feature, int(token), token_pos, shape, params, past
        )
        self.ranked.keep(session, token_pos, token, candidates)
        return tree

    def ranks_of(
        self, session: str, root_pos: int, root: int, committed: Sequence[int]
    ) -> list[int]:
        """The ranks of the committed tokens in the session's last tree (`RankedTrees`)."""
        return self.ranked.ranks_of(session, root_pos, root, committed)

    def forget(self, session: str) -> None:
        """Let go of what the head remembers of a session."""
        self.ranked.forget(session)
        self._past.pop(session, None)


MAX_RANKED_SESSIONS = 4096  # sessions whose last tree's candidates a tail head remembers
# Sessions whose past pairs a head with attention keeps (the least recently used goes first,
# and drafts for it from nothing but the root until it has a past again): for the default
# model 2 x 128 pairs x 576 floats, 0.6 MB a session.
MAX_PAST_SESSIONS = 256
