"""The Gumbel-max coupling: the target's draw in a form any drafter can share.

The sampler today draws the token at absolute position t by the inverse CDF of p_t at one
uniform u_t keyed by (seed, t). A drafter with its own distribution q only agrees with that
draw when q's CDF happens to put u_t in the same token's interval, which depends on the id
order of everything before it. The Gumbel-max form gives each token its own noise:

    g_i = -log(-log(u_i)),   u_i from Philox keyed by (seed, t, token i)
    x_t = argmax_{i : p_i > 0} (log p_i + g_i)          the target's draw
    y_t = argmax_{i : q_i > 0} (log q_i + g_i)          a drafter's draw, same noise

For iid Gumbel noise P(x_t = i) = p_i exactly (the Gumbel-max trick), so committed tokens are
plain sampling's whatever the drafter proposed, and x_t and y_t agree with probability at least
(1 - TV(p, q)) / (1 + TV(p, q)) (Gumbel coupling; the ceiling of any coupling is
1 - TV = Σ min(p_i, q_i)). A token's noise depends only on (seed, t, i), never on which other
tokens the top-k / top-p cut left, so only the support needs noise.

Many keys at once (the proofs): `token_uniforms_batch` and `gumbel_noise_bank` give the same
values for N (seed, position) pairs in one Philox pass, and `gumbel_argmax` draws one
distribution under every pair's noise.

Noise stream: Philox-4x64-10 (the sampler's `philox4x64`) with key (seed, 0) and counter
(t, i // 4, GUMBEL_STREAM, 0); token i takes word i % 4 of its block. The third counter word
keeps these blocks apart from the inverse-CDF uniforms, whose counter is (t, 0, 0, 0).
"""

from __future__ import annotations

import numbers

import numpy as np

from specpipe.core.sampling import (
    MAX_SEED,
    Sampler,
    SamplingParams,
    _target_probs,
    check_sampler,
    check_seed,
    philox4x64,
)

GUMBEL_STREAM = 1  # counter word 2 of the Gumbel blocks; the inverse-CDF uniforms use 0


def _check_position(position: int) -> None:
    if isinstance(position, bool) or not isinstance(position, numbers.Integral) or position < 0:
        raise ValueError(f"position must be a non-negative integer, got {position!r}")


