"""A lockstep round's token curve (issue 15): where a fixed batch's requests all took their
chunks after the first at the same instants, as the twin's do, the meter reads the round's
curve through those instants once each (`TokenCurve.steps`), by bisection, instead of masked
passes over every request's chunks. The numbers are those of the curve on every chunk, to the
bit, at any instant: on a chunk, between two, before the first, after the last."""

from __future__ import annotations

import gc
import math
import weakref
from dataclasses import replace
from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_meter_round_reuse import bits
from test_round_arrays import checked_round, stats_bits

from dvfs.engines.base import RoundArrays, RoundResult
from dvfs.measure import meter
from dvfs.measure.counter import TokenCurve


@st.composite
def lockstep_arrays(draw: st.DrawFn) -> RoundArrays:
    """A fixed batch whose rows are whole and share their instants after the first chunk
    (the first chunks at one instant, or at a few: a prefill in parts); or, now and then,
    rows that do not share them (read chunk by chunk)."""
    n = draw(st.integers(1, 6))
    width = draw(st.integers(1, 8))
    sent = draw(st.integers(0, 10**12))
    first_gaps = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    # the first chunks before the second column's instant: each row ascends
    firsts = sent + 10**6 + np.array(first_gaps, dtype=np.int64) * 1000
    steps = draw(st.lists(st.integers(1, 10**7), min_size=width - 1, max_size=width - 1))
    later = sent + 10**7 + np.cumsum(np.array(steps, dtype=np.int64))
    chunk_ns = np.empty((n, width), dtype=np.int64)
    chunk_ns[:, 0] = firsts
    chunk_ns[:, 1:] = later
    if draw(st.booleans()) and n > 1 and width > 2:  # one row off the others' instants
        chunk_ns[-1, 2:] += 1
    tokens = draw(st.lists(st.integers(0, 5), min_size=n * width, max_size=n * width))
    chunk_tokens = np.array(tokens, dtype=np.int64).reshape(n, width)
    counts = np.full(n, width, dtype=np.int64)
    completion = chunk_tokens.sum(axis=1)
    return checked_round(sent, chunk_ns, chunk_tokens, counts, completion)


@settings(max_examples=300, deadline=None)
@given(lockstep_arrays(), st.lists(st.integers(-(10**6), 3 * 10**7), max_size=4))
def test_a_lockstep_rounds_curve_reads_as_the_curve_on_every_chunk(arrays, offsets) -> None:
    chunks = meter.round_chunks(RoundResult.of_arrays(arrays, 0, 1, None))
    got = chunks.curve()
    want = TokenCurve(chunks.ns, chunks.tokens)  # every chunk, read by masked passes
    shared = bool((arrays.chunk_ns[:, 1:] == arrays.chunk_ns[0, 1:]).all())
    assert (got._steps is not None) == shared  # the bisection is what is tested
    instants = sorted(set(arrays.chunk_ns.reshape(-1).tolist()))
    xs = [float(t) for t in instants] + [float(t) + 0.5 for t in instants]
    xs += [float(arrays.sent_ns + o) for o in offsets] + [math.nan, -1e30, 1e30]
    for x in xs:
        assert bits([got.between(x, xs[0])]) == bits([want.between(x, xs[0])])
        assert bits([float(got.at(x))]) == bits([float(want.at(x))])
    assert np.array_equal(got.t_ns, want.t_ns) and np.array_equal(got.cumulative, want.cumulative)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2**62), st.integers(0, 9)), max_size=8, unique_by=lambda p: p[0]
    ),
    st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=6),
)
def test_a_curve_through_distinct_instants_reads_as_one_through_its_chunks(pairs, xs) -> None:
    """`TokenCurve.steps` on distinct instants (int64, up to instants float64 cannot tell
    apart) reads as the curve on the same chunks; it falls back where they do not ascend."""
    pairs.sort()
    ns = np.array([t for t, _ in pairs], dtype=np.int64)
    tokens = np.array([k for _, k in pairs], dtype=np.int64)
    got, want = TokenCurve.steps(ns, tokens), TokenCurve(ns, tokens)
    for x in [*xs, *(float(t) for t in ns)]:
        assert bits([float(got.at(x))]) == bits([float(want.at(x))])


