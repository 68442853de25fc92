"""The measurement's shortcuts against the code they replaced (kept here as it stood at
3c9bcb7): a fixed batch's steady window, a counter window's uncertainty, and the twin counter's
update instants, equal to the last bit."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.engines.base import RequestTrace, RoundResult
from dvfs.measure import counter
from dvfs.measure.meter import steady_window_ns
from dvfs.twin.counter import Sensor, SteppedCounter, Tail


def trace(sent: int, chunks: list[tuple[int, int]], error: str | None) -> RequestTrace:
    """A request of `chunks` (gap, tokens): each chunk's tokens drawn with it."""
    gaps = np.array([gap for gap, _ in chunks], dtype=np.int64)
    ns = sent + np.cumsum(gaps * 997)
    tok = np.array([tokens for _, tokens in chunks], dtype=np.int64)
    return RequestTrace(sent, ns, tok, 10, int(tok.sum()), error=error)


traces = st.lists(
    st.builds(
        trace,
        st.integers(0, 10**9),
        st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 4)), min_size=0, max_size=12),
        st.sampled_from([None, None, None, "boom"]),
    ),
    max_size=10,
)


def replaced_fixed_window(result: RoundResult) -> tuple[int, int] | None:
    """`steady_window_ns` for a fixed batch at 3c9bcb7."""
    done = [r for r in result.requests if r.error is None and len(r.chunk_ns)]
    if not done:
        return None
    firsts = np.array([int(r.chunk_ns[0]) for r in done])
    finishes = np.array([int(r.chunk_ns[-1]) for r in done])
    start, end = int(firsts.max()), int(finishes.min())
    return (start, end) if end > start else None


@settings(max_examples=150, deadline=None)
@given(traces)
def test_a_fixed_batchs_window_is_the_replaced_arrays(requests) -> None:
    result = RoundResult(tuple(requests), 0, 10**12)
    got = steady_window_ns(result, "fixed")
    assert got == replaced_fixed_window(result)
    assert got is None or all(type(v) is int for v in got)


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(3, 60),
    period_ns=st.integers(10_000_000, 200_000_000),
    phase_ns=st.integers(0, 10**9),
    readings_per_update=st.floats(4.0, 12.0),
    reading_phase=st.floats(0.0, 1.0),
)
def test_a_regular_windows_uncertainty_is_the_replaced_mean(
    n, period_ns, phase_ns, readings_per_update, reading_phase
) -> None:
    """A counter updating every `period_ns`, read at a period that does not divide it: the
    brackets (the readings around each update) lie on a regular grid."""
    read_ns = int(period_ns / readings_per_update)
    offset = int(reading_phase * read_ns)
    updates_ns = phase_ns + np.arange(n, dtype=np.int64) * period_ns
    lo = (updates_ns - offset) // read_ns * read_ns + offset
    hi = lo + read_ns
    values = np.cumsum(np.full(n, 1000.0))
    instants, regular = counter._instants(lo, hi, period_ns * 1e-9)
    seen = counter.Updates(instants, lo, hi, values, regular)
    got = counter.counter_window(seen, int(lo[0]) - 1, int(hi[-1]) + period_ns)
    assert got.updates == n
    if not seen.regular:
        return
    bracket = (hi - lo) * 1e-9
    middles = (lo + hi) / 2.0
    scatter = float(np.sqrt(np.mean((middles - seen.t_ns) ** 2))) * 1e-9
    want = max(float(bracket.max()) / (n - 1), scatter * math.sqrt(12 / n))
    assert got.uncertainty_s == want


@settings(max_examples=150, deadline=None)
@given(
    period_ns=st.integers(1_000_000, 200_000_000),
    sampled_share=st.floats(0.05, 1.0),
    phase_share=st.floats(0.0, 0.999),
    fold_ns=st.integers(0, 10**11),
    tail_after_ns=st.integers(-(10**9), 10**10),
    history_n=st.integers(1, 12),
)
def test_the_twin_counters_update_instants_are_the_replaced_ones(
    period_ns, sampled_share, phase_share, fold_ns, tail_after_ns, history_n
) -> None:
    """The instants `SteppedCounter` reads the truth at: `Sensor.instant_ns` of each update
    before the tail, as before (what it reads is recorded here)."""
    sensor = Sensor(
        period_ns,
        max(1, round(period_ns * sampled_share)),
        min(period_ns - 1, round(period_ns * phase_share)),
        history_n,
    )
    asked: list[np.ndarray] = []

    def truth(t_ns: np.ndarray) -> np.ndarray:
        asked.append(np.array(t_ns))
        return np.asarray(t_ns, dtype=float) * 1e-7

    tail = Tail(max(fold_ns, fold_ns + tail_after_ns), 80.0, 5.0, 30.0)
    got = SteppedCounter(sensor, fold_ns, np.arange(history_n + 1.0), 0.25, truth, tail)
    ks = np.arange(got.last + 1, got.tail_first, dtype=np.int64)
    u = sensor.instant_ns(ks)
    lo = np.maximum(u - sensor.sampled_ns, fold_ns)
    assert len(asked) == 1
    assert asked[0].dtype == np.int64
    assert np.array_equal(asked[0], np.concatenate([u, lo]))
