"""The energy counter's steps, and windows that begin and end on them.

NVML's total-energy counter does not move continuously: it advances in steps, about every
100 ms on recent data-centre GPUs (20-100 ms, NVML-CONTRACT.md). A value read between two
steps is the energy up to the last step, so interpolating readings at a window's edges is off
by up to one step's energy at each edge. Here a window's energy is taken between two counter
UPDATES instead: each update's value is the exact energy at its instant, so the difference of
two updates has no step error, and the tokens are counted over the same interval.

A sampler sees an update as a change of value between two readings: the instant lies in that
bracket. When the updates are regular (they are, to within a bracket, on the GPUs measured),
a least-squares grid through the brackets' middles pins each instant well inside its bracket;
otherwise the middle is used. Pure arithmetic: no GPU, no clock.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Fewest distinct updates a detection needs to call a period.
MIN_UPDATES_FOR_PERIOD = 4
#: Fewest readings per counter update a round's sampler takes (`sampling_period_s`).
MIN_SAMPLES_PER_UPDATE = 4


@dataclass(frozen=True)
class Updates:
    """A counter's distinct updates seen by a sampler: each one's estimated instant (ns), the
    bracket it lies in (the readings before and at the change) and the value it took (mJ)."""

    t_ns: np.ndarray
    lo_ns: np.ndarray
    hi_ns: np.ndarray
    value_mj: np.ndarray
    #: Whether the instants lie on a fitted regular grid (else the brackets' middles).
    regular: bool = False
    #: A counter that moves at every reading: each value is the energy at its reading.
    continuous: bool = False

    def __len__(self) -> int:
        return len(self.t_ns)

    @property
    def uncertainty_ns(self) -> float:
        """The largest half-bracket: how far an estimated instant can be from the true one."""
        return float(np.max(self.hi_ns - self.lo_ns) / 2) if len(self) else math.nan


def updates(t_ns: np.ndarray, value_mj: np.ndarray, period_s: float | None = None) -> Updates:
    """The distinct updates in one counter's readings (`t_ns` ascending). The first reading
    starts the record: a change before it is not seen. With `period_s` (the detected update
    period) the instants are fitted to a regular grid when the brackets allow one; a period of
    0 means a continuous counter (it changed at every reading of the fast probe at session
    start), whose value at a reading is the energy at that instant."""
    t = np.asarray(t_ns, dtype=np.int64)
    v = np.asarray(value_mj, dtype=np.float64)
    if len(t) < 2:
        empty = np.array([], dtype=np.int64)
        return Updates(empty.astype(float), empty, empty, empty.astype(float))
    changed = (v[1:] != v[:-1]).nonzero()[0] + 1  # np.flatnonzero's own step
    lo, hi = t[changed - 1], t[changed]
    if period_s == 0:
        return Updates(hi.astype(np.float64), lo, hi, v[changed], True, True)
    instants, regular = _instants(lo, hi, period_s)
    return Updates(instants, lo, hi, v[changed], regular)


def _instants(lo: np.ndarray, hi: np.ndarray, period_s: float | None) -> tuple[np.ndarray, bool]:
    """Each update's instant: on a least-squares grid through the brackets' middles when that
    grid passes through every bracket (a regular counter: True), else the middles."""
    mid = (lo + hi) / 2.0
    if period_s is None or not period_s > 0 or len(mid) < 3:
        return mid, False
    period_ns = period_s * 1e9
    grid = _grid(mid - mid[0], period_ns)
    if grid is None:
        return mid, False  # two updates in one period: not the regular counter assumed
    steps, slope, intercept = grid
    fitted = mid[0] + intercept + slope * steps
    half = (hi - lo) / 2.0
    # a line fitted through tens of brackets can miss one by microseconds: 1% of a period
    if (np.abs(fitted - mid) <= half + 0.01 * period_ns).all():
        # np.clip(fitted, lo, hi) by its own definition, min(max(x, lo), hi)
        return np.minimum(np.maximum(fitted, lo), hi), True
    return mid, False


#: Grids already fitted, by the update middles' offsets from the first (their bytes) and the
#: period: a sweep's rounds repeat the same offsets most of the time (five in six on the demo
#: sweep), and a grid is a function of those bits. The oldest is dropped past the size.
_GRIDS: dict[tuple[str, bytes, float], tuple[np.ndarray, float, float] | None] = {}
_GRIDS_SIZE = 4096
#: Held while `_grid` drops the oldest grid and keeps a new one: a local fleet's workers
#: measure in threads of one process and share `_GRIDS` (two dropping the same oldest grid at
#: once raised KeyError in one, its worker lost), as the meter's memos of recent rounds.
_GRIDS_LOCK = threading.Lock()


def _grid(since: np.ndarray, period_ns: float) -> tuple[np.ndarray, float, float] | None:
    """`_fit_grid`, remembered for the last `_GRIDS_SIZE` distinct inputs (float64 offsets)."""
    key = (since.dtype.str, since.tobytes(), period_ns)
    try:
        return _GRIDS[key]
    except KeyError:
        pass
    grid = _fit_grid(since, period_ns)
    with _GRIDS_LOCK:
        if len(_GRIDS) >= _GRIDS_SIZE:
            del _GRIDS[next(iter(_GRIDS))]  # the oldest (dicts keep insertion order)
        _GRIDS[key] = grid
    return grid


def _fit_grid(since: np.ndarray, period_ns: float) -> tuple[np.ndarray, float, float] | None:
    """Each update's step on the period's grid (its offset from the first over the period,
    rounded) and the least-squares line through (step, offset): None when two updates share
    a step (not the regular counter assumed). The steps are read-only (shared)."""
    # np.round with no decimals is rint (half to even); np.diff is the shifted difference
    steps = np.rint(since / period_ns)
    rise = steps[1:] - steps[:-1]
    # as np.unique would tell, without its sort when the steps ascend (they do)
    repeated = not (rise > 0).all() and ((rise >= 0).all() or len(np.unique(steps)) != len(steps))
    if repeated:
        return None
    slope, intercept = _line_fit(steps, since)
    steps.flags.writeable = False
    return steps, slope, intercept


def _line_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """`np.polyfit(x, y, 1)`'s slope and intercept by polyfit's own steps (its Vandermonde
    matrix, column scaling and `lstsq`), without its argument handling: the same numbers,
    called once a round. x and y are float64 of one length, at least 2 distinct x."""
    lhs = np.empty((len(x), 2))
    lhs[:, 0] = x
    lhs[:, 1] = 1.0
    scale = np.sqrt((lhs * lhs).sum(axis=0))
    lhs /= scale
    rcond = len(x) * _EPS
    if _LSTSQ is not None:  # lstsq's own LAPACK call, without its wrapper's checks
        solved = _LSTSQ(lhs, y[:, None], rcond, signature="ddd->ddid")[0][:, 0]
        if np.isfinite(solved).all():
            coef = solved / scale
            return float(coef[0]), float(coef[1])
    coef = np.linalg.lstsq(lhs, y, rcond)[0] / scale  # raises what LAPACK could not solve
    return float(coef[0]), float(coef[1])


_EPS = float(np.finfo(np.float64).eps)
try:  # the gufunc `np.linalg.lstsq` calls (numpy 2); its public wrapper is the fallback
    from numpy.linalg import _umath_linalg

    _LSTSQ: Any = _umath_linalg.lstsq
except (ImportError, AttributeError):  # pragma: no cover - another numpy's layout
    _LSTSQ = None


def update_period_s(t_ns: np.ndarray, value_mj: np.ndarray) -> float | None:
    """A counter's update period: the median gap between its distinct updates (estimated from
    the brackets' middles). None with fewer than MIN_UPDATES_FOR_PERIOD updates. A counter that
    changes at every reading gives about the reading period: it updates at least that often."""
    seen = updates(t_ns, value_mj)
    if len(seen) < MIN_UPDATES_FOR_PERIOD:
        return None
    gaps = np.diff(seen.t_ns)
    return float(np.median(gaps)) * 1e-9


def counter_update_period(samples: dict[str, np.ndarray]) -> list[float | None]:
    """Each GPU's counter update period (s) from a sampler's readings (`Samples.arrays()`),
    None for a GPU whose counter moved too rarely to tell."""
    times, values = gpu_counters(samples)
    return [update_period_s(times[:, g], values[:, g]) for g in range(times.shape[1])]


def sampling_period_s(sample_period_s: float, counter_period_s: float | None) -> float:
    """The sampler's period during a round: at most `sample_period_s`, at least
    MIN_SAMPLES_PER_UPDATE readings per counter update (the brackets bound the window's
    length), and off any whole fraction of the counter's update period, so successive updates
    fall at different phases of the sampling (a period that divides the counter's sees every
    update at the same place in its bracket, and the grid fit learns nothing; virtual time has
    no jitter to break that)."""
    if not counter_period_s or counter_period_s < sample_period_s:
        return sample_period_s
    ratio = counter_period_s / sample_period_s
    if ratio >= MIN_SAMPLES_PER_UPDATE and abs(ratio - round(ratio)) >= 0.2:
        return sample_period_s
    return counter_period_s / (max(round(ratio), MIN_SAMPLES_PER_UPDATE) + 0.382)


def gpu_counters(samples: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-GPU counter readings and their instants, (readings, GPUs) each; the summed counter
    as one GPU when the per-GPU columns are absent."""
    times = samples.get("gpu_energy_t_ns")
    if times is not None and times.ndim == 2 and times.size:
        # no copies where the sampler's arrays have the types already (nothing writes to them)
        return times.astype(np.int64, copy=False), samples["gpu_energy_mj"].astype(
            np.float64, copy=False
        )
    t = np.asarray(samples["t_ns"], dtype=np.int64).reshape(-1, 1)
    return t, np.asarray(samples["energy_mj"], dtype=np.float64).reshape(-1, 1)


