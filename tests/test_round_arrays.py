"""A round as arrays (issue 15): the twin's fixed batches carry their chunks as whole arrays
(`RoundArrays`), which the meter reads at once, the per-request traces built only when
someone asks for them. Every number read from the arrays is the one read from the traces, to
the bit, and a sweep's measurement builds no trace."""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_meter_round_reuse import bits

from dvfs.engines.base import RequestTrace, RoundArrays, RoundResult, check_chunks
from dvfs.measure import meter
from dvfs.measure.plan import plan_cells
from tests.test_inflight import twin_runner

DEMO = Path(__file__).resolve().parent.parent / "dvfs" / "campaigns" / "demo.toml"


@st.composite
def round_arrays(draw: st.DrawFn) -> RoundArrays:
    n = draw(st.integers(0, 6))
    width = draw(st.integers(0, 8))
    # whole rows (a round cut at its window's end), or any prefix of them, none among them
    whole = width and draw(st.booleans())
    counts = np.array(
        [width if whole else draw(st.integers(0, width)) for _ in range(n)], dtype=np.int64
    )
    sent = draw(st.integers(0, 10**12))
    gaps = draw(st.lists(st.integers(0, 10**7), min_size=n * width, max_size=n * width))
    chunk_ns = sent + np.cumsum(np.array(gaps, dtype=np.int64).reshape(n, width), axis=1)
    tokens = draw(st.lists(st.integers(0, 5), min_size=n * width, max_size=n * width))
    chunk_tokens = np.array(tokens, dtype=np.int64).reshape(n, width)
    used = np.arange(width) < counts[:, None]
    completion = np.where(used, chunk_tokens, 0).sum(axis=1)
    aborted = draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=n, max_size=n)))
    return checked_round(
        sent,
        chunk_ns,
        chunk_tokens,
        counts,
        completion,
        None if aborted is None else np.array(aborted),
        draw(st.one_of(st.none(), st.integers(2, 16))),
    )


def checked_round(
    sent: int,
    chunk_ns: np.ndarray,
    chunk_tokens: np.ndarray,
    counts: np.ndarray,
    completion: np.ndarray,
    aborted: np.ndarray | None = None,
    verify_tokens: int | None = None,
) -> RoundArrays:
    """A round's arrays as an engine hands them over: checked (`check_chunks`) and read-only,
    every prompt 16 tokens."""
    check_chunks(chunk_ns, chunk_tokens, counts, completion)
    for array in (chunk_ns, chunk_tokens, counts, completion):
        array.flags.writeable = False
    prompts = np.full(len(counts), 16, dtype=np.int64)
    return RoundArrays(
        sent, chunk_ns, chunk_tokens, counts, completion, prompts, aborted, verify_tokens
    )


def both(arrays: RoundArrays, accept: float | None) -> tuple[RoundResult, RoundResult]:
    """The round as arrays, and as the same traces made eagerly (no arrays)."""
    lazy = RoundResult.of_arrays(arrays, 0, 1, accept)
    return lazy, RoundResult(arrays.traces(), 0, 1, accept)


def stats_bits(stats: meter.LatencyStats) -> list[list[bytes]]:
    return [bits(list(q)) for q in (stats.ttft_ms, stats.tpot_ms, stats.itl_ms)]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(round_arrays(), st.one_of(st.none(), st.floats(1, 5))), max_size=4),
    st.sampled_from(["fixed", "closed-loop"]),
)
def test_the_meter_reads_from_a_rounds_arrays_what_it_reads_from_its_traces(rounds, mode) -> None:
    pairs = [both(arrays, accept) for arrays, accept in rounds]
    lazy = [a for a, _ in pairs]
    eager = [b for _, b in pairs]
    for a, b in pairs:
        for _ in range(2):  # the second time from the memo
            assert meter.steady_window_ns(a, mode) == meter.steady_window_ns(b, mode)
            got, want = meter.round_chunks(a), meter.round_chunks(b.requests)
            assert (got.firsts, got.lasts) == (want.firsts, want.lasts)
            for name in ("counts", "ns", "tokens", "sent", "completion"):
                x, y = getattr(got, name), getattr(want, name)
                assert x.dtype == y.dtype and np.array_equal(x, y) and not x.flags.writeable
            assert stats_bits(meter.latency_stats(a)) == stats_bits(meter.latency_stats(b))
    assert stats_bits(meter.rounds_latency(lazy)) == stats_bits(meter.rounds_latency(eager))
    got_accept, want_accept = meter.acceptance(lazy), meter.acceptance(eager)
    assert repr(got_accept) == repr(want_accept)  # NaN != NaN: the text shows every value
    # the traces, once asked for, are those the arrays were read as
    for a, b in pairs:
        assert [trace_fields(r) for r in a.requests] == [trace_fields(r) for r in b.requests]


