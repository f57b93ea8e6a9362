"""The sampling math against brute-force enumeration, and its edge cases and bad inputs."""

import itertools
import math

import numpy as np
import pytest

from specpipe.core.sampling import (
    Sampler,
    committed_tokens,
    draw,
    philox4x64,
    residual_probs,
    target_probs,
    uniform,
    uniforms,
    verify_coupled,
    verify_residual,
)


def brute_force_target(logits, temp, top_p, top_k):
    """The target distribution written out token by token, with no vector tricks."""
    logits = [float(x) for x in logits]
    vocab = len(logits)
    if temp <= 0:
        best = max(range(vocab), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(vocab)]
    scaled = [x / temp for x in logits]
    allowed = set(range(vocab))
    if 0 < top_k < vocab:
        kth = sorted(scaled, reverse=True)[top_k - 1]
        allowed = {i for i in allowed if scaled[i] >= kth}
    peak = max(scaled[i] for i in allowed)
    weights = {i: math.exp(scaled[i] - peak) for i in allowed}
    total = sum(weights.values())
    probs = {i: w / total for i, w in weights.items()}
    if top_p < 1:
        ranked = sorted(probs, key=lambda i: (-probs[i], i))
        kept, mass = [], 0.0
        for i in ranked:
            if mass >= top_p:
                break
            kept.append(i)
            mass += probs[i]
        total = sum(probs[i] for i in kept)
        probs = {i: probs[i] / total for i in kept}
    return [probs.get(i, 0.0) for i in range(vocab)]


CONFIGS = list(
    itertools.product([0.0, -1.0, 0.5, 1.0, 1.7], [1.0, 0.9, 0.5, 1e-9], [0, 1, 3, 8, 50])
)


@pytest.mark.parametrize("temp,top_p,top_k", CONFIGS)
def test_target_probs_matches_brute_force(temp, top_p, top_k):
    rng = np.random.default_rng(hash((temp, top_p, top_k)) % 2**32)
    for _ in range(5):
        logits = rng.normal(scale=2.0, size=12)
        logits[rng.integers(0, 12, size=3)] = logits[0]  # exact ties
        expected = brute_force_target(logits, temp, top_p, top_k)
        got = target_probs(logits, temp, top_p, top_k)
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-15)


def test_target_probs_rows_do_not_depend_on_their_batch():
    rng = np.random.default_rng(0)
    batch = rng.normal(size=(64, 100))
    together = target_probs(batch, 0.8, 0.9, 20)
    alone = np.stack([target_probs(row, 0.8, 0.9, 20) for row in batch])
    assert np.array_equal(together, alone)


def test_top_k_keeps_ties_at_the_boundary():
    probs = target_probs([3.0, 2.0, 2.0, 2.0, 1.0], temp=1.0, top_k=2)
    assert (probs[:4] > 0).all() and probs[4] == 0


def test_top_k_larger_than_vocab_is_off():
    logits = [0.1, 0.5, -0.3]
    np.testing.assert_array_equal(target_probs(logits, 1.0, top_k=99), target_probs(logits, 1.0))


def test_tiny_top_p_keeps_exactly_the_most_likely_token():
    probs = target_probs([0.5, 2.0, 1.0, 2.0], temp=1.0, top_p=1e-12)
    np.testing.assert_array_equal(probs, [0, 1, 0, 0])  # the lowest id among the tied best


def test_top_p_keeps_the_boundary_token():
    # p = [0.5, 0.3, 0.2]; top_p 0.6 needs the second token to reach the mass
    logits = np.log([0.5, 0.3, 0.2])
    probs = target_probs(logits, 1.0, top_p=0.6)
    np.testing.assert_allclose(probs, [0.625, 0.375, 0.0])