# -- tokens on the same interval --------------------------------------------------------------


_INT64_MIN, _INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)
_MAX, _MIN, _SUM = np.maximum.reduce, np.minimum.reduce, np.add.reduce
_ALL = np.logical_and.reduce
try:  # what `np.interp` calls for real values, without its argument handling (numpy 2)
    from numpy._core.multiarray import interp as _compiled_interp

    _INTERP: Any = _compiled_interp
except ImportError:  # pragma: no cover - another numpy's layout

    def _INTERP(x: float, xp: np.ndarray, fp: np.ndarray, left: None, right: None) -> Any:  # noqa: N802
        return np.interp(x, xp, fp, left, right)


class TokenCurve:
    """Cumulative output tokens against time, rising linearly through each decode step (a
    chunk's tokens are produced over the step that ends with its arrival, as the step's energy
    is spent over it), so tokens and energy are counted over exactly the same interval.

    The curve runs through its distinct chunk instants (`t_ns`, `cumulative`: the tokens up to
    and at each), flat before the first and after the last. A window reads it at a handful of
    instants, so `at` finds each one's two neighbouring instants from the chunks themselves
    (no sort of a round's thousands of chunks); the numbers are `np.interp`'s on the whole
    curve, to the last bit (token counts are whole numbers, summed exactly in any order)."""

    def __init__(self, ns: np.ndarray, tokens: np.ndarray) -> None:
        self._ns = np.asarray(ns, dtype=np.int64)
        self._tokens = np.asarray(tokens, dtype=np.float64)
        self._seen: dict[float, float] = {}
        #: With distinct ascending instants (`steps`): the instants as float64 and the tokens
        #: up to and at each, which `_at` reads by bisection.
        self._steps: tuple[np.ndarray, np.ndarray] | None = None

    @classmethod
    def steps(cls, instants: np.ndarray, tokens: np.ndarray) -> TokenCurve:
        """The curve through chunk instants that are distinct and ascending (`instants`,
        int64 ns) with the whole tokens that arrived at each (`tokens`: a lockstep batch's
        chunks summed over its requests). It is the curve of every request's chunks, and
        `_at` reads it by bisection instead of masked passes over the chunks: float64 is
        how `ns <= x` compares them (NEP 50), the tokens up to and at each instant are exact
        whole numbers however they are summed, and the two neighbours and their tokens are
        the masked passes' very numbers. Falls back to the passes where the instants, as
        float64, do not ascend strictly (beyond 2**53 ns) or the tokens are not integers."""
        curve = cls(instants, tokens)
        t = curve._ns.astype(np.float64)
        whole = np.asarray(tokens).dtype.kind in "iu"
        if whole and len(t) and bool(_ALL(t[1:] > t[:-1])):
            # (np.add.accumulate is what ndarray.cumsum calls on a 1-d float64 array)
            curve._steps = (t, np.add.accumulate(curve._tokens))
        return curve

    @classmethod
    def of(cls, chunk_ns: Sequence[np.ndarray], chunk_tokens: Sequence[np.ndarray]) -> TokenCurve:
        if not chunk_ns:
            return cls(np.array([], dtype=np.int64), np.array([]))
        ns = np.concatenate(chunk_ns, dtype=np.int64, casting="unsafe")
        tokens = np.concatenate(chunk_tokens, dtype=np.float64, casting="unsafe")
        return cls(ns, tokens)

    @functools.cached_property
    def _whole(self) -> tuple[np.ndarray, np.ndarray]:
        if not len(self._ns):
            return np.array([0.0]), np.array([0.0])
        instants, inverse = np.unique(self._ns, return_inverse=True)
        per_instant = np.bincount(inverse, weights=self._tokens)
        return instants.astype(np.float64), np.cumsum(per_instant)

    @property
    def t_ns(self) -> np.ndarray:
        """The distinct chunk instants, ascending ([0] without chunks)."""
        return self._whole[0]

    @property
    def cumulative(self) -> np.ndarray:
        """Tokens up to and at each of `t_ns`."""
        return self._whole[1]

    def _at(self, x: float) -> float:
        if self._steps is not None and x == x:  # (a NaN reads as the masked passes read it)
            t, cumulative = self._steps
            below = int(t.searchsorted(x, "right"))  # how many instants are <= x
            if below == 0:  # before the first instant: the tokens at it
                return float(cumulative[0])
            if below == len(t):  # at or after the last instant: every token
                return float(cumulative[-1])
            pair, values = t[below - 1 : below + 1], cumulative[below - 1 : below + 1]
            return float(_INTERP(x, pair, values, None, None))
        ns, tokens = self._ns, self._tokens
        if not len(ns):
            return 0.0
        upto = ns <= x  # masked reductions: no copies of a round's thousands of chunks
        # (the ufuncs' own reductions, as ndarray.max/min/sum call them)
        low = _MAX(ns, where=upto, initial=_INT64_MIN)
        if low == _INT64_MIN:  # before the first instant: the curve's first value
            return float(tokens[ns == ns.min()].sum())
        low_tokens = _SUM(tokens, where=upto)
        high = _MIN(ns, where=~upto, initial=_INT64_MAX)
        if high == _INT64_MAX:  # at or after the last instant: every token
            return float(low_tokens)
        high_tokens = low_tokens + _SUM(tokens, where=ns == high)
        pair = np.array([low, high], dtype=np.float64)
        return float(_INTERP(x, pair, np.array([low_tokens, high_tokens]), None, None))

    def at(self, t_ns: float | np.ndarray) -> np.ndarray:
        x = np.asarray(t_ns, dtype=np.float64)
        out = np.empty(x.shape)
        flat = out.reshape(-1)
        for i, value in enumerate(x.reshape(-1).tolist()):
            known = self._seen.get(value)
            if known is None:
                known = self._seen[value] = self._at(value)
            flat[i] = known
        return out if out.ndim else out[()]

    def _known(self, x: float) -> float:
        known = self._seen.get(x)
        if known is None:
            known = self._seen[x] = self._at(x)
        return known

    def between(self, start_ns: float, end_ns: float) -> float:
        """`at(end) - at(start)`: float64 values, one float64 difference."""
        return self._known(float(end_ns)) - self._known(float(start_ns))


