"""Issue 15, the meter's second pass: each rewritten step against the code it replaced, to the
last bit on random inputs (old formula vs new), so the twin's cube does not move."""

from __future__ import annotations

import math
from dataclasses import fields
from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.cube import build
from dvfs.engines.base import SPLIT_PARTS, PassLedger, RequestTrace
from dvfs.gpu import twin as twin_gpu
from dvfs.gpu.base import BulkReadings
from dvfs.measure import meter
from dvfs.measure.counter import RoundEnergy
from dvfs.measure.meter import QUANTILES, LatencyStats, latency_stats
from dvfs.records import cell as cell_records
from dvfs.records.cell import EnergySplit, MeasurementRecord
from dvfs.records.version import JOURNAL_SCHEMA, stored_float, stored_floats, stored_int
from dvfs.twin.timeline import Readings


def bits(x: float) -> bytes:
    return np.float64(x).tobytes()


def same(a: tuple[float, ...] | list[float], b: tuple[float, ...] | list[float]) -> bool:
    """Equal to the last bit, NaN equal to NaN."""
    return len(a) == len(b) and all(bits(x) == bits(y) for x, y in zip(a, b, strict=True))


# -- the code replaced (95d49fe), kept here as the reference --------------------------------------


def old_quantiles(values: np.ndarray) -> tuple[float, ...]:
    if len(values) == 0:
        return tuple(math.nan for _ in QUANTILES)
    return tuple(float(q) for q in np.quantile(np.asarray(values, dtype=float), QUANTILES))


def old_tpot_ms(ok: list[RequestTrace]) -> np.ndarray:
    n = len(ok)
    first = np.fromiter((r.chunk_ns[0] for r in ok), dtype=np.int64, count=n)
    last = np.fromiter((r.chunk_ns[-1] for r in ok), dtype=np.int64, count=n)
    completion = np.fromiter((r.completion_tokens for r in ok), dtype=np.int64, count=n)
    multi = completion > 1
    return (last[multi] - first[multi]) * 1e-6 / (completion[multi] - 1)


def old_latency_of(ok: list[RequestTrace]) -> LatencyStats:
    if not ok:
        empty = old_quantiles(np.array([]))
        return LatencyStats(empty, empty, empty)
    n = len(ok)
    counts = np.fromiter((len(r.chunk_ns) for r in ok), dtype=np.int64, count=n)
    sent = np.fromiter((r.sent_ns for r in ok), dtype=np.int64, count=n)
    completion = np.fromiter((r.completion_tokens for r in ok), dtype=np.int64, count=n)
    ns = np.concatenate([r.chunk_ns for r in ok]).astype(np.int64, copy=False)
    tokens = np.concatenate([r.chunk_tokens for r in ok])
    ends = np.cumsum(counts)
    starts = ends - counts
    first, last = ns[starts], ns[ends - 1]
    ttft = (first - sent) * 1e-6
    multi = completion > 1
    tpot = (last[multi] - first[multi]) * 1e-6 / (completion[multi] - 1)
    later = np.ones(len(ns), dtype=bool)
    later[starts] = False
    gaps = np.diff(ns)[later[1:]] * 1e-6
    gap_tokens = tokens[1:][later[1:]]
    keep = gap_tokens > 0
    gaps, gap_tokens = gaps[keep], gap_tokens[keep]
    itl = np.repeat(gaps / gap_tokens, gap_tokens)
    return LatencyStats(old_quantiles(ttft), old_quantiles(tpot), old_quantiles(itl))


def old_window_stats(s: dict[str, np.ndarray], start: int, end: int) -> tuple:
    inside = (s["t_ns"] >= start) & (s["t_ns"] <= end)
    if not inside.any():
        return (int(inside.sum()),)
    return (
        int(inside.sum()),
        float(s["sm_clock_mhz"][inside].mean()) * (end - start),
        float(s["power_mw"][inside].max()) / 1000,
        float(s["temperature_c"][inside].max()),
        int(np.bitwise_or.reduce(s["reasons"][inside])),
        (s["t_ns"][inside] - start) * 1e-9,
        s["power_mw"][inside] / 1000,
        s["sm_clock_mhz"][inside].astype(float),
    )


