"""The Gumbel-max coupling: the target's draw follows p exactly, a drafter sharing the noise agrees
as often as Gumbel coupling promises, and mis-keyed noise is caught."""

import numpy as np
import pytest

from specpipe.core import coupling
from specpipe.core.coupling import GumbelSampler, gumbel_draw, gumbel_noise, token_uniforms
from specpipe.core.sampling import Sampler, draw, target_probs, uniform
from specpipe.proofs.stats import chi_square_p_value, total_variation

DRAWS = 4000
ALPHA = 1e-4  # per chi-square test: a correct draw fails one in ten thousand runs
LOGITS = np.array([1.2, -0.3, 2.0, 0.4, 1.9, -1.5])
CONFIGS = [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 3)]  # (temp, top_p, top_k)


def target_histogram(probs: np.ndarray, position: int = 17) -> np.ndarray:
    """The Gumbel draw's counts over DRAWS seeds at one position."""
    counts = np.zeros(len(probs))
    for seed in range(DRAWS):
        counts[gumbel_draw(probs, seed, position)] += 1
    return counts


def agreement(p: np.ndarray, q: np.ndarray, draft_offset: int = 0) -> float:
    """How often the drafter's draw from q equals the target's from p (same seed, position)."""
    same = sum(
        gumbel_draw(p, seed, 40 + seed % 7) == gumbel_draw(q, seed, 40 + seed % 7 + draft_offset)
        for seed in range(DRAWS)
    )
    return same / DRAWS


def inverse_cdf_agreement(p: np.ndarray, q: np.ndarray) -> float:
    """The same for today's coupling: both inverse CDFs at the sampler's shared u_t."""
    u = np.array([uniform(seed, 40 + seed % 7) for seed in range(DRAWS)])
    return float(np.mean(draw(p, u) == draw(q, u)))


def exact_gumbel_agreement(p: np.ndarray, q: np.ndarray) -> float:
    """P(x = y = i) = 1 / Σ_j max(p_j / p_i, q_j / q_i): both draws pick i when every other
    token's noise stays below g_i + min(log p_i/p_j, log q_i/q_j), an exponential race."""
    both = np.flatnonzero((p > 0) & (q > 0))
    return float(sum(1.0 / np.maximum(p / p[i], q / q[i]).sum() for i in both))


def tolerance(rate: float) -> float:
    return 4.5 * np.sqrt(rate * (1 - rate) / DRAWS) + 1e-9


def test_a_tokens_noise_does_not_depend_on_the_other_tokens():
    everything = token_uniforms(5, 123, np.arange(49152))
    ids = np.array([49151, 7, 3, 4, 1000, 2, 6])
    assert np.array_equal(token_uniforms(5, 123, ids), everything[ids])
    assert ((everything > 0) & (everything < 1)).all()
    assert not np.array_equal(token_uniforms(6, 123, ids), everything[ids])  # keyed by seed
    assert not np.array_equal(token_uniforms(5, 124, ids), everything[ids])  # and by position
    # The noise stream is not the inverse-CDF sampler's uniform.
    assert token_uniforms(5, 123, [0])[0] != uniform(5, 123)


def test_the_noise_is_uniform_and_independent_across_tokens():
    u = token_uniforms(9, 0, np.arange(40000))
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    assert chi_square_p_value(counts, np.full(20, 1 / 20)) > ALPHA
    pairs = np.histogram2d(u[:-1], u[1:], bins=5, range=[[0, 1], [0, 1]])[0].ravel()
    assert chi_square_p_value(pairs, np.full(25, 1 / 25)) > ALPHA
    assert abs(np.mean(gumbel_noise(9, 0, np.arange(40000))) - np.euler_gamma) < 0.03


@pytest.mark.parametrize("temp, top_p, top_k", CONFIGS)
def test_the_draw_follows_the_target(temp, top_p, top_k):
    probs = target_probs(LOGITS, temp, top_p, top_k)
    counts = target_histogram(probs)
    assert counts[probs == 0].sum() == 0
    assert chi_square_p_value(counts, probs) > ALPHA
    assert total_variation(counts, probs) < 0.03


def test_noise_keyed_by_position_alone_is_caught(monkeypatch):
    # One noise value for every token: the draw becomes the argmax.
    monkeypatch.setattr(
        coupling,
        "gumbel_noise",
        lambda seed, pos, ids: np.full(len(ids), gumbel_noise(seed, pos, [0])[0]),
    )
    probs = target_probs(LOGITS, 1.0)
    assert chi_square_p_value(target_histogram(probs), probs) < ALPHA


