"""The statistics the result pages share: a mean with its 95% t interval over seeds, a comparison paired by seed (t
test and the exact sign-flip test beside it), and Holm's correction over every test a page makes, from which alone a
page draws its verdicts."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence


def interval(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t interval."""
    from scipy import stats

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def paired(first: Sequence[float], second: Sequence[float]) -> tuple[float, float, float]:
    """Mean paired difference, its 95% half-width and the paired t-test's two-sided p-value."""
    from scipy import stats

    differences = [a - b for a, b in zip(first, second)]
    mean, half = interval(differences)
    p = stats.ttest_rel(first, second).pvalue if len(differences) > 1 and len(set(differences)) > 1 else math.nan
    return mean, half, float(p)


def sign_flip_p(differences: Sequence[float]) -> float:
    """The exact two-sided sign-flip (permutation) test of a zero mean paired difference: the share of the 2^n sign
    assignments whose mean is at least as far from zero as the observed one. Its floor is 2 / 2^n: 0.0625 at 5 seeds,
    so 5 seeds never reach 0.05 with it however large the effect."""
    if not differences:
        return math.nan
    observed = abs(statistics.fmean(differences)) - 1e-12  # ties count as extreme
    flips = list(itertools.product((1, -1), repeat=len(differences)))
    extreme = sum(abs(statistics.fmean(s * d for s, d in zip(signs, differences))) >= observed for signs in flips)
    return extreme / len(flips)


def sign_flip_floor(seeds: int) -> float:
    return 2 / 2**seeds if seeds else math.nan


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (the family-wise error over all of them at the level compared), in the
    given order; a NaN (a test that could not run) stays NaN and does not count toward the family."""
    ranked = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    adjusted, running = [math.nan] * len(p_values), 0.0
    for rank, (p, index) in enumerate(ranked):
        running = max(running, min(1.0, (len(ranked) - rank) * p))
        adjusted[index] = running
    return adjusted
