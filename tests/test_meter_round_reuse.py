"""The measuring side's shortcuts (issue 15) give the numbers of the code they replaced: a
round's finished requests and their ends read once, acceptance summed column by column, a
cell's key without `asdict`, a record read off a measurement by a plan. The old code is kept
here as the reference."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, fields

import numpy as np
import pytest
from conftest import race
from hypothesis import given, settings
from hypothesis import strategies as st
from test_meter_speed import old_latency_of

from dvfs.engines.base import RequestTrace, RoundResult, check_chunk_times
from dvfs.measure import meter
from dvfs.measure.plan import Cell
from dvfs.records.cell import MeasurementRecord


def bits(values: list[float]) -> list[bytes]:
    return [np.float64(v).tobytes() for v in values]


def old_steady_window_ns(result: RoundResult, mode: str) -> tuple[int, int] | None:
    done = [r for r in result.requests if r.error is None and len(r.chunk_ns)]
    if not done:
        return None
    if mode != "closed-loop":
        start = max(int(r.chunk_ns[0]) for r in done)
        end = min(int(r.chunk_ns[-1]) for r in done)
        return (start, end) if end > start else None
    firsts = np.array([int(r.chunk_ns[0]) for r in done])
    finishes = np.array([int(r.chunk_ns[-1]) for r in done])
    batch = meter.result_batch(result)
    start = int(np.sort(firsts)[min(batch, len(firsts)) - 1])
    last_sent = max(r.sent_ns for r in done)
    later = finishes[finishes > last_sent]
    end = int(later.min()) if len(later) else int(finishes.max())
    return (start, end) if end > start else None


def old_tpot_list(ok: list[RequestTrace]) -> list[float]:
    out = []
    for r in ok:
        completion = int(r.completion_tokens)
        if completion > 1:
            ns = r.chunk_ns
            out.append((int(ns[-1]) - int(ns[0])) * 1e-6 / (completion - 1))
    return out


def old_acceptance(results: list[RoundResult]) -> tuple[float, ...]:
    n = verify = proposed = accepted = completion = 0
    for res in results:
        for r in res.requests:
            if r.spec_verify_ct is None:
                continue
            n += 1
            verify += r.spec_verify_ct
            proposed += r.spec_proposed_drafts or 0
            accepted += r.spec_accepted_drafts or 0
            completion += r.completion_tokens
    if not n:
        return (math.nan, math.nan, math.nan)
    length = completion / verify if verify else math.nan
    decode = (completion - n) / verify if verify else math.nan
    rate = accepted / proposed if proposed else math.nan
    return (length, rate, decode)


@st.composite
def requests(draw: st.DrawFn) -> RequestTrace:
    sent = draw(st.integers(0, 10**12))
    gaps = draw(st.lists(st.integers(0, 10**7), max_size=12))
    ns = sent + np.cumsum(np.array(gaps, dtype=np.int64))
    tokens = np.array(draw(st.lists(st.integers(0, 5), min_size=len(ns), max_size=len(ns))))
    tokens = tokens.astype(np.int64)
    spec = draw(st.sampled_from(["none", "all", "partial"]))
    verify = None if spec == "none" else draw(st.integers(0, 40))
    proposed = None if spec != "all" else draw(st.integers(0, 200))
    accepted = None if spec != "all" else draw(st.integers(0, 200))
    error = draw(st.sampled_from([None, None, None, "boom"]))
    return RequestTrace(
        sent,
        ns,
        tokens,
        10,
        int(tokens.sum()) if error is None else draw(st.integers(0, 50)),
        spec_verify_ct=verify,
        spec_proposed_drafts=proposed,
        spec_accepted_drafts=accepted,
        retractions=draw(st.sampled_from([0, 0, 1])),
        error=error,
    )


rounds = st.lists(
    st.builds(
        lambda reqs, accept: RoundResult(tuple(reqs), 0, 1, accept),
        st.lists(requests(), max_size=6),
        st.one_of(st.none(), st.floats(1, 5)),
    ),
    max_size=4,
)


@settings(max_examples=300, deadline=None)
@given(rounds, st.sampled_from(["fixed", "closed-loop"]))
def test_a_rounds_window_and_tpot_are_those_of_the_code_they_replaced(results, mode) -> None:
    for result in results:
        for _ in range(2):  # the second time from the memo
            assert meter.steady_window_ns(result, mode) == old_steady_window_ns(result, mode)
            ok = [r for r in result.requests if r.error is None and len(r.chunk_ns)]
            assert meter.finished_requests(result.requests) == ok
            assert meter.finished_requests(list(result.requests)) == ok
            _, firsts, lasts = meter._ends(result.requests)
            assert bits(meter._tpot_of(ok, firsts, lasts)) == bits(old_tpot_list(ok))
            if ok:
                got = meter.latency_stats(result.requests).tpot_ms
                want = meter._quantiles_of_list(old_tpot_list(ok))
                assert bits(list(got)) == bits(list(want))


@settings(max_examples=300, deadline=None)
@given(rounds)
def test_acceptance_is_that_of_the_loop_it_replaced(results) -> None:
    want = old_acceptance(results)
    everyone = [r for res in results for r in res.requests]
    for got in (meter.acceptance(results), meter.acceptance(results, everyone)):
        assert bits([got.accept_length, got.accept_rate, got.decode_accept_length]) == bits(
            list(want)
        )


@given(
    st.text(max_size=8),
    st.integers(0, 3),
    st.one_of(st.none(), st.integers(100, 3000)),
    st.one_of(st.none(), st.floats(50, 1000)),
    st.integers(1, 512),
    st.text(max_size=8),
)
def test_a_cells_key_is_its_fields_as_sorted_json(drafter, repeat, clock, limit, batch, corpus):
    cell = Cell(drafter, repeat, clock, limit, batch, corpus)
    want = json.dumps(asdict(cell), sort_keys=True)
    assert cell.key == want
    assert cell.key == want  # the kept one
    assert cell == Cell(drafter, repeat, clock, limit, batch, corpus)  # the cache is no field


def old_record_of(m: meter.CellMeasurement) -> MeasurementRecord:
    def quantity(name: str) -> object:
        for part in (m, m.latency, m.accept):
            if hasattr(part, name):
                return getattr(part, name)
        raise AttributeError(name)

    return MeasurementRecord(**{f.name: quantity(f.name) for f in fields(MeasurementRecord)})


@settings(max_examples=100, deadline=None)
@given(
    st.floats(0, 1e4),
    st.floats(0, 100),
    st.integers(0, 10**5),
    st.lists(st.one_of(st.just(math.nan), st.floats(0, 100)), min_size=3, max_size=3),
    st.one_of(st.just(math.nan), st.floats(1, 5)),
)
def test_a_record_reads_the_measurement_as_before(energy, seconds, tokens, quantiles, accept):
    m = meter.CellMeasurement(
        energy_j=energy,
        decode_time_s=seconds,
        output_tokens=tokens,
        rounds=2,
        requests=3,
        latency=meter.LatencyStats(tuple(quantiles), tuple(quantiles), tuple(quantiles)),
        accept=meter.Acceptance(accept, 0.5, accept),
        power_mean_w=1.0,
        power_max_w=2.0,
        sm_clock_observed_mhz=1500.0,
        temperature_max_c=50.0,
        clock_event_reasons=0,
        quality=0,
        idle_power_w=80.0,
        timeline_t_s=(0.0, 0.1),
    )
    got, want = MeasurementRecord.of(m), old_record_of(m)
    assert repr(got) == repr(want)  # NaN != NaN: the text shows every value
    assert list(got.to_json()) == [f.name for f in fields(MeasurementRecord)]
    assert repr(got.to_json()) == repr({f.name: getattr(want, f.name) for f in fields(want)})


def old_cell_latency(requests: list[RequestTrace]) -> tuple[tuple[float, ...], ...]:
    """A cell's latency as `summarise` took it before: every finished request's chunks
    gathered from the traces at once (the code `rounds_latency` replaced, as
    tests/test_meter_speed.py keeps it)."""
    old = old_latency_of([r for r in requests if r.error is None and len(r.chunk_ns)])
    return old.ttft_ms, old.tpot_ms, old.itl_ms


@settings(max_examples=100, deadline=None)
@given(rounds)
def test_a_cells_latency_from_its_rounds_chunks_is_that_of_all_its_requests(results) -> None:
    everyone = [r for res in results for r in res.requests]
    want = old_cell_latency(everyone)
    for _ in range(2):  # the second time from the rounds' memo
        got = meter.rounds_latency(results)
        assert [bits(list(q)) for q in (got.ttft_ms, got.tpot_ms, got.itl_ms)] == [
            bits(list(q)) for q in want
        ]
    assert meter.latency_stats(everyone) == meter.rounds_latency(results)


@settings(max_examples=100, deadline=None)
@given(rounds, st.integers(0, 2 * 10**12), st.integers(0, 10**8))
def test_a_rounds_token_curve_from_its_chunks_is_that_of_its_traces(results, at, span) -> None:
    for result in results:
        done = [r for r in result.requests if r.error is None and len(r.chunk_ns)]
        want = meter.TokenCurve.of([r.chunk_ns for r in done], [r.chunk_tokens for r in done])
        got = meter.round_chunks(result.requests).curve()
        assert got._ns.dtype == want._ns.dtype and got._tokens.dtype == want._tokens.dtype
        assert np.array_equal(got._ns, want._ns) and np.array_equal(got._tokens, want._tokens)
        edges = [float(at), float(at + span)]
        for curve in (got, want):
            edges += [float(t) for t in curve.t_ns[:3]]
        for a in edges:
            for b in edges:
                assert bits([got.between(a, b)]) == bits([want.between(a, b)])


@pytest.mark.parametrize("chunk_ns", [[1.0e9, 2.0e9], np.array([], dtype=float)])
def test_a_trace_with_chunk_times_that_are_not_integers_is_refused(chunk_ns) -> None:
    """The meter takes chunk times as int64 nanoseconds, array by array: a float array (which
    an epoch-sized instant would lose digits in, or a NaN turn to garbage) is refused where
    the trace is made, as both engines make them integers."""
    tokens = np.ones(len(chunk_ns), dtype=np.int64)
    with pytest.raises(ValueError, match="integer nanoseconds"):
        RequestTrace(0, np.asarray(chunk_ns), tokens, 4, len(chunk_ns))
    assert RequestTrace(0, np.asarray(chunk_ns, dtype=np.int64), tokens, 4, len(chunk_ns))
    # and a round checked as a whole, for traces made `trusted`
    row, counts = np.asarray(chunk_ns)[None, :], np.array([len(chunk_ns)])
    with pytest.raises(ValueError, match="integer nanoseconds"):
        check_chunk_times(row, counts)
    check_chunk_times(row.astype(np.int64), counts)


def test_rounds_remembered_by_threads_at_once_drop_each_oldest_once() -> None:
    """A local fleet's workers measure in threads of one process, sharing the meter's memos of
    the last rounds: two threads dropping the same oldest round at once raised KeyError in
    one (its worker lost). Threads switched as often as the interpreter allows, each round
    remembered and read back, no thread fails."""
    trace = RequestTrace(0, np.array([1, 2, 3]), np.array([1, 1, 1]), 4, 3)

    def measure(_: int) -> Callable[[], None]:
        def one_round() -> None:
            round_ = (trace,)  # a new round each time: remembered, the oldest dropped
            assert meter.round_chunks(round_).firsts == [1]
            assert meter.latency_stats(round_).tpot_ms[0] == pytest.approx(1e-6)

        return one_round

    assert race(measure, 30_000) == []