def trace_fields(trace: RequestTrace) -> dict[str, object]:
    """A trace's fields, its arrays as lists with their type (a trace's `==` compares arrays
    element by element, which has no truth value)."""
    return {
        name: (value.dtype.str, value.tolist()) if isinstance(value, np.ndarray) else value
        for name, value in vars(trace).items()
    }


def test_a_round_as_arrays_builds_its_traces_once_when_read_and_travels_whole() -> None:
    chunk_ns = np.array([[10, 20, 30], [11, 21, 31]], dtype=np.int64)
    tokens = np.array([[1, 2, 3], [1, 2, 0]], dtype=np.int64)
    arrays = RoundArrays(
        5, chunk_ns, tokens, np.array([3, 2]), np.array([6, 3]), np.array([7, 8]), None, 4
    )
    result = RoundResult.of_arrays(arrays, 0, 100, 2.5)
    assert "requests" not in result.__dict__
    first = result.requests
    assert result.requests is first and len(first) == 2
    assert [r.chunk_ns.tolist() for r in first] == [[10, 20, 30], [11, 21]]
    assert (first[0].spec_verify_ct, first[0].spec_accepted_drafts) == (2, 3)
    assert first[1].spec_proposed_drafts == 1 * 3
    back = pickle.loads(pickle.dumps(RoundResult.of_arrays(arrays, 0, 100, 2.5)))
    assert back.arrays is not None and "requests" not in back.__dict__
    assert [trace_fields(r) for r in back.requests] == [trace_fields(r) for r in first]
    # a copy with other requests is no round of these arrays any more
    changed = replace(result, requests=first[:1])
    assert changed.arrays is None and changed.requests == first[:1]


@pytest.mark.parametrize("round_end", ["window", "complete"])
def test_a_cell_measured_from_the_twins_arrays_is_the_one_measured_from_its_traces(
    tmp_path: Path, round_end: str
) -> None:
    """Through the runner on the twin: the cell measured (no trace built) equals the cell
    measured from the same rounds made traces only, field by field."""
    text = DEMO.read_text().replace("max_rounds = 8", f'max_rounds = 3\nround_end = "{round_end}"')
    measured: dict[str, list[str]] = {}
    for way in ("arrays", "traces"):
        (tmp_path / way).mkdir()
        with twin_runner(tmp_path / way, text) as runner:
            engine = runner.engine
            run = engine.run

            def traces_only(workload: Any, timeline: Any = None, run: Any = run) -> RoundResult:
                result = run(workload, timeline)
                assert result.arrays is not None  # a fixed batch on the twin
                return replace(result)  # the same round, its arrays left behind

            def no_traces(self: RoundArrays) -> Any:
                raise AssertionError("a trace was built while measuring")

            def lockstep_checked(
                workload: Any, timeline: Any = None, run: Any = run
            ) -> RoundResult:
                result = run(workload, timeline)
                # the meter takes the twin's word that its rows are in lockstep: keep it true
                assert result.arrays is not None and result.arrays.lockstep
                assert result.arrays.lockstep_holds()
                return result

            patch = pytest.MonkeyPatch()
            if way == "traces":
                patch.setattr(engine, "run", traces_only)
            else:
                patch.setattr(RoundArrays, "traces", no_traces)
                patch.setattr(engine, "run", lockstep_checked)
            try:
                got = []
                for name in ("none", "eagle3"):
                    engine.start(next(d for d in runner.campaign.drafters if d.name == name))
                    cells = [c for c in plan_cells(runner.campaign) if c.drafter == name]
                    for cell in cells[:: len(cells) // 6]:
                        got.append(repr(runner.measure(cell)))
            finally:
                patch.undo()
            measured[way] = got
    assert measured["arrays"] == measured["traces"]