# -- a window on the updates ------------------------------------------------------------------


@dataclass(frozen=True)
class CounterWindow:
    """One GPU's energy over one round's window, taken between counter updates.

    `start_ns`/`end_ns` are the first and last update instants inside the steady window;
    `updates` the distinct updates inside it (the intervals between them number one fewer);
    `energy_mj` the counter's difference between them (NaN with fewer than two updates)."""

    start_ns: float
    end_ns: float
    updates: int
    energy_mj: float
    #: How far the interval's length may be off (s): the brackets' halves at both ends (a bound),
    #: or on a regular grid a standard uncertainty: one bracket over the periods the round's
    #: updates span, or the middles' scatter about the grid times sqrt(12 / updates).
    uncertainty_s: float = math.nan

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) * 1e-9 if self.updates >= 2 else 0.0


def counter_window(seen: Updates, start_ns: int, end_ns: int) -> CounterWindow:
    """The window's energy between the first update at or after `start_ns` and the last at or
    before `end_ns`."""
    inside = ((seen.t_ns >= start_ns) & (seen.t_ns <= end_ns)).nonzero()[0]  # np.flatnonzero
    if len(inside) < 2:
        return CounterWindow(float(start_ns), float(end_ns), len(inside), math.nan)
    a, b = inside[0], inside[-1]
    bracket = (seen.hi_ns - seen.lo_ns) * 1e-9
    if seen.continuous:
        uncertainty = 0.0
    elif seen.regular:
        # the grid's slope through all N updates: one bracket over the periods it spans, or
        # the middles' scatter about the grid carried into the length (sqrt(12 / N) of it)
        middles = (seen.lo_ns + seen.hi_ns) / 2.0
        n = len(seen)
        # np.mean's own steps (its pairwise sum, then / n), without its argument handling
        scatter = float(np.sqrt(np.add.reduce((middles - seen.t_ns) ** 2) / n)) * 1e-9
        uncertainty = max(float(_MAX(bracket)) / (n - 1), scatter * math.sqrt(12 / n))
    else:
        uncertainty = float(bracket[a] + bracket[b]) / 2
    return CounterWindow(
        float(seen.t_ns[a]),
        float(seen.t_ns[b]),
        len(inside),
        float(seen.value_mj[b] - seen.value_mj[a]),
        uncertainty,
    )


