"""Goodness-of-fit statistics for the losslessness tests (numpy only).

Pearson's chi-square goodness of fit of observed counts against an exact
distribution (cells with expected count < 5 pooled; a count in a cell of
probability 0 fails outright), p-value from the exact chi-square survival
function (closed form for integer degrees of freedom; the one the GPU smoke
test's distribution check uses, tools/gpu_smoke.py), and the total
variation distance between an empirical and an exact distribution.
"""

from __future__ import annotations

import numpy as np

from tools.gpu_smoke import chi2_sf

__all__ = ["chi2_sf", "gof_pvalue", "total_variation"]


def gof_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness-of-fit p-value of ``counts`` against ``probs`` (same shape)."""
    counts = np.asarray(counts, dtype=np.float64).reshape(-1)
    probs = np.asarray(probs, dtype=np.float64).reshape(-1)
    assert abs(probs.sum() - 1.0) < 1e-9
    if counts[probs <= 0.0].sum() > 0:  # a token the target can never emit
        return 0.0
    n = counts.sum()
    observed, expected = counts[probs > 0.0], n * probs[probs > 0.0]
    order = np.argsort(expected)
    observed, expected = list(observed[order]), list(expected[order])
    # pool the smallest cells until every cell expects at least 5
    while len(expected) > 1 and expected[0] < 5.0:
        smallest_observed, smallest_expected = observed.pop(0), expected.pop(0)
        observed[0] += smallest_observed
        expected[0] += smallest_expected
        resort = np.argsort(expected)
        observed, expected = [observed[i] for i in resort], [expected[i] for i in resort]
    if len(expected) < 2:
        return 1.0  # one possible outcome, and every sample is it
    observed_a, expected_a = np.array(observed), np.array(expected)
    stat = float(((observed_a - expected_a) ** 2 / expected_a).sum())
    return chi2_sf(stat, len(expected) - 1)


def total_variation(counts: np.ndarray, probs: np.ndarray) -> float:
    """TV distance between the empirical distribution of ``counts`` and ``probs``."""
    counts = np.asarray(counts, dtype=np.float64).reshape(-1)
    return 0.5 * float(np.abs(counts / counts.sum() - np.asarray(probs, dtype=np.float64).reshape(-1)).sum())