def old_split(ledger: PassLedger, start_ns: int, end_ns: int) -> tuple[np.ndarray, np.ndarray]:
    ends = ledger.ends_ns
    dur_ns = np.round(ledger.duration_s * 1e9)
    overlap_ns = np.clip(
        np.minimum(ends, end_ns) - np.maximum(ends - dur_ns, start_ns), 0, None
    ).astype(float)
    share = overlap_ns / np.maximum(dur_ns, 1.0)
    host_s = ledger.host_s * share
    busy_s = overlap_ns * 1e-9 - host_s
    busy_j = ledger.duration_s * ledger.power_w * share - host_s * ledger.idle_power_w
    parts = len(SPLIT_PARTS)
    energy = np.bincount(ledger.role, weights=busy_j, minlength=parts)
    time = np.bincount(ledger.role, weights=busy_s, minlength=parts)
    gap_s = max(0.0, (end_ns - start_ns) * 1e-9 - float(overlap_ns.sum()) * 1e-9)
    time[-1] = float(host_s.sum()) + gap_s
    energy[-1] = time[-1] * ledger.idle_power_w
    return energy, time


def old_exact(rounds: list[tuple[PassLedger, tuple[int, int], RoundEnergy]]) -> tuple:
    energy = [0.0] * len(SPLIT_PARTS)
    time = [0.0] * len(SPLIT_PARTS)
    for ledger, window, counted in rounds:
        share_j, share_s = old_split(ledger, *window)
        total_j, total_s = float(share_j.sum()), float(share_s.sum())
        joules = max(counted.energy_mj, 0.0) / 1000
        for i in range(len(SPLIT_PARTS)):
            energy[i] += joules * float(share_j[i]) / total_j if total_j > 0 else 0.0
            time[i] += counted.seconds * float(share_s[i]) / total_s if total_s > 0 else 0.0
    return tuple(energy), tuple(time)


# -- latency: plain-float TPOT and TTFT, ITL without the NaN pass ------------------------------


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(0, 1e6, allow_nan=False), max_size=60))
def test_quantiles_of_plain_floats_and_of_nan_free_arrays_are_np_quantiles(values) -> None:
    want = old_quantiles(np.array(values, dtype=float))
    assert same(meter._quantiles_of_list(list(values)), want)
    assert same(meter._ordered_quantiles(np.array(values, dtype=float)), want)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 60_000), st.integers(1, 40), st.integers(0, 2**32 - 1))
def test_order_statistics_of_many_equal_latencies_are_np_quantiles(n, distinct, seed) -> None:
    # a cell's latencies: a few distinct gaps, repeated by every request of every round
    gaps = np.random.default_rng(seed).integers(1, 10**7, distinct) * 1e-6
    values = np.random.default_rng(seed + 1).choice(gaps, n)
    assert same(meter._ordered_quantiles(values), old_quantiles(values))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(-(10**9), 10**12), max_size=80),
    st.lists(st.integers(0, 10**7), min_size=1, max_size=80),
    st.lists(st.integers(1, 16), min_size=1, max_size=80),
)
def test_itl_order_statistics_on_integers_and_float_bits_are_np_quantiles(
    any_gaps, gaps, tokens
) -> None:
    # one token a chunk: picked among the integer gaps (negative ones too), then scaled
    ints = np.array(any_gaps, dtype=np.int64)
    assert same(meter._gap_quantiles(ints.copy()), old_quantiles(ints * 1e-6))
    # several: gaps spread over their tokens (zeros, equal values, negative ones where the
    # instants do not ascend), counted rather than repeated
    for some in (gaps, any_gaps):
        spread, counts = some[: len(tokens)], np.array(tokens[: len(some)], dtype=np.int64)
        values = np.array(spread, dtype=np.int64) * 1e-6 / counts
        itl = np.repeat(values, counts)
        assert same(meter._counted_quantiles(values, counts), old_quantiles(itl))
        assert same(meter._counted_quantiles(values[:0], counts[:0]), old_quantiles(itl[:0]))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(-(10**6), 10**6), st.integers(0, 6)), min_size=1),
        max_size=6,
    )
)
def test_latency_of_chunks_out_of_order_equals_the_code_it_replaced(requests) -> None:
    # instants that go back (a negative gap; a trace refuses them, a round's arrays are not
    # checked): the ITL's order statistics picked among the floats
    ok = [
        SimpleNamespace(
            sent_ns=0,
            chunk_ns=10**9 + np.array([g for g, _ in r], dtype=np.int64),
            chunk_tokens=np.array([k for _, k in r], dtype=np.int64),
            completion_tokens=sum(k for _, k in r),
            error=None,
        )
        for r in requests
    ]
    new, old = meter._latency_of(ok), old_latency_of(ok)
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert same(getattr(new, name), getattr(old, name)), name