def test_masked_tokens_get_no_mass():
    logits = np.array([1.0, -np.inf, 0.5, -np.inf])
    probs = target_probs(logits, 1.3)
    assert probs[1] == probs[3] == 0
    sampler = Sampler(seed=3, temp=1.3)
    assert {sampler.sample(logits, pos) for pos in range(500)} <= {0, 2}


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = np.array([0.0, 5.0, 1.0, 5.0])
    for temp in (0.0, -0.5):
        np.testing.assert_array_equal(target_probs(logits, temp), [0, 1, 0, 0])
        sampler = Sampler(seed=1, temp=temp)
        assert {sampler.sample(logits, pos) for pos in range(20)} == {1}
        assert sampler.accept(np.stack([logits] * 3), [1, 3], 0) == [1, 1, -1]


def test_philox_is_numpys_philox():
    for seed, pos in [(0, 1), (1, 2), (2**64 - 1, 77), (123456789, 10**15)]:
        reference = np.random.Philox(key=seed, counter=pos - 1).random_raw()  # advances first
        ours = philox4x64(([pos], [0], [0], [0]), ([seed], [0]))[0][0]
        assert int(ours) == int(reference)
        assert uniform(seed, pos) == uniforms(seed, pos) == (int(reference) >> 11) * 2.0**-53


def test_uniforms_are_uniform_and_distinct_by_seed_and_position():
    u = uniforms(np.arange(200)[:, None], np.arange(500)[None, :])
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.005
    assert len(np.unique(u)) == u.size


def test_draw_never_returns_a_zero_probability_token():
    probs = np.array([0.0, 0.25, 0.0, 0.75, 0.0])
    ids = draw(probs, np.linspace(0, 1 - 2**-53, 10001))
    assert set(ids.tolist()) == {1, 3}
    assert draw(probs, np.array(1 - 2**-53)) == 3