def _key_array(values, name: str) -> np.ndarray:
    """`values` (integers in 0 … 2^64-1) as a flat uint64 array, or ValueError."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        if values.dtype.kind == "i" and (values < 0).any():
            raise ValueError(f"{name} must be non-negative integers below 2^64")
        return values.astype(np.uint64).reshape(-1)
    flat = np.asarray(values, dtype=object).reshape(-1)
    for value in flat:
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Integral)
            or not 0 <= value <= MAX_SEED
        ):
            raise ValueError(f"{name} must be non-negative integers below 2^64, got {value!r}")
    return np.array([int(value) for value in flat], dtype=np.uint64)


def _noise_words(seeds, positions, blocks: np.ndarray) -> list[np.ndarray]:
    """The four Philox words of noise blocks `blocks` [B] at N (seed, position) pairs: [N, B]
    each."""
    seeds, positions = _key_array(seeds, "seeds"), _key_array(positions, "positions")
    if len(seeds) != len(positions):
        raise ValueError(f"{len(seeds)} seeds for {len(positions)} positions")
    # Broadcast [N, 1] against [1, B] (constants as scalars): Philox's first round then works
    # on the distinct words only.
    counter = (positions[:, None], blocks[None, :], np.uint64(GUMBEL_STREAM), np.uint64(0))
    words = philox4x64(counter, (seeds[:, None], np.uint64(0)))
    return [np.broadcast_to(word, (len(seeds), len(blocks))) for word in words]


def _as_uniform(word: np.ndarray) -> np.ndarray:
    # 53 bits, centred in their interval so that u is never 0 (log 0) nor 1.
    u = (word >> np.uint64(11)).astype(np.float64)
    u += 0.5
    u *= 2.0**-53
    return u


def _as_gumbel(u: np.ndarray) -> np.ndarray:
    """-log(-log u), in place."""
    np.log(u, out=u)
    np.negative(u, out=u)
    np.log(u, out=u)
    return np.negative(u, out=u)


def token_uniforms_batch(seeds, positions, ids) -> np.ndarray:
    """`token_uniforms` for many (seed, position) pairs at once: float64 [N, len(ids)].

    Row n holds the values `token_uniforms(seeds[n], positions[n], ids)` gives, for seeds and
    positions of N entries each.
    """
    ids = np.asarray(ids, dtype=np.uint64).reshape(-1)
    blocks, word_of = np.unique(ids >> np.uint64(2), return_inverse=True)
    words = np.stack(_noise_words(seeds, positions, blocks))  # [4, N, B]
    pairs = np.arange(words.shape[1])[:, None]
    return _as_uniform(words[(ids & np.uint64(3)).astype(np.intp)[None, :], pairs, word_of])


def token_uniforms(seed: int, position: int, ids) -> np.ndarray:
    """u_i in (0, 1) for each token id in `ids` at (seed, absolute position): float64 [len]."""
    check_seed(seed)
    _check_position(position)
    return token_uniforms_batch([seed], [position], ids)[0]


def gumbel_noise(seed: int, position: int, ids) -> np.ndarray:
    """g_i = -log(-log u_i) for each token id in `ids` at (seed, position): float64 [len]."""
    return _as_gumbel(token_uniforms(seed, position, ids))


def gumbel_noise_bank(seeds, positions, vocab: int) -> np.ndarray:
    """The noise of tokens 0 … vocab-1 at N (seed, position) pairs: float64 [vocab, N].

    Column n is `gumbel_noise(seeds[n], positions[n], range(vocab))`; token-major, the layout
    `gumbel_argmax` reads one token at a time.
    """
    if isinstance(vocab, bool) or not isinstance(vocab, numbers.Integral) or vocab < 1:
        raise ValueError(f"vocab must be a positive integer, got {vocab!r}")
    words = _noise_words(seeds, positions, np.arange((vocab + 3) // 4, dtype=np.uint64))
    # Token i is word i % 4 of block i // 4: blocks then words, flattened, is id order.
    by_block = np.empty((words[0].shape[1], 4, words[0].shape[0]), dtype=np.uint64)
    for w, word in enumerate(words):
        by_block[:, w, :] = word.T
    by_token = by_block.reshape(-1, by_block.shape[2])[:vocab]
    return _as_gumbel(_as_uniform(by_token))


def gumbel_argmax(probs: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """`gumbel_draw` of one distribution `probs` [V] under each column of `noise` [V, N]: the
    same scores log p_i + g_i, the same lowest-id winner on ties; int64 [N]."""
    probs = np.asarray(probs)
    if probs.ndim != 1 or noise.ndim != 2 or noise.shape[0] != len(probs):
        raise ValueError(f"probs [V] and noise [V, N] do not match: {probs.shape}, {noise.shape}")
    support = np.flatnonzero(probs > 0)
    if len(support) == 0:
        raise ValueError("probs has no token with positive mass")
    winner = np.full(noise.shape[1], support[0], dtype=np.int64)
    if len(support) == 1:
        return winner
    log_p = np.log(probs[support])
    best = log_p[0] + noise[support[0]]
    # One token at a time over contiguous rows: a strict > keeps the lowest id on ties.
    for token, log_p_token in zip(support[1:], log_p[1:], strict=True):
        score = log_p_token + noise[token]
        better = score > best
        winner[better] = token
        np.maximum(best, score, out=best)
    return winner


def gumbel_draw(probs: np.ndarray, seed: int, position: int, ids: np.ndarray | None = None) -> int:
    """argmax over the support of log p_i + g_i: one token of `probs` [V] at (seed, position).

    The target calls it with p, a drafter with its q; the same noise couples the two draws.
    `ids` [V] names the token of each entry when `probs` covers only some of the vocabulary
    (a drafter's); the noise and the result are those tokens'.
    """
    support = np.flatnonzero(probs > 0)
    if len(support) == 0:
        raise ValueError("probs has no token with positive mass")
    tokens = support if ids is None else np.asarray(ids)[support]
    if len(support) == 1:  # a point mass (greedy, or a sharp top-p cut) needs no noise
        return int(tokens[0])
    scores = np.log(probs[support]) + gumbel_noise(seed, position, tokens)
    return int(tokens[np.argmax(scores)])


def gumbel_draws(probs: np.ndarray, seed: int, start_pos: int) -> np.ndarray:
    """`gumbel_draw` for each row of `probs` [N, V] at positions start_pos, start_pos+1, …"""
    probs = np.asarray(probs).reshape(-1, np.shape(probs)[-1])
    return np.array(
        [gumbel_draw(row, seed, start_pos + j) for j, row in enumerate(probs)], dtype=np.int64
    )


class GumbelSampler(Sampler):
    """A `Sampler` whose draw at position t is the Gumbel-max draw keyed by (seed, t).

    `sample` and `accept` keep their meaning: the committed tokens follow the target exactly,
    and a plain run and a speculative run with the same seed commit the same tokens. Greedy
    (temp <= 0) is the argmax, as before. It draws different tokens than `Sampler` for the same
    seed, so a run must record which sampler produced it.
    """

    name = "gumbel"

    def _draws(self, z: np.ndarray, start_pos: int) -> np.ndarray:
        if self.greedy:
            return np.argmax(z, axis=1)
        _check_position(start_pos)
        return gumbel_draws(
            _target_probs(z, self.temp, self.top_p, self.top_k), self.seed, start_pos
        )


def sampler_for(params: SamplingParams) -> Sampler:
    """The sampler `params.sampler` names, for `params`; ValueError when any is out of range."""
    check_sampler(params.sampler)
    cls = GumbelSampler if params.sampler == "gumbel" else Sampler
    return cls.from_params(params)