def update_window(
    t_ns: np.ndarray, value_mj: np.ndarray, period_s: float | None, start_ns: int, end_ns: int
) -> CounterWindow:
    """`counter_window(updates(t_ns, value_mj, period_s), start_ns, end_ns)` in one pass, the
    same numbers by the same operations, for one counter's readings (instants ascending): the
    brackets' widths and middles worked out once for the fit, the window and its
    uncertainty, and the updates inside found by bisection (the instants ascend with the
    readings: each lies in its own bracket, and the brackets follow one another), without
    the `Updates` between them. The meter's windows (a round's, an idle baseline's) are
    taken here; `counter_window` on `updates` is the definition its tests hold it to."""
    t = np.asarray(t_ns, dtype=np.int64)
    v = np.asarray(value_mj, dtype=np.float64)
    if len(t) < 2:
        return CounterWindow(float(start_ns), float(end_ns), 0, math.nan)
    # each update's reading before the change (its bracket's low end) and at it (high end),
    # as views one reading apart rather than index arithmetic
    before = (v[1:] != v[:-1]).nonzero()[0]
    lo, hi = t[before], t[1:][before]
    width = hi - lo
    regular = continuous = False
    if period_s == 0:
        instants, continuous = hi.astype(np.float64), True
    else:
        # `_instants`, keeping the middles and widths for the uncertainty
        instants = mid = (lo + hi) / 2.0
        if period_s is not None and period_s > 0 and len(mid) >= 3:
            period_ns = period_s * 1e9
            first_mid = float(mid[0])  # (a plain float: the same float64 sums as its scalar)
            grid = _grid(mid - first_mid, period_ns)
            if grid is not None:
                steps, slope, intercept = grid
                fitted = first_mid + intercept + slope * steps
                if _ALL(np.abs(fitted - mid) <= width / 2.0 + 0.01 * period_ns):
                    instants, regular = np.minimum(np.maximum(fitted, lo), hi), True
    first = int(instants.searchsorted(start_ns, "left"))
    count = int(instants.searchsorted(end_ns, "right")) - first
    if count < 2:
        return CounterWindow(float(start_ns), float(end_ns), max(count, 0), math.nan)
    a, b = first, first + count - 1
    if continuous:
        uncertainty = 0.0
    elif regular:  # as `counter_window`: the largest bracket is the largest width, scaled
        n = len(instants)
        off = mid - instants
        off *= off  # (what ** 2 computes: each square a product)
        # numpy's pairwise sum, then plain floats (float64 division and a correctly rounded
        # square root either way)
        scatter = math.sqrt(float(_SUM(off)) / n) * 1e-9
        uncertainty = max(float(_MAX(width)) * 1e-9 / (n - 1), scatter * math.sqrt(12 / n))
    else:
        uncertainty = (float(width[a]) * 1e-9 + float(width[b]) * 1e-9) / 2
    return CounterWindow(
        float(instants[a]),
        float(instants[b]),
        count,
        float(v[before[b] + 1]) - float(v[before[a] + 1]),
        uncertainty,
    )


