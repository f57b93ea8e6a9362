"""The sampling math: logits to the target distribution, plain sampling, and the lossless verify
rule in two forms.

- `target_probs` is the one function from logits to the distribution we promise to sample from
  (temperature, then top-k keeping boundary ties, then top-p keeping the boundary token). The
  plain path, the verify path and the proofs all use it.
- The *coupled* form (what the ring runs): one uniform per absolute position, keyed by
  (seed, position) through Philox; the target's own draw at each position is x_t = F_t^-1(u_t).
  The tail accepts draft d_t iff x_t == d_t, and commits x_t at the first mismatch. Committed
  tokens are therefore exactly what plain sampling with the same seed produces.
- The *residual* form (the textbook rule, used by the proofs as a second implementation):
  accept d with probability p(d); on rejection sample from p with d removed.
- `token_logprobs` reports, when a session asks for them, each committed token's
  log-probability under that same target distribution (after temperature, top-k and top-p) and
  the most likely alternatives. Greedy (temp <= 0) targets a point mass, whose log-probabilities
  say nothing; there it reports the model's own distribution, the log-softmax of the raw logits.

Probabilities are numpy float64, computed from logits widened to float64 (float32 logits are
checked and searched for their argmax as they are: widening is exact and keeps the order). Rows
are `[V]` or batches `[..., V]`; every function treats a row the same way whatever batch it sits
in, so a row's numbers do not depend on its neighbours.
"""

from __future__ import annotations

import numbers
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specpipe.core.tree import DraftTree, walk

# A seed keys the Philox stream, so any 64-bit unsigned integer will do: what every command, the
# web form, the APIs and the store accept.
MAX_SEED = 2**64 - 1
MAX_SEED_TEXT = "2^64-1"  # how messages and pages write MAX_SEED

# ---------------------------------------------------------------------------------------------
# Validation


def _as_logits(logits) -> np.ndarray:
    """Logits as float32 or float64 `[N, V]` (a view for `[V]` input), or ValueError."""
    if hasattr(logits, "detach"):  # a torch tensor, possibly bf16 or on a GPU
        logits = logits.detach()
        if str(logits.dtype) != "torch.float64":
            logits = logits.float()  # exact for bf16 and fp16; float32 is not copied
        logits = logits.cpu().numpy()
    z = np.asarray(logits)
    if z.dtype not in (np.float32, np.float64):
        z = z.astype(np.float64)
    if z.ndim not in (1, 2) or z.shape[-1] == 0:
        raise ValueError(f"logits must have shape [V] or [N, V] with V >= 1, got {z.shape}")
    z2 = z.reshape(-1, z.shape[-1])
    if np.isfinite(z2).all():  # the usual case, in one pass
        return z2
    if np.isnan(z2).any():
        raise ValueError("logits contain NaN")
    if np.isposinf(z2).any():
        raise ValueError("logits contain +inf")
    dead = np.isneginf(z2).all(axis=1)
    if dead.any():
        raise ValueError(f"logits row {int(np.argmax(dead))} is all -inf: no token can be sampled")
    return z2


