"""Issue 15's rewrites of the measurement maths against the code they replaced: the same numbers
to the last bit (old formula vs new on random inputs), so the twin's cube does not move."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.engines.base import RequestTrace
from dvfs.measure import counter
from dvfs.measure.counter import TokenCurve, relative_half_width, t_two_sided
from dvfs.measure.meter import QUANTILES, LatencyStats, _quantiles, latency_stats
from dvfs.measure.tquantiles import CONFIDENCES, MAX_DOF, T_TWO_SIDED


def bits(x: float) -> bytes:
    return np.float64(x).tobytes()


def same_bits(a: tuple[float, ...] | list[float], b: tuple[float, ...] | list[float]) -> bool:
    return len(a) == len(b) and all(bits(x) == bits(y) for x, y in zip(a, b, strict=True))


# -- the t quantile: scipy's own, from the table or from scipy ----------------------------------


def test_the_t_table_is_scipys_to_the_last_bit() -> None:
    from scipy import stats

    for (confidence, dof), value in T_TWO_SIDED.items():
        assert bits(value) == bits(float(stats.t.ppf((1 + confidence) / 2, dof)))


def test_t_outside_the_table_comes_from_scipy() -> None:
    from scipy import stats

    assert (0.8, 3) not in T_TWO_SIDED and (0.95, 150) not in T_TWO_SIDED
    assert t_two_sided(0.8, 3) == float(stats.t.ppf(0.9, 3))
    assert t_two_sided(0.95, 150) == float(stats.t.ppf(0.975, 150))


def test_the_readme_gives_the_t_tables_reach() -> None:
    """README ("How it works", `counter.py`) said the table meant "a sweep never imports
    scipy": a campaign at `confidence = 0.8` (or a cell past 101 rounds) reads the quantile
    from scipy, so its sweep imports it. The README names the table's reach now: the
    confidences and degrees of freedom `tquantiles` holds, inside which scipy stays out."""
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    *first, last = CONFIDENCES
    reach = (
        f"values at the usual confidences, {', '.join(map(str, first))} and {last}, and 1 to "
        f"{MAX_DOF} degrees of freedom, so a sweep within them never imports scipy"
    )
    assert reach in readme
    assert set(T_TWO_SIDED) == {(c, d) for c in CONFIDENCES for d in range(1, MAX_DOF + 1)}
    probe = (
        "import sys; from dvfs.measure.counter import t_two_sided; "
        "t_two_sided({c}, {d}); print('scipy' in sys.modules)"
    )

    def imports_scipy(confidence: float, dof: int) -> bool:
        code = probe.format(c=confidence, d=dof)
        run = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
        )
        return run.stdout.strip() == "True"

    assert not imports_scipy(last, MAX_DOF)
    assert imports_scipy(0.8, 3)


# -- relative half-width: plain floats against the numpy formula --------------------------------


def old_relative_half_width(values: list[float], confidence: float) -> float:
    v = np.asarray([x for x in values if math.isfinite(x)], dtype=np.float64)
    n = len(v)
    if n < 2:
        return math.nan
    mean = math.fsum(v.tolist()) / n
    if mean == 0:
        return math.nan
    sd = math.sqrt(math.fsum(((v - mean) ** 2).tolist()) / (n - 1))
    return abs(t_two_sided(confidence, n - 1) * sd / math.sqrt(n) / mean)


finite_or_not = st.one_of(
    st.floats(-1e6, 1e6, allow_nan=False),
    st.floats(1e-9, 1e-3),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(finite_or_not, max_size=12), st.sampled_from([0.9, 0.95, 0.99]))
def test_relative_half_width_equals_the_numpy_formula(values, confidence) -> None:
    new, old = relative_half_width(values, confidence), old_relative_half_width(values, confidence)
    assert (math.isnan(new) and math.isnan(old)) or bits(new) == bits(old)


# -- latency quantiles: partitioned order statistics against np.quantile ------------------------


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.one_of(st.floats(0, 1e4, allow_nan=False), st.sampled_from([math.nan, 0.5, 2.0])),
        max_size=60,
    )
)
def test_quantiles_equal_np_quantile(values) -> None:
    got = _quantiles(np.array(values, dtype=float))
    if not values or any(math.isnan(v) for v in values):
        assert all(math.isnan(q) for q in got)
    else:
        want = [float(q) for q in np.quantile(np.array(values), QUANTILES)]
        assert same_bits(list(got), want)


def chunked(sent: int, gaps: list[int], tokens: list[int]) -> RequestTrace:
    ns = sent + np.cumsum(np.array(gaps, dtype=np.int64) * 997)
    tok = np.array(tokens[: len(ns)], dtype=np.int64)
    return RequestTrace(sent, ns, tok, 10, int(tok.sum()))


@st.composite
def a_request(draw: st.DrawFn) -> RequestTrace:
    """1-20 chunks, each with its tokens (drawn for the chunks there are, not cut off)."""
    sent = draw(st.integers(0, 10**9))
    chunks = draw(
        st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 5)), min_size=1, max_size=20)
    )
    return chunked(sent, [gap for gap, _ in chunks], [tokens for _, tokens in chunks])


requests = st.lists(a_request(), max_size=8)


@settings(max_examples=150, deadline=None)
@given(requests)
def test_a_rounds_latency_computed_when_read_equals_the_eager_one(traces) -> None:
    eager = latency_stats(list(traces))  # a list: computed at once
    lazy = latency_stats(tuple(traces))  # a round's tuple: TTFT and ITL when read
    assert type(eager) is LatencyStats
    for name in ("tpot_ms", "ttft_ms", "itl_ms"):
        a, b = getattr(eager, name), getattr(lazy, name)
        assert all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b, strict=True))


def test_a_rounds_latency_is_remembered_and_travels_as_plain_stats() -> None:
    traces = tuple(chunked(0, [5, 3, 4], [1, 2, 2]) for _ in range(3))
    first = latency_stats(traces)
    assert latency_stats(traces) is first  # the runner's call, then summarise's
    assert latency_stats(tuple(traces)) is first  # the same tuple object
    copy = pickle.loads(pickle.dumps(first))
    assert type(copy) is LatencyStats and copy == first and first == copy
    plain = LatencyStats(first.ttft_ms, first.tpot_ms, first.itl_ms)
    assert plain == first and hash(plain) == hash(first)


# -- the token curve: its instants found per reading, against np.interp on the whole curve ------


def old_curve(chunk_ns: list[np.ndarray], chunk_tokens: list[np.ndarray]):
    if not chunk_ns:
        return np.array([0.0]), np.array([0.0])
    ns = np.concatenate([np.asarray(c, dtype=np.int64) for c in chunk_ns])
    tokens = np.concatenate([np.asarray(c, dtype=np.float64) for c in chunk_tokens])
    if not len(ns):
        return np.array([0.0]), np.array([0.0])
    instants, inverse = np.unique(ns, return_inverse=True)
    return instants.astype(np.float64), np.cumsum(np.bincount(inverse, weights=tokens))


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 9)), max_size=10), max_size=6),
    st.lists(st.floats(-10, 70), min_size=1, max_size=4),
)
def test_token_curve_equals_np_interp_on_the_whole_curve(rows, xs) -> None:
    chunk_ns = [np.array(sorted(t for t, _ in row), dtype=np.int64) for row in rows]
    chunk_tokens = [np.array([k for _, k in row], dtype=np.int64) for row in rows]
    t, c = old_curve(chunk_ns, chunk_tokens)
    curve = TokenCurve.of(chunk_ns, chunk_tokens)
    points = [*xs, *(float(v) for v in t[:4])]  # between instants, and on them
    for x in points:
        assert bits(float(curve.at(x))) == bits(float(np.interp(x, t, c)))
    got = curve.at(np.array(points))
    assert same_bits(got.tolist(), np.interp(np.array(points), t, c).tolist())
    assert np.array_equal(curve.t_ns, t) and np.array_equal(curve.cumulative, c)
    if len(points) >= 2:
        a, b = points[0], points[1]
        want = float(np.diff(np.interp(np.array([a, b]), t, c))[0])
        assert bits(curve.between(a, b)) == bits(want)


# -- the counter's regular grid: polyfit's steps, and the repeated-step check -------------------


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 500), min_size=2, max_size=60, unique=True),
    st.floats(1e6, 2e8),
    st.floats(0, 5e6),
    st.integers(0, 2**32 - 1),
)
def test_line_fit_equals_polyfit(steps, period_ns, jitter_ns, seed) -> None:
    x = np.array(sorted(steps), dtype=float)
    y = x * period_ns + np.random.default_rng(seed).uniform(-jitter_ns, jitter_ns + 1, len(x))
    slope, intercept = np.polyfit(x, y, 1)
    assert same_bits(list(counter._line_fit(x, y)), [slope, intercept])


def old_instants(lo: np.ndarray, hi: np.ndarray, period_s: float | None):
    mid = (lo + hi) / 2.0
    if period_s is None or not period_s > 0 or len(mid) < 3:
        return mid, False
    period_ns = period_s * 1e9
    steps = np.round((mid - mid[0]) / period_ns)
    if len(np.unique(steps)) != len(steps):
        return mid, False
    slope, intercept = np.polyfit(steps, mid - mid[0], 1)
    fitted = mid[0] + intercept + slope * steps
    half = (hi - lo) / 2.0
    if np.all(np.abs(fitted - mid) <= half + 0.01 * period_ns):
        return np.clip(fitted, lo, hi), True
    return mid, False


@settings(max_examples=300, deadline=None)
@given(
    # per update: (counter periods since the last, offset, bracket width), drawn together
    st.lists(
        st.tuples(st.integers(1, 3), st.integers(1, 30_000_000), st.integers(0, 40_000_000)),
        min_size=1,
        max_size=40,
    ),
    st.sampled_from([None, 0.1, 0.05]),
    st.booleans(),
)
def test_update_instants_equal_the_polyfit_code(updates, period_s, shuffle):
    # updates about `periods` counter periods apart, each seen in a bracket of `widths`
    periods, offsets, widths = (np.array(column) for column in zip(*updates, strict=True))
    base = np.cumsum(periods * 100_000_000) + offsets
    lo = base.astype(np.int64)
    hi = lo + widths.astype(np.int64) + 1
    if shuffle:  # out of order: the unique check's own path
        lo, hi = lo[::-1].copy(), hi[::-1].copy()
    new_t, new_regular = counter._instants(lo, hi, period_s)
    old_t, old_regular = old_instants(lo, hi, period_s)
    assert new_regular == old_regular
    assert same_bits(new_t.tolist(), old_t.tolist())


def test_two_updates_in_one_period_are_not_a_regular_grid() -> None:
    lo = np.array([0, 100_000_000, 110_000_000, 300_000_000], dtype=np.int64)
    t, regular = counter._instants(lo, lo + 1000, 0.1)
    assert not regular and np.array_equal(t, (lo + lo + 1000) / 2.0)


@settings(max_examples=400, deadline=None)
@given(
    # per reading: (ns since the last, whether the counter stepped at it, its step in mJ)
    st.lists(
        st.tuples(st.integers(1, 40_000_000), st.booleans(), st.integers(1, 5_000)),
        max_size=80,
    ),
    st.sampled_from([None, 0.0, 0.1, 0.05, 0.025, -1.0]),
    st.integers(-50_000_000, 3_000_000_000),
    st.integers(-100_000_000, 3_000_000_000),
)
def test_a_rounds_counter_window_is_its_updates_window(readings, period_s, start, length):
    # a round's readings of one counter: ascending instants, steps at some of them
    rows = readings or [(1, False, 0)]
    gaps, stepped, steps = (np.array(c, dtype=np.int64) for c in zip(*rows, strict=True))
    t = np.cumsum(gaps)[: len(readings)]
    v = np.cumsum(np.where(stepped, steps, 0)).astype(np.float64)[: len(readings)]
    new = counter.update_window(t, v, period_s, start, start + length)
    old = counter.counter_window(counter.updates(t, v, period_s), start, start + length)
    assert new.updates == old.updates
    assert same_bits(
        [new.start_ns, new.end_ns, new.energy_mj, new.uncertainty_s],
        [old.start_ns, old.end_ns, old.energy_mj, old.uncertainty_s],
    )


def test_a_rounds_counter_window_on_a_regular_counter_is_its_updates_window() -> None:
    # a counter stepping every 100 ms read every 23 ms: a fitted grid (the regular branch)
    t = np.arange(1, 200, dtype=np.int64) * 23_000_000 + 5_000_000
    v = np.floor(t / 100_000_000).astype(np.float64) * 70_000
    seen = counter.updates(t, v, 0.1)
    assert seen.regular
    for start, end in ((0, 5_000_000_000), (1_234_567_890, 3_456_789_012), (10**9, 10**9)):
        new = counter.update_window(t, v, 0.1, start, end)
        old = counter.counter_window(seen, start, end)
        assert new.updates == old.updates
        assert same_bits(
            [new.start_ns, new.end_ns, new.energy_mj, new.uncertainty_s],
            [old.start_ns, old.end_ns, old.energy_mj, old.uncertainty_s],
        )


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])


# -- text features: characters counted once per distinct character -----------------------------


def per_character(texts: list[str]) -> tuple[float, float, float, str]:
    """The character shares as measured before, one character at a time."""
    from collections import Counter

    from dvfs.twin.textprior import CODE_SYMBOLS, _script

    scripts: Counter[str] = Counter()
    chars = digits = symbols = 0
    for text in texts:
        for ch in text:
            if ch.isspace():
                continue
            chars += 1
            if ch.isdigit():
                digits += 1
            elif ch in CODE_SYMBOLS:
                symbols += 1
            elif ch.isalpha():
                scripts[_script(ch)] += 1
    letters = sum(scripts.values())
    return (
        scripts["LATIN"] / letters if letters else 0.0,
        symbols / chars if chars else 0.0,
        digits / chars if chars else 0.0,
        min(scripts.items(), key=lambda kv: (-kv[1], kv[0]))[0].lower() if scripts else "none",
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet="ab Zé1{}();=\n\tΩλПж日本", max_size=40), min_size=1, max_size=5))
def test_text_features_count_characters_as_one_by_one(texts) -> None:
    from dvfs.twin.textprior import measure

    f = measure([[t] for t in texts])
    assert (f.latin_letters, f.code_symbols, f.digits, f.script) == per_character(
        ["\n\n".join([t]) for t in texts]
    )