def trace(sent: int, gaps: list[int], tokens: list[int], scale: int) -> RequestTrace:
    ns = sent + np.cumsum(np.array(gaps, dtype=np.int64) * scale)
    tok = np.array(tokens[: len(ns)], dtype=np.int64)
    return RequestTrace(sent, ns, tok, 10, int(tok.sum()))


#: A request's 1-30 chunks as (gap, tokens): each chunk's tokens drawn with it (drawing 30 and
#: cutting them to the chunks there are cost hypothesis most of the test's time).
CHUNKS = st.one_of(
    # speculation, empty chunks
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 6)), min_size=1, max_size=30),
    # one token a chunk
    st.lists(st.integers(0, 10**6), min_size=1, max_size=30).map(lambda gs: [(g, 1) for g in gs]),
)

traces = st.lists(
    st.builds(
        lambda sent, chunks, scale: trace(
            sent, [g for g, _ in chunks], [k for _, k in chunks], scale
        ),
        st.integers(0, 10**12),
        CHUNKS,
        st.sampled_from([1, 997, 1_000_003]),
    ),
    max_size=10,
)


@settings(max_examples=300, deadline=None)
@given(traces)
def test_latency_equals_the_code_it_replaced(requests) -> None:
    ok = [r for r in requests if len(r.chunk_ns)]
    new, old = meter._latency_of(ok), old_latency_of(ok)
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert same(getattr(new, name), getattr(old, name)), name
    # a round's median TPOT, the one the runner reads as it measures, on plain floats
    assert same(latency_stats(tuple(requests)).tpot_ms, old_quantiles(old_tpot_ms(ok)))
    assert same(meter._tpot_of(ok, *meter._ends(ok)[1:]), old_tpot_ms(ok).tolist())


# -- the samples inside a window: a slice of ascending instants, or a mask -----------------------


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 1000), max_size=40),
    st.integers(-10, 1010),
    st.integers(0, 600),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_window_samples_equal_the_masked_ones(instants, start, length, ascending, seed) -> None:
    rng = np.random.default_rng(seed)
    t = np.array(sorted(instants) if ascending else instants, dtype=np.int64)
    n = len(t)
    s = {
        "t_ns": t,
        "sm_clock_mhz": rng.integers(200, 2000, n),
        "power_mw": rng.integers(0, 700_000, n),
        "temperature_c": rng.integers(20, 90, n),
        "reasons": rng.integers(0, 1 << 12, n),
    }
    end = start + length
    inside, n_inside, decoding, n_decoding = meter._inside(t, start, end)
    # the window's samples, and the decode's before its close: the same as the masks pick
    for picked, count, close in ((inside, n_inside, end), (decoding, n_decoding, end - 1)):
        old = old_window_stats(s, start, close)
        assert count == old[0]
        if count:
            new = (
                count,
                meter._mean(s["sm_clock_mhz"][picked]) * (close - start),
                float(s["power_mw"][picked].max()) / 1000,
                float(s["temperature_c"][picked].max()),
                int(np.bitwise_or.reduce(s["reasons"][picked])),
                (s["t_ns"][picked] - start) * 1e-9,
                s["power_mw"][picked] / 1000,
                s["sm_clock_mhz"][picked].astype(float),
            )
            assert new[:5] == old[:5] and same([new[1]], [old[1]])
            for a, b in zip(new[5:], old[5:], strict=True):
                assert a.dtype == b.dtype and same(a.tolist(), b.tolist())