def full_sort_top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The top-p cut by sorting whole rows: the definition `_top_p_keep` shortcuts."""
    order = np.argsort(-probs, axis=1, kind="stable")
    sorted_p = np.take_along_axis(probs, order, axis=1)
    mass_before = np.cumsum(sorted_p, axis=1) - sorted_p
    mass_before[:, 0] = 0.0
    keep = np.empty_like(sorted_p, dtype=bool)
    np.put_along_axis(keep, order, mass_before < top_p, axis=1)
    kept = np.where(keep, probs, 0.0)
    return kept / kept.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("vocab", [7, 300, 49152])
def test_top_p_cut_is_bit_identical_to_sorting_whole_rows(vocab):
    """Peaked rows take the prefix shortcut, flat rows and mass ties the full sort: same bits."""
    rng = np.random.default_rng(vocab)
    for trial in range(60):
        scale = float(rng.choice([0.05, 1.0, 4.0, 12.0]))  # flat … peaked
        z = rng.normal(scale=scale, size=(3, vocab))
        if trial % 4 == 0:
            z = np.round(z, 1)  # ties everywhere
        if trial % 5 == 0:
            z[:, : vocab // 2] = z[0, 0]  # half the row at one value
        temp = float(rng.choice([0.3, 0.7, 1.0]))
        top_p = float(rng.choice([0.05, 0.5, 0.9, 0.95, 0.999999]))
        shifted = z / temp - (z / temp).max(axis=1, keepdims=True)
        probs = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
        want = full_sort_top_p(probs, top_p)
        assert np.array_equal(target_probs(z, temp, top_p), want), (trial, scale, top_p)


def test_sample_and_accept_agree_exactly():
    rng = np.random.default_rng(7)
    for trial in range(300):
        vocab, k = int(rng.integers(2, 40)), int(rng.integers(0, 6))
        logits = rng.normal(scale=3, size=(k + 1, vocab))
        sampler = Sampler(
            seed=int(rng.integers(0, 2**63)),
            temp=float(rng.choice([0, 0.7, 1.2])),
            top_p=float(rng.choice([1.0, 0.9])),
            top_k=int(rng.choice([0, 5])),
        )
        start = int(rng.integers(0, 10_000))
        plain = [sampler.sample(logits[j], start + j) for j in range(k + 1)]
        n_right = int(rng.integers(0, k + 1))
        drafts = plain[:n_right] + [(t + 1) % vocab for t in plain[n_right:k]]
        result = sampler.accept(logits, drafts, start)
        committed = committed_tokens(drafts, result)
        assert committed == plain[: len(committed)], trial
        assert len(committed) == n_right + 1
        assert result[len(committed) :] == [-1] * (k + 1 - len(committed))


def test_float32_logits_sample_as_their_float64_widening():
    """The tail hands float32 logits over as they are; the result must be what the same
    numbers widened to float64 give: the same distribution bits, the same draws."""
    import torch

    rng = np.random.default_rng(11)
    for trial in range(100):
        vocab, k = int(rng.integers(2, 300)), int(rng.integers(0, 5))
        z32 = torch.tensor(rng.normal(scale=4, size=(k + 1, vocab)), dtype=torch.float32)
        z32[0, int(rng.integers(0, vocab))] = float("-inf")  # a masked token
        z64 = z32.double()
        temp, top_p, top_k = float(rng.choice([0, 0.7])), float(rng.choice([1, 0.9])), 0
        assert np.array_equal(target_probs(z32, temp, top_p), target_probs(z64, temp, top_p))
        sampler = Sampler(temp=temp, top_p=top_p, top_k=top_k, seed=int(rng.integers(0, 2**63)))
        drafts = [int(t) for t in rng.integers(0, vocab, size=k)]
        assert sampler.accept(z32, drafts, 50) == sampler.accept(z64, drafts, 50), trial
    with pytest.raises(ValueError, match="NaN"):
        Sampler(temp=0.7).accept(torch.tensor([[0.0, float("nan")]]), [], 0)


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    logits = np.zeros(1000)
    a = [Sampler(seed=11, temp=1.0).sample(logits, p) for p in range(50)]
    b = [Sampler(seed=11, temp=1.0).sample(logits, p) for p in range(50)]
    c = [Sampler(seed=12, temp=1.0).sample(logits, p) for p in range(50)]
    assert a == b and a != c


def exact_law_of_verify_residual(probs, drafts):
    """The law of the committed sequence under the residual rule, enumerated outcome by outcome."""
    law, reach = {}, 1.0
    for j, d in enumerate(drafts):
        rest = residual_probs(probs[j], np.int64(d))
        for token in range(probs.shape[1]):
            if token != d and rest[token] > 0:
                law[tuple(drafts[:j]) + (token,)] = reach * (1 - probs[j, d]) * rest[token]
        reach *= probs[j, d]
    for token in range(probs.shape[1]):
        if probs[-1, token] > 0:
            law[tuple(drafts) + (token,)] = reach * probs[-1, token]
    return law


def plain_law(probs, drafts):
    """Sequential plain sampling, stopped at the first token that differs from the draft."""
    law = {}
    for seq in itertools.product(range(probs.shape[1]), repeat=len(drafts) + 1):
        stop = next((j for j, d in enumerate(drafts) if seq[j] != d), len(drafts))
        key = seq[: stop + 1]
        if key not in law:
            law[key] = math.prod(probs[j, seq[j]] for j in range(stop + 1))
    return {k: v for k, v in law.items() if v > 0}


def test_residual_rule_has_the_plain_law_by_enumeration():
    rng = np.random.default_rng(3)
    probs = target_probs(rng.normal(size=(3, 5)), 1.0)
    drafts = [int(np.argmax(probs[0])), 2, 4]
    expected, got = plain_law(probs, drafts[:2]), exact_law_of_verify_residual(probs, drafts[:2])
    assert expected.keys() == got.keys()
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=1e-12)


def test_residual_and_coupled_forms_match_the_plain_law_by_monte_carlo():
    rng = np.random.default_rng(5)
    probs = target_probs(rng.normal(size=(3, 4)), 0.9)
    drafts = np.array([int(np.argmax(probs[0])), int(np.argmax(probs[1]))])
    law = plain_law(probs, list(drafts))
    n = 200_000
    forms = {
        "residual": verify_residual(probs, drafts, rng.random((n, 2)), rng.random((n, 3))),
        "coupled": verify_coupled(draw(probs, rng.random((n, 3))), drafts),
    }
    for name, results in forms.items():
        seqs, counts = np.unique(results, axis=0, return_counts=True)
        observed = {
            tuple(int(t) for t in s if t >= 0): c / n for s, c in zip(seqs, counts, strict=True)
        }
        assert observed.keys() <= law.keys(), name
        tv = 0.5 * sum(abs(observed.get(k, 0) - p) for k, p in law.items())
        assert tv < 0.01, (name, tv)


def test_residual_never_accepts_an_impossible_draft():
    probs = np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    results = verify_residual(probs, np.array([2]), np.zeros((1000, 1)), np.random.rand(1000, 2))
    assert (results[:, 0] != 2).all() and (results[:, 1] == -1).all()


@pytest.mark.parametrize(
    "logits,kwargs,message",
    [
        ([1.0, float("nan")], {}, "NaN"),
        ([-np.inf, -np.inf], {}, "all -inf"),
        ([1.0, np.inf], {}, r"\+inf"),
        ([1.0, 2.0], {"temp": float("inf")}, "temp"),
        ([1.0, 2.0], {"temp": float("nan")}, "temp"),
        ([1.0, 2.0], {"top_p": 0.0}, "top_p"),
        ([1.0, 2.0], {"top_p": 1.5}, "top_p"),
        ([1.0, 2.0], {"top_k": -1}, "top_k"),
        ([1.0, 2.0], {"top_k": 2.5}, "top_k"),
        ([], {}, "shape"),
        (np.zeros((2, 2, 2)), {}, "shape"),
    ],
)
def test_target_probs_rejects_bad_input(logits, kwargs, message):
    params = {"temp": 1.0, "top_p": 1.0, "top_k": 0} | kwargs
    with pytest.raises(ValueError, match=message):
        target_probs(logits, **params)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, "7", True])
def test_sampler_rejects_bad_seeds(seed):
    with pytest.raises(ValueError, match="seed"):
        Sampler(seed=seed, temp=1.0)


def test_accept_rejects_bad_drafts_and_shapes():
    sampler = Sampler(seed=1, temp=1.0)
    logits = np.zeros((3, 4))
    with pytest.raises(ValueError, match="draft ids"):
        sampler.accept(logits, [0, 4], 0)
    with pytest.raises(ValueError, match="draft ids"):
        sampler.accept(logits, [-1, 0], 0)
    with pytest.raises(ValueError, match="rows of logits"):
        sampler.accept(logits, [0], 0)
    with pytest.raises(ValueError, match=r"\[K\+1, V\]"):
        sampler.accept(np.zeros(4), [], 0)
    with pytest.raises(ValueError, match="position"):
        sampler.sample(np.zeros(4), -3)
    with pytest.raises(ValueError, match="one row"):
        sampler.sample(logits, 0)


def test_committed_tokens_is_the_equality_loop():
    assert committed_tokens([5, 6, 7], [5, 6, 9, -1]) == [5, 6, 9]
    assert committed_tokens([5, 6], [5, 6, 1]) == [5, 6, 1]
    assert committed_tokens([], [4]) == [4]
    with pytest.raises(ValueError):
        committed_tokens([5], [5, -1])
    with pytest.raises(ValueError):
        committed_tokens([5], [5])


def test_sampling_params_round_trip_through_a_reset_message_and_a_sampler():
    from specpipe.core.coupling import sampler_for
    from specpipe.core.sampling import SamplingParams

    for params in (
        SamplingParams(temp=0.7, top_p=0.9, top_k=5, seed=3),
        SamplingParams(temp=1.2, seed=2**63, logprobs=2, sampler="gumbel"),
    ):
        fields = params.to_fields()
        assert all(isinstance(v, int | float) for v in fields.values())
        assert SamplingParams.from_fields(fields) == params
        assert sampler_for(params).params == params
    assert "sampler" not in SamplingParams().to_fields()  # icdf: as before it was sent
    with pytest.raises(IndexError):
        SamplingParams.from_fields({**SamplingParams().to_fields(), "sampler": 7})