def test_greedy_is_the_argmax():
    rng = np.random.default_rng(1)
    sampler = GumbelSampler(temp=0.0, seed=3)
    for pos in range(50):
        z = rng.normal(size=30).astype(np.float32)
        assert sampler.sample(z, pos) == int(np.argmax(z))
        assert gumbel_draw(target_probs(z, 0.0), 3, pos) == int(np.argmax(z))


def test_a_drafter_with_the_targets_distribution_always_agrees():
    p = target_probs(LOGITS, 0.8, 0.95)
    assert agreement(p, p.copy()) == 1.0


# q moves mass between the first two tokens: Gumbel agreement is 0.585, above
# (1-TV)/(1+TV) = 0.538 (the inverse CDF reaches the ceiling 0.7 on this one).
P_SHIFT = np.array([0.1, 0.4, 0.5])
Q_SHIFT = np.array([0.4, 0.1, 0.5])
# The drafter's own top-p cut leaves it a smaller support than the target's.
P_WIDE = target_probs(LOGITS, 1.0)
Q_NARROW = target_probs(LOGITS + np.array([0, 0, -0.5, 0, 0.3, 0]), 1.0, 0.8)
PAIRS = [(P_SHIFT, Q_SHIFT), (P_WIDE, Q_NARROW)]


@pytest.mark.parametrize("p, q", PAIRS)
def test_agreement_is_gumbels_and_above_the_bound(p, q):
    tv = 0.5 * np.abs(p - q).sum()
    bound = (1 - tv) / (1 + tv)
    exact = exact_gumbel_agreement(p, q)
    assert bound <= exact <= 1 - tv + 1e-12
    measured = agreement(p, q)
    assert abs(measured - exact) < tolerance(exact)
    assert measured > bound


def test_gumbel_beats_the_inverse_cdf_where_id_order_hurts():
    # q is p moved up one id: every CDF interval of q sits one token over from p's, so the
    # inverse CDF never agrees; Gumbel agrees on the shared tokens 1 and 2 (0.468 > 0.429).
    p, q = np.array([0.2, 0.4, 0.4, 0.0]), np.array([0.0, 0.2, 0.4, 0.4])
    assert inverse_cdf_agreement(p, q) == 0.0
    exact = exact_gumbel_agreement(p, q)
    assert abs(exact - (1 / 5.5 + 1 / 3.5)) < 1e-12
    assert abs(agreement(p, q) - exact) < tolerance(exact)
    assert exact > (1 - 0.4) / (1 + 0.4)


@pytest.mark.parametrize("p, q", PAIRS)
def test_a_draft_at_the_wrong_position_is_caught(p, q):
    tv = 0.5 * np.abs(p - q).sum()
    assert agreement(p, q, draft_offset=1) < (1 - tv) / (1 + tv) - tolerance(0.5)


def test_noise_keyed_by_rank_in_the_support_is_caught(monkeypatch):
    # Each token takes the noise of its rank among the support, not of its id: the target alone
    # is still exact, but a drafter with another support no longer shares its noise.
    monkeypatch.setattr(
        coupling,
        "gumbel_noise",
        lambda seed, pos, ids: gumbel_noise(seed, pos, np.arange(len(ids))),
    )
    tv = 0.5 * np.abs(P_WIDE - Q_NARROW).sum()
    assert agreement(P_WIDE, Q_NARROW) < (1 - tv) / (1 + tv) - tolerance(0.5)


def test_speculative_equals_plain_with_any_drafts():
    rng = np.random.default_rng(4)
    sampler = GumbelSampler(temp=0.9, top_p=0.95, seed=77)
    for trial in range(40):
        z = rng.normal(size=(5, 12)) * 2
        plain = [sampler.sample(z[j], 100 + j) for j in range(5)]
        # Drafts that are the plain draws up to a point, then something else.
        cut = trial % 5
        drafts = plain[:cut] + [int(x) for x in rng.integers(0, 12, size=4 - cut)]
        result = sampler.accept(z, drafts, 100)
        n = next((j for j in range(4) if result[j] != drafts[j]), 4)
        assert result[: n + 1] == plain[: n + 1]
        assert all(r == -1 for r in result[n + 1 :])