# -- the energy split: maximum for clip, plain floats for numpy scalars -------------------------


#: 1-12 passes, each (duration, gap before it, power, role): one strategy built once (lists of
#: a drawn length would build four new strategies per ledger).
PASSES = st.lists(
    st.tuples(
        st.floats(0, 0.05), st.integers(0, 20_000_000), st.floats(50, 700), st.integers(0, 2)
    ),
    min_size=1,
    max_size=12,
)


@st.composite
def ledgers(draw: st.DrawFn) -> PassLedger:
    durations, gaps, powers, roles = (
        np.array(column) for column in zip(*draw(PASSES), strict=True)
    )
    ends = np.cumsum(gaps.astype(np.int64) + np.round(durations * 1e9))
    return PassLedger(
        ends_ns=ends.astype(np.int64),
        duration_s=durations,
        power_w=powers,
        role=roles,
        host_s=durations * draw(st.floats(0, 0.5)),
        idle_power_w=draw(st.floats(30, 120)),
    )


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            ledgers(),
            st.integers(-5_000_000, 100_000_000),
            st.integers(0, 300_000_000),
            st.floats(-10, 1e5),
            st.floats(0, 2),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_energy_split_equals_the_code_it_replaced(rounds) -> None:
    cases = []
    for ledger, start, length, energy_mj, seconds in rounds:
        window = (start, start + length)
        counted = RoundEnergy(energy_mj, 10.0, seconds, 5, True)
        new_j, new_s = ledger.split(*window)
        old_j, old_s = old_split(ledger, *window)
        assert same(new_j.tolist(), old_j.tolist()) and same(new_s.tolist(), old_s.tolist())
        cases.append((ledger, window, counted))
    split = EnergySplit.exact(cases)
    assert split is not None
    energy, time = old_exact(cases)
    assert same(split.energy_j, energy) and same(split.time_s, time)


# -- the twin's NVML units, the cube's numbers, stored floats -----------------------------------


