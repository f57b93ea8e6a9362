"""StageModel: one layer range of the model, with a KV cache per session (the `Stage` protocol).

Stage 0 also holds the embeddings and takes token ids; the tail also holds the final norm and the
head and returns float32 logits; a single stage holding every layer is the whole model. The model
is built on the meta device and its parameters are assigned straight from the checkpoint, so no
weight is held twice and no layer outside the range is ever read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specpipe.core.ring import GapError, Request
from specpipe.core.tree import ancestor_paths, is_path
from specpipe.transformer.attention import Segment
from specpipe.transformer.config import ModelConfig
from specpipe.transformer.errors import ModelError
from specpipe.transformer.kvcache import LayerCache, SessionCache, bytes_per_token
from specpipe.transformer.layers import Block, RMSNorm
from specpipe.transformer.linear import MIN_ROWS, Linear
from specpipe.transformer.rope import Rotary

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# One session's rows in a forward of several: (P rows, T tokens of them, cos, sin, its start
# position, its draft tree's paths or None), what each layer's `Segment` is made of.
_SessionRows = tuple[int, int, torch.Tensor, torch.Tensor, int, tuple[tuple[int, ...], ...] | None]


class StageModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        start: int,
        end: int,
        packed_experts: bool = False,
        row_stable: bool = True,
    ) -> None:
        super().__init__()
        self.cfg, self.start, self.end = cfg, start, end
        self.first, self.last = start == 0, end == cfg.n_layers
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim) if self.first else None
        self.layers = nn.ModuleList(Block(cfg, i, packed_experts) for i in range(start, end))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps) if self.last else None
        self.head = Linear(cfg.dim, cfg.vocab_size, bias=False) if self.last else None
        self.rotary = Rotary(cfg)
        self.sessions: dict[str, SessionCache] = {}
        # Caches kept after their sessions ended, by name, for later sessions whose tokens
        # start with theirs (`keep_prefix`, `start_from_prefix`).
        self.kept: dict[str, SessionCache] = {}
        # A tail with a draft head keeps each session's last kept rows before the final norm
        # (the features the head drafts from), until its next round replaces them.
        self.keep_features = False
        self.features: dict[str, torch.Tensor] = {}
        # For each session whose last round asked for taps (`Request.taps`), the states
        # entering the asked layers in its range, every row's, side by side: [T, taps here x D]
        # (`carry_taps`).
        self.tapped: dict[str, torch.Tensor] = {}
        # A step of fewer rows than the products need runs padded from the first layer to the
        # last, rather than padding and slicing around each product (mixtures of experts route
        # every row, so they pad per product instead).
        self.pad_rows = MIN_ROWS if row_stable and not cfg.is_moe else 1
        # See linear.py: without row stability a verify row may differ from a plain step's.
        for module in self.modules():
            if hasattr(module, "row_stable"):
                module.row_stable = row_stable

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].attn_norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].attn_norm.weight.device

    def pack(self) -> int:
        """Pack the linear weights for oneDNN where that is row-stable (CPU); how many were."""
        return sum(m.pack() for m in self.modules() if isinstance(m, Linear))

    def _session(self, session: str) -> SessionCache:
        cache = self.sessions.get(session)
        if cache is None:
            cfg = self.cfg
            cache = SessionCache(
                [
                    LayerCache(cfg.n_kv_heads, cfg.head_dim, self.dtype, self.device, cfg.window(i))
                    for i in range(self.start, self.end)
                ]
            )
            self.sessions[session] = cache
        return cache

    @torch.inference_mode()
    def forward(
        self, session: str, inputs: torch.Tensor, start_pos: int, last_rows: int | None = None
    ) -> torch.Tensor:
        """ids [T] (first stage) or hidden [T, D] -> hidden [T, D], or logits [T, V] (tail).

        On the tail, `last_rows` keeps only the logits of the last rows (a verify needs K+1 of
        them; a long prompt's others would cost T x V floats)."""
        (out,) = self.forward_many([Request(session, inputs, start_pos, last_rows)])
        if isinstance(out, BaseException):
            raise out
        return out

    @torch.inference_mode()
    def forward_many(self, requests: Sequence[Request]) -> list[torch.Tensor | Exception]:
        """Several sessions' rounds as one forward: each output, or the error of a request that
        could not run (a gap, bad inputs), in order; the others run regardless.

        Every product runs on the rows of all of them at once and attention within each, so a
        session's numbers are the ones it gets alone (row stability)."""
        outs: list[torch.Tensor | Exception | None] = [None] * len(requests)
        rows, caches, xs = self._prepare_many(requests, outs)
        if not rows:
            return outs
        # Only the products need `pad_rows`, and they run on every session's rows at once: the
        # last session's rows are padded when all of them together are fewer.
        tokens = [x.shape[0] for x in xs]
        deficit = self.pad_rows - sum(tokens)
        if deficit > 0:
            xs[-1] = F.pad(xs[-1], (0, 0, 0, deficit))  # [P, D]: rows from T on are padding
        segments = [
            self._segment(requests[i], x.shape[0], T)
            for i, x, T in zip(rows, xs, tokens, strict=True)
        ]
        x = xs[0] if len(xs) == 1 else torch.cat(xs)  # [sum of P, D]
        # The hidden state entering each layer any of these rounds taps, every session's rows.
        wanted = sorted({k for i in rows for k in self.taps_here(requests[i].taps)})
        x, snaps = self._layers_many(x, segments, caches, wanted)
        kept = self._keep_rows(requests, rows, caches, segments, x, snaps)
        if not self.last:
            for i, h in zip(rows, kept, strict=True):
                outs[i] = h  # [T, D]
            return outs
        return self._head_many(requests, rows, kept, outs)

    def _prepare_many(
        self, requests: Sequence[Request], outs: list
    ) -> tuple[list[int], list[SessionCache], list[torch.Tensor]]:
        """The requests that can run (their indexes), their caches and their input rows [T, D];
        each of the others gets its error in `outs`."""
        rows, caches, xs = [], [], []
        for i, req in enumerate(requests):
            try:
                cache, x = self._prepare(req)
            except (GapError, ValueError) as exc:
                outs[i] = exc
                continue
            rows.append(i)
            caches.append(cache)
            xs.append(x)
        return rows, caches, xs

    def _segment(self, req: Request, P: int, T: int) -> _SessionRows:
        """A session's P rows, T of them its tokens, with their rotations and its tree's paths."""
        if req.parents is None:
            cos, sin = self.rotary(req.start_pos, P, self.dtype)
            paths = None
        else:  # a draft tree: row r turns as the token at start_pos + its depth
            paths = ancestor_paths(req.parents)
            depths = [len(path) - 1 for path in paths] + [0] * (P - T)  # padding: the root's
            cos, sin = self.rotary(req.start_pos, max(depths) + 1, self.dtype)
            cos, sin = cos[depths], sin[depths]
        return (P, T, cos, sin, req.start_pos, paths)

    def _layers_many(
        self,
        x: torch.Tensor,
        segments: list[_SessionRows],
        caches: list[SessionCache],
        wanted: list[int],
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Every session's rows [sum of P, D] through this stage's layers, each attending within
        its own; and the states entering each `wanted` layer (leaving the last: `end`)."""
        snaps: dict[int, torch.Tensor] = {}
        for layer_index, layer in enumerate(self.layers):
            if self.start + layer_index in wanted:
                snaps[self.start + layer_index] = x
            parts = [
                Segment(P, T, cos, sin, cache.layers[layer_index], pos, paths)
                for (P, T, cos, sin, pos, paths), cache in zip(segments, caches, strict=True)
            ]
            x = layer.forward_many(x, parts)
        if self.end in wanted:  # the last layer's output (the tail's only)
            snaps[self.end] = x
        return x, snaps

    def _keep_rows(
        self,
        requests: Sequence[Request],
        rows: list[int],
        caches: list[SessionCache],
        segments: list[_SessionRows],
        x: torch.Tensor,
        snaps: dict[int, torch.Tensor],
    ) -> list[torch.Tensor]:
        """Each session's rows of the output, without padding (on the tail, only the last rows
        it asks for), its taps kept and its cache's length set."""
        start, kept = 0, []
        for i, cache, (P, T, _, _, pos, paths) in zip(rows, caches, segments, strict=True):
            h = x[start : start + T]
            taps = self.taps_here(requests[i].taps)
            if taps:
                self.tapped[requests[i].session] = torch.cat(
                    [snaps[k][start : start + T] for k in taps], dim=-1
                )  # [T, taps here x D]
            start += P
            # A tree's rows wait for its accepted path (`keep_path`); the cache ends at its root.
            cache.length = pos + T if paths is None else pos
            cache.tree = paths
            last_rows = requests[i].last_rows if self.last else None
            kept.append(h if last_rows is None else h[-last_rows:])
        return kept

    def _head_many(
        self,
        requests: Sequence[Request],
        rows: list[int],
        kept: list[torch.Tensor],
        outs: list,
    ) -> list:
        """The tail's outputs: each session's logits [rows kept, V] in `outs` (and its features
        kept, for a draft head)."""
        if self.keep_features:
            for i, h in zip(rows, kept, strict=True):
                self.features[requests[i].session] = h  # [rows kept, D]
        # The head on every session's kept rows at once: the largest product of the tail.
        logits = self.head(self.norm(kept[0] if len(kept) == 1 else torch.cat(kept))).float()
        start = 0
        for i, h in zip(rows, kept, strict=True):
            outs[i] = logits[start : start + h.shape[0]]  # [rows kept, V]
            start += h.shape[0]
        return outs

    def taps_here(self, taps: Sequence[int]) -> list[int]:
        """Of the tapped layers `taps` (counted as transformers counts hidden states: k enters
        layer k, n_layers is the last layer's output before the final norm), those whose states
        this stage holds, in order."""
        last = self.cfg.n_layers if self.last else self.end - 1
        return sorted(k for k in set(taps) if self.start <= k <= last)

    def split_taps(
        self, inputs: torch.Tensor, taps: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A round's input rows [T, D] and the taps the stages before this one kept, [T, j x D]
        (None: none), from what the previous stage sent: its hidden states, then the states
        entering each tapped layer before this stage's first. ValueError when the width says
        otherwise."""
        carried = sum(1 for k in set(taps) if k < self.start)
        D = self.cfg.dim
        if inputs.dim() != 2 or inputs.shape[1] != D * (1 + carried):
            raise ValueError(
                f"a round tapping {carried} layer(s) before this stage needs {D * (1 + carried)}"
                f" columns, got {tuple(inputs.shape)}"
            )
        if not carried:
            return inputs, None
        return inputs[:, :D], inputs[:, D:]

    def carry_taps(self, session: str, before: torch.Tensor | None) -> torch.Tensor | None:
        """The taps of the session's last round so far: `before` (the earlier stages', [T, j x
        D]) with this stage's beside them, which it lets go of."""
        own = self.tapped.pop(session, None)
        if own is None or before is None:
            return before if own is None else own
        return torch.cat([before, own], dim=-1)

    @torch.inference_mode()
    def keep_path(self, session: str, rows: Sequence[int]) -> None:
        """After a draft tree's round: keep the rows of its accepted path (`rows`, the root
        first) in the session's cache, at the root's position on, as if they had run one after
        another; the tree's other rows are forgotten. GapError when no tree waits, ValueError
        when `rows` are not a branch of it."""
        cache = self.sessions.get(session)
        if cache is None or cache.tree is None:
            raise GapError(f"session {session!r} has no draft tree waiting for its path")
        rows = [int(r) for r in rows]
        if not is_path(cache.tree, rows):
            raise ValueError(f"rows {rows} are not a branch of the tree from its root")
        for layer in cache.layers:
            layer.keep(rows)
        cache.length += len(rows)
        cache.tree = None

    def _settle_tree(self, cache: SessionCache, req: Request) -> None:
        """Before a round of a session whose last round was a tree: keep its walked rows when
        the round names them and starts right after them (`Request.keep`); else forget the
        tree, so the round continues from its root (or gets a gap beyond it). A round sent
        again after its first try had run finds the tree it made itself and recomputes it."""
        if cache.tree is None:
            return
        keep = list(req.keep)
        if keep and cache.length + len(keep) == req.start_pos and is_path(cache.tree, keep):
            self.keep_path(req.session, keep)
            return
        cache.tree = None
        for layer in cache.layers:
            layer.pending = None

    def _prepare(self, req: Request) -> tuple[SessionCache, torch.Tensor]:
        """The session's cache, checked against the round's start, and its input rows [T, D]."""
        self._check_inputs(req.inputs)
        if req.parents is not None:
            if len(req.parents) != len(req.inputs) - 1:
                raise ValueError(
                    f"a tree of {len(req.inputs)} rows needs {len(req.inputs) - 1} parents"
                )
            ancestor_paths(req.parents)  # ValueError for a parent that is not an earlier row
        if req.session not in self.sessions and req.start_pos > 0:
            raise GapError(
                f"session {req.session!r} has no cache here; start_pos {req.start_pos} > 0"
            )
        cache = self._session(req.session)
        self._settle_tree(cache, req)
        cache.check(req.start_pos)  # GapError before anything changes; appending truncates
        if self.first:
            return cache, self.embed(req.inputs.to(self.device, torch.long))  # [T, D]
        return cache, req.inputs.to(self.device, self.dtype)

    def _check_inputs(self, inputs: torch.Tensor) -> None:
        if self.first:
            if inputs.dim() != 1 or inputs.is_floating_point() or inputs.numel() == 0:
                raise ValueError(
                    f"stage 0 takes token ids [T], got {inputs.dtype} {tuple(inputs.shape)}"
                )
            if int(inputs.min()) < 0 or int(inputs.max()) >= self.cfg.vocab_size:
                raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        elif inputs.dim() != 2 or inputs.shape[1] != self.cfg.dim or inputs.shape[0] == 0:
            raise ValueError(
                f"this stage takes hidden states [T, {self.cfg.dim}], got {tuple(inputs.shape)}"
            )

    def drop(self, session: str) -> None:
        """Forget a session's cache."""
        self.sessions.pop(session, None)
        self.features.pop(session, None)
        self.tapped.pop(session, None)

    def held_tokens(self) -> dict[str, int]:
        """The positions each session's cache holds now."""
        return {name: cache.length for name, cache in self.sessions.items()}

    def keep_prefix(self, session: str, name: str, length: int) -> int:
        """Keep a copy of a session's first `length` positions (at most what it holds) as the
        prefix `name`, the session going on or ending as it will; how many it kept (0: the
        session had no cache here)."""
        cache = self.sessions.get(session)
        if cache is None or min(length, cache.length) <= 0:
            return 0
        # A copy of just those positions: the session's buffers grew by doubling.
        self.kept[name] = cache.copy(length)
        return self.kept[name].length

    def start_from_prefix(self, session: str, name: str, length: int) -> bool:
        """Start `session` over from the first `length` positions of the kept prefix `name`, a
        copy of them; False, the session started empty, when no prefix of that name holds
        them. The copy is the cache a prefill of the same tokens builds, bit for bit (row
        stability), so a round from `length` on computes what it would after that prefill."""
        self.drop(session)
        kept = self.kept.get(name)
        if kept is None or kept.length < length:
            return False
        self.sessions[session] = kept.copy(length)
        return True

    def forget_prefix(self, name: str) -> None:
        """Let go of a kept prefix."""
        self.kept.pop(name, None)

    def kept_tokens(self) -> dict[str, int]:
        """The positions each kept prefix holds."""
        return {name: cache.length for name, cache in self.kept.items()}

    def kv_bytes_per_token(self) -> int:
        """What one position of one session's cache takes across this stage's layers."""
        element = torch.empty((), dtype=self.dtype).element_size()
        layers = self.end - self.start
        return bytes_per_token(layers, self.cfg.n_kv_heads, self.cfg.head_dim, element)


def load_embedding(source, dtype: torch.dtype | str = torch.float32) -> torch.Tensor:
    """The token embedding table [V, D] alone, for a stage that is not the first (a tail's draft
    head embeds the token it samples)."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    srcs, convert = source.name_map(0, 0, True, False, False)["embed.weight"]
    return convert(*(source.read(s) for s in srcs)).to(dtype)


def check_range(cfg: ModelConfig, start: int, end: int, source: str) -> None:
    """Raise ModelError unless 0 <= start < end <= n_layers."""
    if not 0 <= start < end <= cfg.n_layers:
        what = "empty" if start == end else "reversed" if start > end else "out of range"
        raise ModelError(
            f"{source}: layer range [{start}, {end}) is {what} (the model has {cfg.n_layers})"
        )


def load_stage(
    source,
    start: int,
    end: int,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    packed_experts: bool = True,
    row_stable: bool = True,
    pack: bool = True,
) -> StageModel:
    """Build the stage for layers [start, end) from a checkpoint, reading only its tensors.

    On the CPU the linear weights are then packed for oneDNN (`pack=False` keeps them plain)."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    cfg = source.config
    check_range(cfg, start, end, str(source.path))
    packed = packed_experts and cfg.mxfp4
    with torch.device("meta"):
        model = StageModel(cfg, start, end, packed, row_stable)
    expected = model.state_dict()
    names = source.name_map(start, end, model.first, model.last, packed)
    missing = set(expected) ^ set(names)
    assert not missing, f"name map and model disagree on {sorted(missing)}"
    done: dict[tuple[str, ...], torch.Tensor] = {}  # a tied head reuses the embedding
    state = {}
    for key, (srcs, convert) in names.items():
        what = " + ".join(srcs)  # a fused weight names every tensor it stacks
        if srcs not in done:
            try:
                t = convert(*(source.read(s) for s in srcs))
            except RuntimeError as exc:  # parts that do not stack
                raise ModelError(f"{source.path}: cannot combine {what}: {exc}") from None
            if t.is_floating_point():
                t = t.to(dtype)
            done[srcs] = t.to(device)
        t = done[srcs]
        if t.shape != expected[key].shape:
            raise ModelError(
                f"{source.path}: {what} has shape {tuple(t.shape)}, "
                f"expected {tuple(expected[key].shape)}"
            )
        state[key] = t
    model.load_state_dict(state, assign=True, strict=True)
    model.rotary = Rotary(cfg).to(device)
    if pack:
        model.pack()
    return model.eval()
