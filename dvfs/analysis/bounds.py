"""Confidence bounds over repeats: Student-t bounds, order-free means, pairing, threshold tests.

The statistics the headroom search and the speculation comparison apply, apart from the
searches themselves.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from dvfs.errors import AnalysisError

#: Bounds within this relative distance of the threshold are on it (floating-point rounding).
FEASIBLE_ROUNDING = 1e-9


def level_text(confidence: float) -> str:
    """A confidence level in percent with the digits it has (95%, 97.5%, 99.9%), never
    rounded up to a 100% that no finite bound has."""
    pct = confidence * 100
    digits = next(
        (
            d
            for d in range(16)
            # within rounding of the level, and below 100 where it is (0.999999999999 was
            # said "100%": rounded to 8 digits)
            if abs(round(pct, d) - pct) < 1e-9 and (round(pct, d) < 100 or pct >= 100)
        ),
        16,
    )
    return f"{pct:.{digits}f}%"


def t_quantile(confidence: float, dof: int) -> float:
    """One-sided Student-t quantile: P(T <= t) = confidence with `dof` degrees of freedom.

    scipy's own numbers: the usual levels (0.95, 0.975, 0.995: the one-sided sides of 0.9,
    0.95 and 0.99) come from `dvfs.measure.tquantiles`, which holds scipy's values to the last
    bit for the same argument, so an analysis need not import scipy.stats (a second of CPU);
    other levels from scipy, imported here, not at module level, so `dvfs --help` stays fast.
    There is no fallback: an expansion in 1/dof is far off at the few repeats a sweep has (4.6
    instead of 6.3 at one degree of freedom), and an interval that narrow would be a wrong
    answer.
    """
    if not (math.isfinite(confidence) and 0 < confidence < 1):
        raise AnalysisError(f"confidence must be strictly between 0 and 1, got {confidence}")
    if dof < 1:
        raise AnalysisError(f"a Student-t bound needs at least 1 degree of freedom, got {dof}")
    known = _tabulated(float(confidence), int(dof))
    if known is not None:
        return known
    try:
        from scipy import stats  # noqa: F401  (checked on every call; the value is remembered)
    except ImportError as exc:
        raise AnalysisError(
            "scipy is missing, and the confidence bounds need its Student-t quantiles: "
            "reinstall dvfs (pip install -e .) or pip install scipy"
        ) from exc
    return _t_ppf(float(confidence), int(dof))


@functools.lru_cache(maxsize=1)
def _one_sided_levels() -> dict[float, float]:
    """One-sided level -> the two-sided confidence `dvfs.measure.tquantiles` tabulates it
    under: its table holds stats.t.ppf((1 + c) / 2, dof), that very float argument."""
    from dvfs.measure.tquantiles import CONFIDENCES

    return {(1 + c) / 2: c for c in CONFIDENCES}


def _tabulated(confidence: float, dof: int) -> float | None:
    """scipy's quantile from the table, where it holds this exact level and dof."""
    from dvfs.measure.tquantiles import T_TWO_SIDED

    two_sided = _one_sided_levels().get(confidence)
    return None if two_sided is None else T_TWO_SIDED.get((two_sided, dof))


@functools.lru_cache(maxsize=256)
def _t_ppf(confidence: float, dof: int) -> float:
    """scipy's quantile, remembered: a headroom search asks for the same few many times over,
    and each costs scipy about 0.1 ms."""
    from scipy import stats

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