def old_nvml_units(r: Readings) -> BulkReadings:
    return BulkReadings(
        energy_mj=np.trunc(r.energy_j * 1000).astype(np.int64),
        power_mw=np.round(r.power_w * 1000).astype(np.int64),
        sm_clock_mhz=r.sm_clock_mhz.astype(np.int64, copy=False),
        temperature_c=np.round(r.temperature_c).astype(np.int64),
        reasons=r.reasons.astype(np.int64, copy=False),
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0, 1e7),
            st.one_of(st.floats(0, 1000), st.sampled_from([0.0005, 0.0015, 0.0025, 699.9995])),
            st.one_of(st.floats(0, 120), st.sampled_from([20.5, 21.5, 44.5])),
        ),
        min_size=1,
        max_size=20,
    )
)
def test_nvml_units_equal_the_code_they_replaced(rows) -> None:
    energy, power, temperature = (np.array(column) for column in zip(*rows, strict=True))
    n = len(rows)
    r = Readings(
        energy_j=energy,
        power_w=power,
        power_average_w=power,
        sm_clock_mhz=np.full(n, 1980, dtype=np.int64),
        temperature_c=temperature,
        reasons=np.zeros(n, dtype=np.int64),
        true_energy_j=energy,
    )
    new = twin_gpu._nvml_units(r.energy_j, r.power_w, r.sm_clock_mhz, r.temperature_c, r.reasons)
    old = old_nvml_units(r)
    for name in ("energy_mj", "power_mw", "sm_clock_mhz", "temperature_c", "reasons"):
        a, b = getattr(new, name), getattr(old, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name


values = st.lists(
    st.one_of(st.none(), st.floats(allow_nan=True), st.integers(-(10**6), 10**6), st.booleans()),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(values)
def test_stored_and_cube_numbers_equal_a_call_each(items) -> None:
    def old_stored(v: object) -> float:
        return math.nan if v is None else float(v)  # type: ignore[arg-type]

    assert same(stored_floats(items), tuple(old_stored(v) for v in items))
    assert same(build._nums(items), [build._num(v) for v in items])


@settings(max_examples=100, deadline=None)
@given(st.integers(meter.TIMELINE_POINTS + 1, 5000))
def test_timeline_picks_are_linspaces(n) -> None:
    want = np.linspace(0, n - 1, meter.TIMELINE_POINTS).round().astype(int)
    got = meter._timeline_picks(n)
    assert got.dtype == want.dtype and np.array_equal(got, want) and not got.flags.writeable


def old_measurement_from_json(data: dict, version: int) -> MeasurementRecord:
    d = cell_records._upgrade(data, version)
    kwargs: dict = {}
    for f in fields(MeasurementRecord):
        if f.name in cell_records._QUANTILE_KEYS:
            kwargs[f.name] = stored_floats(d[f.name])
        elif f.name in cell_records._TIMELINE_KEYS:
            kwargs[f.name] = stored_floats(d.get(f.name) or ())
        elif f.name == "valid":
            kwargs[f.name] = None if d.get(f.name) is None else bool(d[f.name])
        elif f.name in cell_records._INTEGER_KEYS:
            kwargs[f.name] = stored_int(d.get(f.name))
        else:
            kwargs[f.name] = stored_float(d.get(f.name))
    return MeasurementRecord(**kwargs)


#: A stored measurement's values, as strategies built once (not once per example).
NUMBER = st.one_of(st.none(), st.floats(-1e9, 1e9), st.integers(0, 10**6))
QUANTILE_TRIPLE = st.lists(NUMBER, min_size=3, max_size=3)
TIMELINE = st.lists(NUMBER, max_size=32)
MAYBE_INT = st.one_of(st.none(), st.integers(0, 10**6))
MAYBE_BOOL = st.one_of(st.none(), st.booleans())


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_a_stored_measurement_reads_as_before(data) -> None:
    stored: dict = {}
    for f in fields(MeasurementRecord):
        if f.name in cell_records._QUANTILE_KEYS:
            stored[f.name] = data.draw(QUANTILE_TRIPLE)
        elif f.name in cell_records._TIMELINE_KEYS:
            if data.draw(st.booleans()):
                stored[f.name] = data.draw(TIMELINE)
        elif f.name in cell_records._INTEGER_KEYS:
            stored[f.name] = data.draw(MAYBE_INT)
        elif f.name == "valid":
            stored[f.name] = data.draw(MAYBE_BOOL)
        elif data.draw(st.booleans()):
            stored[f.name] = data.draw(NUMBER)
    version = JOURNAL_SCHEMA
    new = MeasurementRecord.from_json(dict(stored), version=version)
    old = old_measurement_from_json(dict(stored), version)
    assert repr(new) == repr(old)


# -- the runner's stopping test on a round's two plain floats -----------------------------------

_INTERVALS = st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 0.05]) | st.floats()


@settings(max_examples=300, deadline=None)
@given(_INTERVALS, _INTERVALS, st.sampled_from([0.0, 0.01, 0.05, 1.0]))
def test_within_precision_on_two_floats_is_its_array_answer(energy, latency, precision) -> None:
    """The plain-float comparison `Runner._precise` takes after every round says what the
    arrays' comparison says (NaN and infinities included), as a numpy bool."""
    from dvfs.measure.counter import within_precision

    got = within_precision(energy, latency, precision)
    expected = within_precision(np.array([energy]), np.array([latency]), precision)[0]
    assert type(got) is np.bool_ and got == expected
