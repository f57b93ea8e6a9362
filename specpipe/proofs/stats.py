"""Statistics the proofs share: total variation, entropy and chi-square tests."""

from __future__ import annotations

import numpy as np
from scipy.special import chdtrc

MIN_EXPECTED = 5.0  # bins expecting fewer counts are pooled: the chi-square law needs it


def total_variation(counts: np.ndarray, probs: np.ndarray) -> float:
    """TV distance between an empirical histogram and a distribution (or another histogram)."""
    return 0.5 * float(np.abs(counts / counts.sum() - probs / probs.sum()).sum())


def entropy_bits(probs: np.ndarray) -> float:
    """Shannon entropy in bits of a distribution or a histogram."""
    p = probs[probs > 0] / probs.sum()
    return float(-(p * np.log2(p)).sum())


def _pool(observed: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge the columns (bins) whose smallest expected count is under MIN_EXPECTED."""
    small = expected.min(axis=0) < MIN_EXPECTED
    if not small.any():
        return observed, expected
    pooled = (
        observed[:, small].sum(axis=1, keepdims=True),
        expected[:, small].sum(axis=1, keepdims=True),
    )
    return (
        np.concatenate([observed[:, ~small], pooled[0]], axis=1),
        np.concatenate([expected[:, ~small], pooled[1]], axis=1),
    )


def _chi_square(observed: np.ndarray, expected: np.ndarray, dof: int) -> float:
    if dof < 1:
        return 1.0
    statistic = float(((observed - expected) ** 2 / expected).sum())
    return float(chdtrc(dof, statistic))


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness-of-fit p-value of a histogram against a distribution. Counts outside the
    support of `probs` are impossible under the null: p = 0."""
    if counts[probs == 0].sum() > 0:
        return 0.0
    support = probs > 0
    observed = counts[support][None, :].astype(np.float64)
    expected = (counts.sum() * probs[support] / probs.sum())[None, :]
    observed, expected = _pool(observed, expected)
    return _chi_square(observed, expected, observed.shape[1] - 1)


def two_sample_p_value(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square test of homogeneity: were two histograms over the same bins drawn from one
    distribution?"""
    table = np.stack([a, b]).astype(np.float64)
    table = table[:, table.sum(axis=0) > 0]
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0) / table.sum()
    observed, expected = _pool(table, expected)
    return _chi_square(observed, expected, observed.shape[1] - 1)