def with_token(arrays: RoundArrays, at: int, count: int) -> RoundArrays:
    """The round with one chunk's tokens (the `at`-th, row by row) set to `count`."""
    tokens = arrays.chunk_tokens.copy()
    tokens.reshape(-1)[at % tokens.size] = count
    counts = arrays.counts
    return checked_round(arrays.sent_ns, arrays.chunk_ns.copy(), tokens, counts, tokens.sum(axis=1))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(lockstep_arrays(), min_size=1, max_size=4),
    st.one_of(
        st.none(), st.tuples(st.integers(0, 3), st.integers(0, 47), st.sampled_from([-1, 64, 65]))
    ),
)
def test_lockstep_rounds_latency_counted_is_that_of_their_chunks_end_to_end(rounds, odd) -> None:
    """`_lockstep_latency` (the ITL's gaps counted, not repeated) gives `_latency_from`'s
    numbers on the rounds' chunks put end to end, to the bit; it declines rounds with a
    chunk of negative or more than `_COUNTED_TOKENS` tokens, and `rounds_latency` takes it
    where the rounds are many chunks."""
    if odd is not None:  # one chunk of unusual tokens (past `_COUNTED_TOKENS`, or negative)
        which, at, count = odd
        rounds[which % len(rounds)] = with_token(rounds[which % len(rounds)], at, count)
    results = [RoundResult.of_arrays(arrays, 0, 1, None) for arrays in rounds]
    chunks = [meter.round_chunks(result) for result in results]
    want = meter._latency_from(
        *(
            np.concatenate([getattr(c, name) for c in chunks])
            for name in ("sent", "completion", "counts", "ns", "tokens")
        )
    )
    if all(c.lockstep is not None for c in chunks):
        got = meter._lockstep_latency(chunks)
        counted = [a.chunk_tokens for a in rounds if a.chunk_ns.shape[1] > 1]
        declined = any(t.min() < 0 or t.max() > meter._COUNTED_TOKENS for t in counted)
        assert (got is None) == declined
        if got is not None:
            assert stats_bits(got) == stats_bits(want)
    with mock.patch.object(meter, "_COUNTED_FROM", 0):
        assert stats_bits(meter.rounds_latency(results)) == stats_bits(want)


@settings(max_examples=300, deadline=None)
@given(lockstep_arrays())
def test_a_round_vouched_lockstep_reads_as_one_compared_and_a_false_claim_is_caught(arrays) -> None:
    """An engine that builds its rows in lockstep says so (`RoundArrays.lockstep`) and the
    meter does not compare them: its chunks are those of the same round compared, to the bit.
    A round claiming lockstep that does not hold it is caught by `lockstep_holds`, which the
    twin's tests ask of its rounds."""
    holds = bool((arrays.chunk_ns[:, 1:] == arrays.chunk_ns[0, 1:]).all())
    assert arrays.lockstep_holds() == holds
    vouched = replace(arrays, lockstep=True)
    assert vouched.lockstep_holds() == holds  # the claim does not change what is checked
    if not holds:
        return
    compared = meter.round_chunks(RoundResult.of_arrays(arrays, 0, 1, None))
    trusted = meter.round_chunks(RoundResult.of_arrays(vouched, 0, 1, None))
    assert compared.lockstep is not None and trusted.lockstep is not None
    for got, want in zip(trusted.lockstep, compared.lockstep, strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want)


@settings(max_examples=200, deadline=None)
@given(lockstep_arrays(), st.integers(1, 10**9))
def test_a_token_grid_run_again_later_gives_the_numbers_of_its_own_chunks(arrays, later) -> None:
    """A twin sweep runs each planned round, the same read-only token array, at every knob
    setting: what its tokens alone give (their sums, the ITL's counts) is remembered with the
    array (`_token_grid`) and read again for the same tokens at other instants, with the
    numbers of those rounds' own chunks, to the bit. A writable array is never remembered
    (its tokens could change)."""
    again = replace(arrays, sent_ns=arrays.sent_ns + later, chunk_ns=arrays.chunk_ns + later)
    again.chunk_ns.flags.writeable = False
    results = [RoundResult.of_arrays(a, 0, 1, None) for a in (arrays, again)]
    chunks = [meter.round_chunks(result) for result in results]
    grid = meter._token_grid(arrays.chunk_tokens)
    assert meter._token_grid(arrays.chunk_tokens).facts is grid.facts
    sums = grid.sums()
    assert np.array_equal(sums, arrays.chunk_tokens.sum(axis=0)) and not sums.flags.writeable
    writable = arrays.chunk_tokens.copy()
    assert meter._token_grid(writable).facts is not meter._token_grid(writable).facts
    for c in chunks:
        want = meter._latency_from(c.sent, c.completion, c.counts, c.ns, c.tokens)
        if c.lockstep is None:
            continue
        assert c.grid is arrays.chunk_tokens  # the engine's array, shared by both rounds
        got = meter._lockstep_latency([c])
        if got is not None:
            assert stats_bits(got) == stats_bits(want)


def test_the_token_memo_keeps_no_array_alive() -> None:
    """The memo of what token arrays give holds each array weakly: the engine's cache of
    planned rounds decides how long one lives (a sweep's memory stays flat), and an array
    made later at the same address is not taken for the one that died."""
    tokens = np.ones((4, 6), dtype=np.int64)
    tokens.flags.writeable = False
    held = weakref.ref(tokens)
    grid = meter._token_grid(tokens)
    grid.sums(), grid.itl_counts()  # what is remembered holds no view of the array either
    first = grid.facts
    assert meter._token_grid(tokens).facts is first
    del tokens, grid
    gc.collect()
    assert held() is None
    again = np.ones((4, 6), dtype=np.int64)
    again.flags.writeable = False
    assert meter._token_grid(again).facts is not first