def _first_two(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per leading index: how many values are present (non-NaN) along the last axis, and the
    first and second of them (meaningless where fewer are present)."""
    present = ~np.isnan(values)
    count = present.sum(axis=-1)
    if values.shape[-1] == 0:  # no values at all
        nothing = np.full(count.shape, np.nan)
        return count, nothing, nothing
    first = present.argmax(axis=-1)[..., None]
    rest = present.copy()
    np.put_along_axis(rest, first, False, axis=-1)
    second = rest.argmax(axis=-1)[..., None]
    return (
        count,
        np.take_along_axis(values, first, axis=-1)[..., 0],
        np.take_along_axis(values, second, axis=-1)[..., 0],
    )


def _exact_sum(a: np.ndarray, b: np.ndarray, count: np.ndarray) -> np.ndarray:
    """What math.fsum gives for one value (`a`) or two (`a`, `b`), by `count`: one IEEE
    addition is already exactly rounded, and adding 0.0 turns -0.0 into 0.0 as fsum does."""
    return np.where(count == 1, a, a + b) + 0.0


def finite_means(values: np.ndarray, need: np.ndarray | None = None) -> np.ndarray:
    """`finite_mean` over the last axis for every leading index at once, bit for bit the
    same: one or two finite values are summed here (see `_exact_sum`), any other row by
    `finite_mean` itself. `need` (per leading index) limits the work to those rows; the
    others are NaN."""
    values = np.asarray(values, dtype=float)
    count, a, b = _first_two(values)
    with np.errstate(over="ignore", invalid="ignore"):
        total = _exact_sum(a, b, count)
        means = np.asarray(total / np.maximum(count, 1), dtype=float)  # 0-d stays an array
    fast = (count <= 2) & ((count == 0) | np.isfinite(total))
    means[count == 0] = math.nan
    todo = ~fast if need is None else ~fast & need
    for idx in map(tuple, np.argwhere(todo)):
        means[idx] = finite_mean(values[idx])
    if need is not None:
        means[~need] = math.nan
    return means


def upper_bounds(
    values: np.ndarray, confidence: float, need: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """`upper_bound` over the last axis (NaN: absent) for every leading index at once, bit for
    bit the same, and the number of values behind each: rows of one or two finite values are
    computed here with the same operations in the same order, any other row by
    `upper_bound` itself. `need` limits the work to those rows; the others are NaN."""
    values = np.asarray(values, dtype=float)
    count, a, b = _first_two(values)
    with np.errstate(over="ignore", invalid="ignore"):
        total = _exact_sum(a, b, count)
        mean = total / np.maximum(count, 1)
        squares = _exact_sum((a - mean) ** 2, (b - mean) ** 2, count)
        sd = np.sqrt(squares)  # / (n - 1) == 1
        pairs = count == 2 if need is None else (count == 2) & need
        two = mean + t_quantile(confidence, 1) * sd / math.sqrt(2) if pairs.any() else mean
    bounds = np.where(count == 2, two, mean)
    fast = (count <= 2) & ((count == 0) | (np.isfinite(total) & np.isfinite(squares)))
    bounds[count == 0] = math.nan
    todo = ~fast if need is None else ~fast & need
    for idx in map(tuple, np.argwhere(todo)):
        bounds[idx] = upper_bound(values[idx], confidence)
    if need is not None:
        bounds[~need] = math.nan
    return bounds, count


def meets_all(bounds: np.ndarray, threshold: float, *, strict: bool = False) -> np.ndarray:
    """`meets` for every bound at once (the same comparisons; NaN never meets)."""
    if math.isnan(threshold):
        return np.zeros(np.shape(bounds), dtype=bool)
    margin = FEASIBLE_ROUNDING * abs(threshold)
    with np.errstate(invalid="ignore"):
        return np.asarray(bounds < threshold - margin if strict else bounds <= threshold + margin)


def ratio_interval(
    values: np.ndarray,
    reference: np.ndarray,
    values_ci: np.ndarray,
    reference_ci: np.ndarray,
    confidence: float,
) -> tuple[float, float, int]:
    """The interval (low, high) of the ratio of `values` (a setting's energy per token, per
    repeat; NaN: not usable) to `reference`'s, and the repeats paired in it: a ratio whose
    interval lies below 1 is a saving beyond the noise.

    With two or more repeats usable in both (paired: the same prompts), the two-sided
    Student-t interval at `confidence` of the mean per-repeat log ratio, taken back to a
    ratio: the repeats' own spread, which holds each cell's noise, as `dvfs compare` judges
    its arms. With fewer no such interval exists, and the cells' own stated uncertainty is
    used: `*_ci` is each repeat's relative half-width of its Student-t interval over its
    rounds (`energy_per_token_rel_ci`, at the campaign's confidence; NaN, a cell of one round,
    states none and adds none), so each side's mean over its usable repeats is known to
    sqrt(sum ci^2) / n; the two combine in quadrature around the ratio of the means.
    (NaN, NaN) where either side has no usable value. Sums are exactly rounded, so the order
    of the repeats never matters.

    A zero energy (a cube holds any non-negative one) is a value, as `dvfs compare` takes it:
    a ratio of 0 (or infinity, at a zero reference), 0 / 0 none. Paired, it has no spread to
    take a t interval of: where every paired repeat's ratio is 0 (infinity) the interval is
    that point, beside other ratios it is unbounded, (0, infinity).
    """
    v = np.asarray(values, dtype=float).ravel()
    r = np.asarray(reference, dtype=float).ravel()
    usable_v = np.isfinite(v) & (v >= 0)
    usable_r = np.isfinite(r) & (r >= 0)
    both = usable_v & usable_r & ((v > 0) | (r > 0))
    n = int(np.count_nonzero(both))
    if n >= 2:
        with np.errstate(divide="ignore"):
            logs = np.log(v[both]) - np.log(r[both])
        if (logs == -math.inf).all():
            return 0.0, 0.0, n
        if (logs == math.inf).all():
            return math.inf, math.inf, n
        if np.isinf(logs).any():
            return 0.0, math.inf, n
        log_low, log_high = interval(logs, confidence)
        return math.exp(log_low), math.exp(log_high), n
    if not usable_v.any() or not usable_r.any():
        return math.nan, math.nan, n

    def mean_and_width(x: np.ndarray, ci: np.ndarray, keep: np.ndarray) -> tuple[float, float]:
        widths = np.asarray(ci, dtype=float).ravel()[keep]
        widths = np.where(np.isfinite(widths), np.abs(widths), 0.0)
        count = int(np.count_nonzero(keep))
        mean = math.fsum(x[keep].tolist()) / count
        return mean, math.sqrt(math.fsum((widths * widths).tolist())) / count

    mean_v, width_v = mean_and_width(v, values_ci, usable_v)
    mean_r, width_r = mean_and_width(r, reference_ci, usable_r)
    if mean_r == 0:  # infinite, or 0 / 0: no ratio
        return (math.inf, math.inf, n) if mean_v > 0 else (math.nan, math.nan, n)
    ratio, width = mean_v / mean_r, math.hypot(width_v, width_r)
    return ratio * math.exp(-width), ratio * math.exp(width), n