def length_uncertainty(rounds: Sequence[RoundEnergy]) -> float:
    """The relative uncertainty of a cell's windows' length, which its energy per token
    carries (the energy between updates is exact): the rounds' length uncertainties over their
    total length, inf without a window on the updates. The rounds' edges fall at independent
    phases of the counter, so their uncertainties add in quadrature."""
    span = math.fsum(r.seconds for r in rounds)
    if not span > 0:
        return math.inf
    return math.sqrt(math.fsum(r.uncertainty_s**2 for r in rounds)) / span


# -- the interval on a cell's rounds or repeats -----------------------------------------------


@functools.lru_cache(maxsize=256)
def t_two_sided(confidence: float, dof: int) -> float:
    """The two-sided Student-t quantile: P(|T| <= t) = confidence with `dof` degrees of
    freedom (scipy, imported here so `dvfs --help` stays fast). Remembered: a sweep asks for
    the same few (confidence, dof) pairs tens of thousands of times, and the usual ones are
    in `dvfs.measure.tquantiles`, scipy's own numbers, so a sweep does not import scipy."""
    from dvfs.measure.tquantiles import T_TWO_SIDED

    known = T_TWO_SIDED.get((confidence, dof))
    if known is not None:
        return known
    from scipy import stats

    return float(stats.t.ppf((1 + confidence) / 2, dof))


