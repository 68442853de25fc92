"""Confidence bounds over repeats: Student-t bounds, order-free means, pairing, threshold tests.

The statistics the headroom search and the speculation comparison apply, apart from the
searches themselves.
"""

from __future__ import annotations

import math

import numpy as np

from dvfs.errors import AnalysisError

#: Bounds within this relative distance of the threshold are on it (floating-point rounding).
FEASIBLE_ROUNDING = 1e-9


def t_quantile(confidence: float, dof: int) -> float:
    """One-sided Student-t quantile: P(T <= t) = confidence with `dof` degrees of freedom.

    scipy is imported here, not at module level, so `dvfs --help` stays fast. There is no
    fallback: an expansion in 1/dof is far off at the few repeats a sweep has (4.6 instead of
    6.3 at one degree of freedom), and an interval that narrow would be a wrong answer.
    """
    if not (math.isfinite(confidence) and 0 < confidence < 1):
        raise AnalysisError(f"confidence must be strictly between 0 and 1, got {confidence}")
    if dof < 1:
        raise AnalysisError(f"a Student-t bound needs at least 1 degree of freedom, got {dof}")
    try:
        from scipy import stats
    except ImportError as exc:
        raise AnalysisError(
            "scipy is missing, and the confidence bounds need its Student-t quantiles: "
            "reinstall dvfs (pip install -e .) or pip install scipy"
        ) from exc
    return float(stats.t.ppf(confidence, dof))


def finite_mean(values: np.ndarray) -> float:
    """Mean of the non-NaN values (NaN if none), exactly rounded (math.fsum): the same for
    any order of the values, so permuting repeats can never change an answer."""
    kept = [float(v) for v in np.ravel(values) if not math.isnan(v)]
    return math.fsum(kept) / len(kept) if kept else math.nan


def upper_bound(values: np.ndarray, confidence: float) -> float:
    """Mean plus the one-sided t margin; the point value when only one is given.

    Sums are exactly rounded, so the bound does not depend on the order of the values.
    """
    values = np.asarray(values, dtype=float)
    values = values[~np.isnan(values)]
    n = len(values)
    if n == 0:
        return math.nan
    mean = math.fsum(values.tolist()) / n
    if n == 1:
        return mean
    sd = math.sqrt(math.fsum(((values - mean) ** 2).tolist()) / (n - 1))
    return mean + t_quantile(confidence, n - 1) * sd / math.sqrt(n)


def lower_bound(values: np.ndarray, confidence: float) -> float:
    """Mean minus the one-sided t margin (the mirror of `upper_bound`); the point value when
    only one is given."""
    return 2 * finite_mean(np.asarray(values, dtype=float)) - upper_bound(values, confidence)


def paired_ratios(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """Per-repeat ratios over the repeats present (non-NaN) in both arrays, in repeat order.

    Repeat r of every arm sends the same prompts, so a ratio within a repeat compares like
    with like; a repeat missing or invalid in either arm drops out of both, never just one
    (0 / 0 has no ratio and drops out too).
    """
    num = np.asarray(numerator, dtype=float)
    den = np.asarray(denominator, dtype=float)
    both = ~(np.isnan(num) | np.isnan(den))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = num[both] / den[both]
    return ratios[~np.isnan(ratios)]  # 0 / 0: no ratio


def interval(values: np.ndarray, confidence: float) -> tuple[float, float]:
    """Two-sided Student-t interval of the mean at `confidence` (each side at (1 + c) / 2);
    (NaN, NaN) with fewer than two values, where no interval exists."""
    values = np.asarray(values, dtype=float)
    if np.count_nonzero(~np.isnan(values)) < 2:
        return math.nan, math.nan
    side = (1 + confidence) / 2
    return lower_bound(values, side), upper_bound(values, side)


def meets(bound: float, threshold: float, *, strict: bool = False) -> bool:
    """Whether a bound meets the threshold (NaN never does).

    Values within FEASIBLE_ROUNDING (relative) of the threshold count as on it, so a ratio
    that is exactly the target in real numbers is not lost to floating-point rounding (for
    instance when every latency is scaled by the same constant); a strict target excludes it.
    """
    if math.isnan(bound) or math.isnan(threshold):
        return False
    margin = FEASIBLE_ROUNDING * abs(threshold)
    return bound < threshold - margin if strict else bound <= threshold + margin