def check_params(temp: float, top_p: float, top_k: int) -> None:
    """Raise ValueError unless (temp, top_p, top_k) describe a distribution."""
    if isinstance(temp, bool) or not isinstance(temp, numbers.Real) or not np.isfinite(temp):
        raise ValueError(f"temp must be a finite number, got {temp!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"top_k must be a non-negative integer, got {top_k!r}")


def check_seed(seed: int) -> None:
    """Raise ValueError unless seed is an integer in 0 … MAX_SEED."""
    if (
        isinstance(seed, bool)
        or not isinstance(seed, numbers.Integral)
        or not 0 <= seed <= MAX_SEED
    ):
        raise ValueError(f"seed must be an integer in 0 … {MAX_SEED_TEXT}, got {seed!r}")


def random_seed() -> int:
    """A seed drawn at random, for a request that gave none: any of 0 … MAX_SEED."""
    return secrets.randbits(64)


def offset_seed(seed: int, offset: int) -> int:
    """The seed `offset` steps after `seed`, wrapping past MAX_SEED to 0: the seeds a run
    derives from its own (one per draw, job or prompt) are valid whatever seed it was given,
    and are `seed + offset` wherever that is a seed."""
    return (seed + offset) & MAX_SEED


# ---------------------------------------------------------------------------------------------
# The target distribution


def target_probs(logits, temp: float, top_p: float = 1.0, top_k: int = 0) -> np.ndarray:
    """The distribution to sample from: float64, the shape of `logits` (`[V]` or `[N, V]`).

    temp <= 0 gives a one-hot on the argmax (lowest id on ties). Otherwise softmax(z / temp),
    then top-k (k largest, ties at the boundary kept; 0 = off), renormalised, then top-p (the
    smallest prefix in descending order whose mass reaches top_p, boundary token included;
    1 = off), renormalised.
    """
    z = _as_logits(logits)
    check_params(temp, top_p, top_k)
    probs = _target_probs(z, float(temp), float(top_p), int(top_k))
    return probs.reshape(-1) if np.ndim(logits) == 1 else probs


def _target_probs(z: np.ndarray, temp: float, top_p: float, top_k: int) -> np.ndarray:
    """target_probs on validated `[N, V]` logits (see `_as_logits`)."""
    z = z.astype(np.float64, copy=False)
    n, vocab = z.shape
    if temp <= 0:
        probs = np.zeros_like(z)
        probs[np.arange(n), np.argmax(z, axis=1)] = 1.0
        return probs
    z = z / temp
    if 0 < top_k < vocab:
        kth_largest = np.partition(z, vocab - top_k, axis=1)[:, vocab - top_k, None]
        z = np.where(z >= kth_largest, z, -np.inf)  # ties with the k-th largest stay
    z = z - z.max(axis=1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(axis=1, keepdims=True)
    if top_p < 1:
        keep = np.stack([_top_p_keep(row, top_p) for row in probs])
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=1, keepdims=True)
    return probs


# Thresholds tried, largest first, for the candidates of a top-p cut (see `_top_p_keep`).
TOP_P_THRESHOLDS = (1e-3, 1e-5)
TOP_P_MARGIN = 1e-9  # far above the rounding of a float64 sum of probabilities


def _top_p_keep(p: np.ndarray, top_p: float) -> np.ndarray:
    """Which ids of one row `p` [V] the top-p cut keeps: bool [V].

    In descending order (lowest id first on ties) a token is kept while the mass before it is
    below top_p. Sorting all V probabilities costs milliseconds; the tokens with p >= t for a
    threshold t are a prefix of that order, and their running sums are the same numbers as the
    full sort's, so when the prefix's mass passes top_p (with a margin for rounding) every token
    after it is cut and the prefix decides alone. Otherwise the whole row is sorted.
    """
    for threshold in (*TOP_P_THRESHOLDS, None):
        ids = np.arange(len(p)) if threshold is None else np.flatnonzero(p >= threshold)
        order = ids[np.argsort(-p[ids], kind="stable")]  # descending, lowest id first on ties
        sorted_p = p[order]
        running = np.cumsum(sorted_p)
        if threshold is not None and not (len(ids) and running[-1] >= top_p + TOP_P_MARGIN):
            continue  # the prefix might end before the cut: widen it
        mass_before = running - sorted_p
        mass_before[0] = 0.0
        keep = np.zeros(len(p), dtype=bool)
        keep[order] = mass_before < top_p
        return keep
    raise AssertionError("unreachable: the last pass sorts the whole row")


# ---------------------------------------------------------------------------------------------
# Log-probabilities of committed tokens

MAX_TOP_LOGPROBS = 5


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token's log-probability under the target, and the `top` most likely
    tokens there as (id, log-probability), most likely first (lowest id first on ties)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(
    logits, tokens: Sequence[int], temp: float, top_p: float = 1.0, top_k: int = 0, n_top: int = 0
) -> list[TokenLogprob]:
    """Each row's token's log-probability, with the `n_top` (0 … 5) most likely alternatives.

    Row j of `logits` `[N, V]` is the position where `tokens[j]` was committed. For temp > 0 the
    numbers are log `target_probs` (temperature, top-k, top-p), computed in the log domain: a
    kept token's log-probability is its scaled logit minus the log-sum-exp of the kept ones, so
    it stays finite however small its probability. Tokens the cut removed have no finite
    log-probability and are never listed as alternatives. For temp <= 0 (greedy, a point mass)
    they are the log-softmax of the raw logits.
    """
    z = _as_logits(logits).astype(np.float64, copy=False)
    check_params(temp, top_p, top_k)
    if isinstance(n_top, bool) or not 0 <= n_top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"n_top must be between 0 and {MAX_TOP_LOGPROBS}, got {n_top!r}")
    if len(tokens) != len(z):
        raise ValueError(f"{len(tokens)} tokens for {len(z)} rows of logits")
    if temp > 0:
        scaled = z / float(temp)
        kept = _target_probs(z, float(temp), float(top_p), int(top_k)) > 0
    else:
        scaled, kept = z, np.isfinite(z)
    masked = np.where(kept, scaled, -np.inf)
    peak = masked.max(axis=1, keepdims=True)
    log_norm = peak + np.log(np.exp(masked - peak).sum(axis=1, keepdims=True))
    logp = masked - log_norm
    out = []
    for j, token in enumerate(tokens):
        row = logp[j]
        top: tuple[tuple[int, float], ...] = ()
        if n_top:
            # The tokens with a log-probability (cut ones are never listed), narrowed to those at
            # or above the n_top-th largest (ties included), then in descending order, lowest
            # id first on ties: no sort of the whole row.
            ids = np.flatnonzero(row > -np.inf)
            if len(ids) > n_top:
                values = row[ids]
                floor = np.partition(values, len(values) - n_top)[len(values) - n_top]
                ids = ids[values >= floor]
            ids = ids[np.argsort(-row[ids], kind="stable")][:n_top]
            top = tuple((int(i), float(row[i])) for i in ids)
        out.append(TokenLogprob(int(token), float(row[int(token)]), top))
    return out