def relative_half_width(values: Sequence[float], confidence: float) -> float:
    """Half-width of the Student-t interval on the mean of `values`, relative to the mean; NaN
    with fewer than two finite values or a zero mean. Identical values give 0."""
    # Plain floats: a cell has a handful of rounds, where numpy's per-call cost dominates
    # (the arithmetic is numpy's own: float64, each square a product).
    v = [x for x in map(float, values) if math.isfinite(x)]
    n = len(v)
    if n < 2:
        return math.nan
    mean = math.fsum(v) / n
    if mean == 0:
        return math.nan
    sd = math.sqrt(math.fsum((x - mean) * (x - mean) for x in v) / (n - 1))
    return abs(t_two_sided(confidence, n - 1) * sd / math.sqrt(n) / mean)


def within_precision(energy_ci: Any, latency_ci: Any, precision: float) -> Any:
    """The one test of intervals against the precision: energy per token's relative
    half-width within `precision`, and median TPOT's within it or stated by none (NaN: no TPOT
    measured). An energy interval not stated (NaN: fewer than two finite values; an infinite
    one, which a journal keeps as null) is not within. The sweep stops a cell's rounds by it
    (`Runner._precise`), adds repeats by it (`repeats_precise`), and the cube flags the cells
    that stopped at max_rounds without it (`dvfs.cube.precision`). Floats or arrays alike
    (a numpy bool, or an array of them)."""
    if isinstance(energy_ci, float) and isinstance(latency_ci, float):
        # a round's two intervals (the runner asks after every round): the same comparisons
        # on plain floats, without numpy's arrays and error state (a NaN compares false)
        return np.bool_(
            energy_ci <= precision and (latency_ci <= precision or latency_ci != latency_ci)
        )
    with np.errstate(invalid="ignore"):
        energy, latency = np.asarray(energy_ci, dtype=float), np.asarray(latency_ci, dtype=float)
        return (energy <= precision) & ((latency <= precision) | np.isnan(latency))


def repeats_precise(
    energies: Sequence[float], latencies: Sequence[float], *, precision: float, confidence: float
) -> bool:
    """Whether a cell's repeats pin energy per token and median TPOT within `precision` (the
    relative half-width at `confidence`): the adaptive-repeat rule's test, which the runner
    (`next_repeats`) and the analyses (`dvfs.analysis.headroom.unasked_repeats`) share. A
    latency with no interval (no TPOT measured) does not hold a cell back; energy does."""
    energy = relative_half_width(energies, confidence)
    latency = relative_half_width(latencies, confidence)
    return bool(within_precision(energy, latency, precision))


# -- one round's energy and tokens ----------------------------------------------------------


@dataclass(frozen=True)
class RoundEnergy:
    """One round's energy and tokens over the same interval: between counter updates where
    every GPU's counter updated at least twice inside the steady window (`on_updates`), else
    the counters interpolated at the window's edges (a continuous counter, exact at every
    reading; or one too slow for the window, uncertain by a period at each edge).

    With several GPUs each counter has its own updates: `energy_mj` is each GPU's energy per
    token over its own interval times the tokens over the first GPU's (`tokens`,
    `seconds`), so energy / tokens is exact for every GPU."""

    energy_mj: float
    tokens: float
    seconds: float
    updates: int
    on_updates: bool
    #: How far `seconds` may be off (`CounterWindow.uncertainty_s`; on interpolation, one update
    #: period's worth of step at each edge).
    uncertainty_s: float = 0.0
    #: Whether some GPU's own counter did not advance over its interval (with several GPUs the
    #: summed energy can stay positive while one GPU's energy is missing from it), or went
    #: backwards in it (`_went_back`: reset, the difference is not the energy spent).
    stalled: bool = False

    @property
    def energy_per_token_j(self) -> float:
        return self.energy_mj / 1000 / self.tokens if self.tokens > 0 else math.nan