def test_it_draws_other_tokens_than_the_inverse_cdf_sampler():
    z = np.linspace(0, 1, 50)
    gumbel = [GumbelSampler(seed=s).sample(z, 9) for s in range(200)]
    inverse = [Sampler(seed=s).sample(z, 9) for s in range(200)]
    assert gumbel != inverse


@pytest.mark.parametrize("seed, position", [(-1, 0), (0, -1), (2**64, 0), (0, 1.5)])
def test_bad_keys_are_refused(seed, position):
    with pytest.raises(ValueError):
        token_uniforms(seed, position, [0, 1])
    with pytest.raises(ValueError):
        gumbel_draw(np.array([0.5, 0.5]), seed, position)


def test_a_distribution_without_mass_is_refused():
    with pytest.raises(ValueError, match="no token"):
        gumbel_draw(np.zeros(4), 0, 0)


# token_uniforms' values before the batched form existed: the batched one must not move them.
GOLDEN = [
    (0, 0, [0, 1, 2], ["0x1.9bf6be67257dcp-4", "0x1.d9c6cb520c982p-1", "0x1.1b78c283cf152p-3"]),
    (2**64 - 1, 2**40 + 3, [49151, 3], ["0x1.7516a3eeb27c8p-1", "0x1.e9d8fb4378a20p-7"]),
    (12345, 99, [31, 8], ["0x1.11c8557248eb0p-1", "0x1.b5c9336274a2ep-3"]),
]


@pytest.mark.parametrize("seed, position, ids, values", GOLDEN)
def test_the_noise_of_a_key_is_what_it_was(seed, position, ids, values):
    assert [float(u).hex() for u in token_uniforms(seed, position, ids)] == values


def random_keys(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    return rng.integers(0, 2**64, n, dtype=np.uint64), rng.integers(0, 2**40, n)


def test_batched_noise_is_the_one_by_one_noise():
    seeds, positions = random_keys(60)
    ids = np.array([49151, 7, 3, 4, 1000, 2, 6, 7])
    batch = coupling.token_uniforms_batch(seeds, positions, ids)
    one_by_one = [
        token_uniforms(int(s), int(p), ids) for s, p in zip(seeds, positions, strict=True)
    ]
    assert np.array_equal(batch, np.stack(one_by_one))
    assert np.array_equal(
        coupling.token_uniforms_batch([2**64 - 1], [5], ids)[0], token_uniforms(2**64 - 1, 5, ids)
    )


@pytest.mark.parametrize("vocab", [1, 12, 13, 31])
def test_the_noise_bank_is_each_keys_noise_token_by_token(vocab):
    seeds, positions = random_keys(40)
    bank = coupling.gumbel_noise_bank(seeds, positions, vocab)
    assert bank.shape == (vocab, 40) and bank.flags.c_contiguous  # token-major
    for n, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
        assert np.array_equal(bank[:, n], gumbel_noise(int(seed), int(position), np.arange(vocab)))


@pytest.mark.parametrize("temp, top_p, top_k", [*CONFIGS, (0.0, 1.0, 0)])
def test_gumbel_argmax_is_gumbel_draw_under_each_key(temp, top_p, top_k):
    seeds, positions = random_keys(300)
    probs = target_probs(LOGITS, temp, top_p, top_k)
    bank = coupling.gumbel_noise_bank(seeds, positions, len(LOGITS))
    expected = [gumbel_draw(probs, int(s), int(p)) for s, p in zip(seeds, positions, strict=True)]
    assert coupling.gumbel_argmax(probs, bank).tolist() == expected


def test_gumbel_argmax_keeps_the_lowest_id_on_ties():
    noise = np.zeros((4, 3))
    assert coupling.gumbel_argmax(np.array([0.0, 0.5, 0.5, 0.0]), noise).tolist() == [1, 1, 1]


@pytest.mark.parametrize(
    "seeds, positions", [([-1], [0]), ([0], [-1]), ([2**64], [0]), ([0], [1.5]), ([0, 1], [0])]
)
def test_bad_batched_keys_are_refused(seeds, positions):
    with pytest.raises(ValueError):
        coupling.token_uniforms_batch(seeds, positions, [0, 1])


def test_mismatched_bank_and_probs_are_refused():
    with pytest.raises(ValueError, match="do not match"):
        coupling.gumbel_argmax(np.array([0.5, 0.5]), np.zeros((3, 4)))
    with pytest.raises(ValueError, match="vocab"):
        coupling.gumbel_noise_bank([0], [0], 0)