# ---------------------------------------------------------------------------------------------
# Uniforms keyed by (seed, absolute position): Philox-4x64-10, vectorised

_PHILOX_M0, _PHILOX_M1 = np.uint64(0xD2E7470EE14C6C93), np.uint64(0xCA5A826395121157)
_PHILOX_W0, _PHILOX_W1 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBB67AE8584CAA73B)
_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)


def _mulhilo(a: np.uint64, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The high and low 64-bit words of a * b (128-bit product), from 32-bit halves."""
    a_lo, a_hi = a & _LOW32, a >> _SHIFT32
    b_lo, b_hi = b & _LOW32, b >> _SHIFT32
    lo_lo, lo_hi, hi_lo, hi_hi = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi
    middle = (lo_lo >> _SHIFT32) + (lo_hi & _LOW32) + (hi_lo & _LOW32)
    high = hi_hi + (lo_hi >> _SHIFT32) + (hi_lo >> _SHIFT32) + (middle >> _SHIFT32)
    return high, a * b


def philox4x64(counter: Sequence[np.ndarray], key: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Philox-4x64 with 10 rounds on arrays of 64-bit words (the generator numpy's Philox runs)."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint64) for k in key)
    with np.errstate(over="ignore"):  # arithmetic modulo 2^64 is the point
        for round_ in range(10):
            if round_:
                k0, k1 = k0 + _PHILOX_W0, k1 + _PHILOX_W1
            hi0, lo0 = _mulhilo(_PHILOX_M0, c0)
            hi1, lo1 = _mulhilo(_PHILOX_M1, c2)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return [c0, c1, c2, c3]


def uniforms(seeds, positions) -> np.ndarray:
    """u in [0, 1) for each (seed, absolute position), broadcast together: 53 bits each.

    u = (first word of the Philox block at counter (position, 0, 0, 0), key (seed, 0)) / 2^64.
    """
    seeds, positions = np.broadcast_arrays(
        np.asarray(seeds, dtype=np.uint64), np.asarray(positions, dtype=np.uint64)
    )
    zero = np.zeros(positions.shape, dtype=np.uint64)
    word = philox4x64((positions, zero, zero, zero), (seeds, zero))[0]
    return (word >> np.uint64(11)).astype(np.float64) * 2.0**-53


_MASK64 = 2**64 - 1


def uniform(seed: int, position: int) -> float:
    """`uniforms` for one (seed, position), in plain integers: what a tail runs per token."""
    c0, c1, c2, c3, k0, k1 = position, 0, 0, 0, seed, 0
    for round_ in range(10):
        if round_:
            k0, k1 = (k0 + int(_PHILOX_W0)) & _MASK64, (k1 + int(_PHILOX_W1)) & _MASK64
        p0, p1 = int(_PHILOX_M0) * c0, int(_PHILOX_M1) * c2
        c0, c1, c2, c3 = (p1 >> 64) ^ c1 ^ k0, p1 & _MASK64, (p0 >> 64) ^ c3 ^ k1, p0 & _MASK64
    return (c0 >> 11) * 2.0**-53


# ---------------------------------------------------------------------------------------------
# Drawing and verifying


def draw(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse CDF in token-id order: the first id whose cumulative mass exceeds u.

    probs `[..., V]` and u `[...]` broadcast together; returns int64 ids of the batch shape. A
    zero-probability token is never returned.
    """
    cdf = np.cumsum(probs, axis=-1)  # non-decreasing: adding p >= 0 never rounds down
    u = np.asarray(u)
    batch = np.broadcast_shapes(cdf.shape[:-1], u.shape)
    rows = cdf.reshape(-1, cdf.shape[-1])
    extra = len(batch) - (cdf.ndim - 1)  # leading dims of u over which rows are shared
    if extra > 0 and batch[extra:] == cdf.shape[:-1]:
        # Few distinct rows under many uniforms (the proofs): a binary search per row.
        u_rows = np.broadcast_to(u, batch).reshape(-1, len(rows))
        ids = np.empty(u_rows.shape, dtype=np.int64)
        for j, row in enumerate(rows):
            ids[:, j] = np.searchsorted(row, u_rows[:, j], side="right")
        ids = ids.reshape(batch)
    else:
        ids = (cdf <= u[..., None]).sum(axis=-1)
    # Rounding can leave cdf[-1] a hair below 1; such u fall to the last token with mass.
    last_positive = probs.shape[-1] - 1 - np.argmax(probs[..., ::-1] > 0, axis=-1)
    return np.minimum(ids, last_positive, dtype=np.int64)


def _accepted_count(matches: np.ndarray) -> np.ndarray:
    """How many leading entries along the last axis are True."""
    return np.cumprod(matches, axis=-1).sum(axis=-1)


def _doctor(target_draws: np.ndarray, n_accepted: np.ndarray) -> np.ndarray:
    """Keep entries 0 … n_accepted of each result vector, set the rest to -1."""
    slots = np.arange(target_draws.shape[-1])
    return np.where(slots <= n_accepted[..., None], target_draws, -1)


def verify_coupled(target_draws: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """The doctored result vector from the target's own draws x `[..., K+1]` and drafts `[..., K]`.

    r_j = x_j up to and including the first j with x_j != d_j (or the bonus x_K); -1 after.
    Because x_j is what plain sampling would have drawn at that position, P(accept d) = p(d) and,
    given x != d, x follows p with d removed: the committed tokens follow the target exactly.
    """
    k = target_draws.shape[-1] - 1
    matches = target_draws[..., :k] == drafts
    return _doctor(target_draws, _accepted_count(matches))


def residual_probs(probs: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """p with the draft removed and renormalised: the law of the token after a rejection.

    probs `[..., V]`, drafts `[...]`. Where p(d) = 1 a rejection cannot happen; p is returned.
    """
    rest = probs.copy()
    np.put_along_axis(rest, drafts[..., None], 0.0, axis=-1)
    mass = rest.sum(axis=-1, keepdims=True)
    return np.where(mass > 0, rest / np.where(mass > 0, mass, 1.0), probs)


def verify_residual(
    probs: np.ndarray, drafts: np.ndarray, u_accept: np.ndarray, u_sample: np.ndarray
) -> np.ndarray:
    """The classic rule, vectorised over draws: the doctored result vector `[n, K+1]`.

    probs `[K+1, V]`, drafts `[K]`, u_accept `[n, K]`, u_sample `[n, K+1]`. Accept d_j iff
    u < p_j(d_j) (strict: p(d) = 0 is never accepted); at the first rejection draw from
    residual_probs(p_j, d_j); if all K are accepted, draw the bonus from p_K.
    Proof: P(commit x) = p(d)·[x=d] + (1-p(d))·p(x)/(1-p(d))·[x!=d] = p(x).
    """
    k = len(drafts)
    p_draft = probs[np.arange(k), drafts]
    n_accepted = _accepted_count(u_accept < p_draft)
    replacement_law = np.concatenate([residual_probs(probs[:k], drafts), probs[k:]])
    replacements = draw(replacement_law, u_sample)  # [n, K+1]: what to commit at each stop
    slots = np.arange(k + 1)
    padded_drafts = np.append(drafts, -1)
    results = np.where(slots < n_accepted[:, None], padded_drafts, replacements)
    return _doctor(results, n_accepted)


def committed_tokens(drafts: Sequence[int], result: Sequence[int]) -> list[int]:
    """The coordinator's accept loop: commit d_j while r_j == d_j, then commit r_j."""
    if len(result) != len(drafts) + 1:
        raise ValueError(f"result has {len(result)} ids for {len(drafts)} drafts")
    committed = []
    for draft, token in zip(list(drafts) + [None], result, strict=True):
        if token is None or token < 0:
            raise ValueError(f"result vector {list(result)} has no token at a committed slot")
        committed.append(int(token))
        if token != draft:
            break
    return committed


# ---------------------------------------------------------------------------------------------
# The sampler a tail (or a single process) runs


@dataclass(frozen=True)
class SamplingParams:
    """What the tail needs to sample: the target's parameters and the seed."""

    temp: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    # None: no log-probabilities (a round costs nothing more); 0 … 5: the committed tokens'
    # log-probabilities with that many alternatives each.
    logprobs: int | None = None
    # How a token is drawn from its distribution (`SAMPLERS`): both follow the target exactly,
    # but they draw different tokens for one seed, so a run records which one it used.
    sampler: str = "icdf"

    def to_fields(self) -> dict[str, float | int]:
        """The parameters as a reset or reseed message carries them (names to numbers; a
        sampler by its number in `SAMPLERS`, left out for icdf, as before it was sent)."""
        fields: dict[str, float | int] = {
            "temp": float(self.temp),
            "top_p": float(self.top_p),
            "top_k": int(self.top_k),
            "seed": int(self.seed),
        }
        if self.logprobs is not None:
            fields["logprobs"] = int(self.logprobs)
        if self.sampler != "icdf":
            fields["sampler"] = SAMPLERS.index(self.sampler)
        return fields

    @classmethod
    def from_fields(cls, fields: dict) -> SamplingParams:
        """The parameters `to_fields` wrote; KeyError, IndexError, ValueError or TypeError when
        a field is missing or malformed (the values are checked by the sampler made of them)."""
        logprobs = int(fields["logprobs"]) if "logprobs" in fields else None
        return cls(
            temp=float(fields["temp"]),
            top_p=float(fields["top_p"]),
            top_k=int(fields["top_k"]),
            seed=int(fields["seed"]),
            logprobs=logprobs,
            sampler=SAMPLERS[int(fields.get("sampler", 0))],
        )


# "icdf": the inverse CDF at one uniform per position (`Sampler`). "gumbel": the Gumbel-max
# draw with noise per token (`specpipe.core.coupling.GumbelSampler`), which a drafter can share.
# A sampler's number is how the wire names it.
SAMPLERS = ("icdf", "gumbel")


def check_sampler(name: str) -> None:
    """ValueError unless `name` is one of `SAMPLERS`."""
    if name not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {name!r}")


class Sampler:
    """Samples one session's tokens: plain (`sample`) or verifying drafts (`accept`).

    Both draw the token at absolute position t from the uniform keyed by (seed, t), so for the
    same logits they commit the same tokens. temp <= 0 is greedy and uses no randomness.
    """

    def __init__(
        self,
        *,
        temp: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        logprobs: int | None = None,
    ) -> None:
        check_params(temp, top_p, top_k)
        check_seed(seed)
        if logprobs is not None and (
            isinstance(logprobs, bool)
            or not isinstance(logprobs, numbers.Integral)
            or not 0 <= logprobs <= MAX_TOP_LOGPROBS
        ):
            raise ValueError(f"logprobs must be None or 0 … {MAX_TOP_LOGPROBS}, got {logprobs!r}")
        self.temp, self.top_p, self.top_k, self.seed = (
            float(temp),
            float(top_p),
            int(top_k),
            int(seed),
        )
        self.logprobs = None if logprobs is None else int(logprobs)

    name = "icdf"  # its name in `SAMPLERS`

    @property
    def params(self) -> SamplingParams:
        """The parameters this sampler draws with."""
        return SamplingParams(
            self.temp, self.top_p, self.top_k, self.seed, self.logprobs, self.name
        )

    @classmethod
    def from_params(cls, params: SamplingParams) -> Sampler:
        """A sampler for `params`; ValueError when they are out of range."""
        return cls(
            temp=params.temp,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            logprobs=params.logprobs,
        )

    def result_logprobs(self, logits, result: Sequence[int]) -> list[TokenLogprob]:
        """The log-probabilities of a result vector's committed tokens (its ids before the
        first -1), from the rows of `logits` `[K+1, V]` they were drawn at; none unless this
        session asked for them."""
        if self.logprobs is None:
            return []
        committed = [int(t) for t in result if t >= 0]
        rows = _as_logits(logits)[: len(committed)]
        return token_logprobs(rows, committed, self.temp, self.top_p, self.top_k, self.logprobs)

    @property
    def greedy(self) -> bool:
        return self.temp <= 0

    def probs(self, logits) -> np.ndarray:
        """The target distribution for these logits."""
        return target_probs(logits, self.temp, self.top_p, self.top_k)

    def _draws(self, z: np.ndarray, start_pos: int) -> np.ndarray:
        """The target's own token at each row of checked logits `[N, V]` (see `_as_logits`),
        at positions start_pos, start_pos+1, …"""
        if self.greedy:
            return np.argmax(z, axis=1)
        if (
            isinstance(start_pos, bool)
            or not isinstance(start_pos, numbers.Integral)
            or start_pos < 0
        ):
            raise ValueError(f"position must be a non-negative integer, got {start_pos!r}")
        probs = _target_probs(z, self.temp, self.top_p, self.top_k)
        u = np.array([uniform(self.seed, start_pos + j) for j in range(len(z))])
        return draw(probs, u)

    def sample(self, logits_row, pos: int) -> int:
        """Plain sampling of the token at absolute position `pos` from one row of logits."""
        if np.ndim(logits_row) != 1:
            raise ValueError(
                f"sample takes one row of logits [V], got shape {np.shape(logits_row)}"
            )
        return int(self._draws(_as_logits(logits_row), pos)[0])

    def accept_tree(self, logits, tree: DraftTree, start_pos: int) -> tuple[list[int], list[int]]:
        """Verify a draft tree (`core.tree`): logits `[tree.rows, V]`, row r's for position
        start_pos + depth(r). Returns the committed tokens and the rows walked; only the rows
        walked are sampled. A chain commits what `accept` does."""
        z = _as_logits(logits)
        if np.ndim(logits) != 2 or len(z) != tree.rows:
            raise ValueError(f"a tree of {tree.rows} rows needs logits [{tree.rows}, V]")
        if any(t >= z.shape[1] for t in tree.tokens):
            raise ValueError(f"draft ids must lie in [0, {z.shape[1]})")
        return walk(
            tree, lambda row, depth: int(self._draws(z[row : row + 1], start_pos + depth)[0])
        )

    def accept(self, logits, drafts: Sequence[int], start_pos: int) -> list[int]:
        """Verify K drafts: logits `[K+1, V]` for positions start_pos … start_pos+K.

        Returns the doctored result vector (K+1 ids, -1 after the first mismatch), the same as
        `verify_coupled` on the target's draws at every row; only the rows up to the first
        mismatch are sampled.
        """
        z = _as_logits(logits)
        if np.ndim(logits) != 2:
            raise ValueError(f"accept takes logits [K+1, V], got shape {np.shape(logits)}")
        drafts = np.asarray(drafts, dtype=np.int64).reshape(-1)
        if len(drafts) != len(z) - 1:
            raise ValueError(
                f"{len(drafts)} drafts need {len(drafts) + 1} rows of logits, got {len(z)}"
            )
        vocab = z.shape[1]
        if ((drafts < 0) | (drafts >= vocab)).any():
            raise ValueError(f"draft ids must lie in [0, {vocab}), got {drafts.tolist()}")
        # `verify_coupled` row by row: rows after the first mismatch are never looked at.
        result = [-1] * len(z)
        for j in range(len(z)):
            result[j] = int(self._draws(z[j : j + 1], start_pos + j)[0])
            if j == len(drafts) or result[j] != drafts[j]:
                break
        return result