def interpolated_mj(samples: dict[str, np.ndarray], t_ns: float) -> float:
    """The summed counters (mJ) at an instant, each interpolated between its readings."""
    times, values = gpu_counters(samples)
    return float(sum(np.interp(t_ns, times[:, g], values[:, g]) for g in range(times.shape[1])))


def _some_gpu_stalled(samples: dict[str, np.ndarray], start_ns: float, end_ns: float) -> bool:
    """Whether some GPU's counter, interpolated at the edges, did not advance between them
    (one GPU: the summed energy says as much, and is checked on it)."""
    times, values = gpu_counters(samples)
    if times.shape[1] < 2:
        return False
    return any(
        not np.interp(end_ns, times[:, g], values[:, g])
        > np.interp(start_ns, times[:, g], values[:, g])
        for g in range(times.shape[1])
    )


def _went_back(times: np.ndarray, values: np.ndarray, start_ns: float, end_ns: float) -> bool:
    """Whether some GPU's counter went backwards among the readings a window's energy is taken
    from (the last at or before `start_ns` to the first at or after `end_ns`): reset by a
    driver reload or a GPU reset, after which the difference across the window is not the
    energy spent. It is negative where the counter had counted more before the reset than
    after it (flagged as not advancing), but positive and too small where it had counted
    less (a driver loaded shortly before), which nothing else would flag."""
    for g in range(times.shape[1]):
        t, v = times[:, g], values[:, g]
        first = max(int(t.searchsorted(start_ns, "right")) - 1, 0)
        last = int(t.searchsorted(end_ns, "left")) + 1
        span = v[first:last]
        if len(span) > 1 and not bool(_ALL(span[1:] >= span[:-1])):
            return True
    return False


def round_energy(
    samples: dict[str, np.ndarray],
    curve: TokenCurve,
    window: tuple[int, int],
    periods_s: Sequence[float | None] = (),
) -> RoundEnergy:
    """A round's energy between counter updates inside `window` (see `RoundEnergy`);
    `periods_s` are the GPUs' detected update periods (None or absent: not fitted)."""
    start, end = window
    times, values = gpu_counters(samples)
    gpus = times.shape[1]
    windows = [
        update_window(
            times[:, g], values[:, g], periods_s[g] if g < len(periods_s) else None, start, end
        )
        for g in range(gpus)
    ]
    counted = min([w.updates for w in windows])  # (lists: cheaper than generators, per round)
    if len(periods_s) >= gpus and all([p == 0 for p in periods_s[:gpus]]):
        # continuous counters: exact at every reading, so the window's own edges (chunk
        # arrivals, the tokens between them exact) interpolate between readings a sample apart
        energy = interpolated_mj(samples, end) - interpolated_mj(samples, start)
        stalled = _some_gpu_stalled(samples, start, end) or _went_back(times, values, start, end)
        return RoundEnergy(
            energy, curve.between(start, end), (end - start) * 1e-9, counted, False, 0.0, stalled
        )
    if counted < 2:
        energy = interpolated_mj(samples, end) - interpolated_mj(samples, start)
        known = [p for p in periods_s if p]
        step = max(known) if known else (end - start) * 1e-9
        stalled = _some_gpu_stalled(samples, start, end) or _went_back(times, values, start, end)
        return RoundEnergy(
            energy,
            curve.between(start, end),
            (end - start) * 1e-9,
            counted,
            False,
            2 * step,
            stalled,
        )
    ref = windows[0]
    tokens = curve.between(ref.start_ns, ref.end_ns)
    energy = 0.0
    for w in windows:
        own = curve.between(w.start_ns, w.end_ns)
        energy += w.energy_mj * (tokens / own) if own > 0 else w.energy_mj
    uncertainty = max([w.uncertainty_s for w in windows])
    stalled = (gpus > 1 and any(not w.energy_mj > 0 for w in windows)) or _went_back(
        times, values, start, end
    )
    return RoundEnergy(energy, tokens, ref.seconds, counted, True, uncertainty, stalled)
