"""The power-cap search and the remembered schedule against the code they replaced (kept here as
it stood at 3c9bcb7): each capped clock found, and every timing, equal to the last bit."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.twin import physics
from dvfs.twin.passes import PassBuilder
from dvfs.twin.physics import OperatingPoint, Passes, PassTiming
from dvfs.twin.profiles import gpu_profile, gpu_profiles, model_profile

LLAMA8B = model_profile("llama-3.1-8b")
GPUS = sorted(gpu_profiles())


def replaced_operating_point(
    gpu, passes: Passes, requested_mhz: int, power_limit_w: float, timing: PassTiming | None = None
) -> OperatingPoint:
    """`physics.operating_point` at 3c9bcb7: one `time_passes` of the hot passes per halving."""
    if timing is None:
        timing = physics.time_passes(gpu, passes, requested_mhz)
    over = np.flatnonzero(timing.power_w > power_limit_w)
    if len(over) == 0:
        return OperatingPoint(int(requested_mhz), False, timing)
    clocks = np.array(sorted(c for c in gpu.supported_sm_clocks_mhz() if c <= requested_mhz))
    if len(clocks) == 0:
        raise ValueError(f"no supported SM clock at or below {requested_mhz} MHz")
    hot = passes.take(over)
    lo = np.zeros(len(over), dtype=np.int64)
    hi = np.full(len(over), len(clocks) - 1, dtype=np.int64)
    best = np.zeros(len(over), dtype=np.int64)
    while np.any(lo <= hi):
        searching = lo <= hi
        mid = np.where(searching, (lo + hi) // 2, best)
        fits = physics.time_passes(gpu, hot, clocks[mid].astype(float)).power_w <= power_limit_w
        best = np.where(searching & fits, mid, best)
        lo = np.where(searching & fits, mid + 1, lo)
        hi = np.where(searching & ~fits, mid - 1, hi)
    pass_clocks = np.full(len(passes), float(requested_mhz))
    pass_clocks[over] = clocks[best]
    capped = physics.time_passes(gpu, passes, pass_clocks)
    return OperatingPoint(int(capped.sm_clock_mhz), True, capped)


def passes_of(n: int, batch: int, context: float, tp: int = 1) -> Passes:
    """A prefill-like or decode-like run of `n` passes whose work grows along it."""
    builder = PassBuilder(tp)
    tokens = np.full(n, float(batch)) * np.linspace(1.0, 3.0, n)
    ctx = np.full(n, context) + np.arange(n)
    builder.add(
        LLAMA8B,
        tokens,
        LLAMA8B.kv_bytes_read(ctx) * batch,
        LLAMA8B.attention_flops_per_token(ctx) * tokens,
        tokens,
    )
    return builder.parts[0]


def assert_same_point(got: OperatingPoint, want: OperatingPoint) -> None:
    assert (got.sm_clock_mhz, got.power_capped) == (want.sm_clock_mhz, want.power_capped)
    for name in ("duration_s", "power_w", "tensor_util", "memory_util", "pass_clocks_mhz"):
        assert np.array_equal(getattr(got.timing, name), getattr(want.timing, name)), name
    assert got.timing.sm_clock_mhz == want.timing.sm_clock_mhz


@settings(max_examples=80, deadline=None)
@given(
    gpu_key=st.sampled_from(GPUS),
    n=st.integers(1, 200),
    batch=st.integers(1, 512),
    context=st.floats(16, 8192),
    tp=st.sampled_from([1, 2, 8]),
    requested_share=st.floats(0.0, 1.0),
    limit_w=st.floats(40.0, 1000.0),
    table_max=st.sampled_from([0, 64, physics.CAP_TABLE_MAX, 10**9]),
)
def test_the_cap_search_finds_what_the_replaced_bisection_found(
    gpu_key, n, batch, context, tp, requested_share, limit_w, table_max
) -> None:
    """Through the table (every pass at every clock, one timing) or the halvings alone, with
    or without the shortcut for passes whose fit ends at one clock: the same clocks."""
    gpu = gpu_profile(gpu_key)
    clocks = sorted(gpu.supported_sm_clocks_mhz())
    requested = clocks[round(requested_share * (len(clocks) - 1))]
    passes = passes_of(n, batch, context, tp)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(physics, "CAP_TABLE_MAX", table_max)
        physics._remembered_cap.cache_clear()  # searched afresh at this table size
        got = physics.operating_point(gpu, passes, requested, limit_w)
    assert_same_point(got, replaced_operating_point(gpu, passes, requested, limit_w))


def test_a_pass_whose_fit_is_not_one_run_of_clocks_is_bisected_as_before(monkeypatch) -> None:
    """Were a pass's power not to rise with the clock, the table is read by the same halvings
    (the shortcut only takes passes that fit up to one clock and not above). The bump goes into
    `_timed`, which every timing goes through (the search's own included); the short phase's
    remembered point is forgotten so that each table size searches afresh."""
    gpu = gpu_profile("h100-sxm")
    passes = passes_of(3, 64, 1500.0)
    limit = float(physics.time_passes(gpu, passes, 1500).power_w.max())
    real = physics._timed

    def bumpy(g, p, clocks):  # every third clock index draws 1 kW more
        f, per_pass, duration_s, power_w, tensor, memory, at = real(g, p, clocks)
        if per_pass is not None:
            power_w = power_w + (per_pass // g.sm_clock_step_mhz % 3 == 0) * 1000.0
        return f, per_pass, duration_s, power_w, tensor, memory, at

    monkeypatch.setattr(physics, "_timed", bumpy)
    try:
        for table_max in (0, 10**9):
            monkeypatch.setattr(physics, "CAP_TABLE_MAX", table_max)
            physics._remembered_cap.cache_clear()
            got = physics.operating_point(gpu, passes, 1980, limit)
            assert_same_point(got, replaced_operating_point(gpu, passes, 1980, limit))
    finally:
        physics._remembered_cap.cache_clear()  # nothing bumped outlives the test


def test_no_clock_at_or_below_the_request_is_refused_as_before() -> None:
    gpu = gpu_profile("h100-sxm")
    passes = passes_of(4, 64, 1500.0)
    with pytest.raises(ValueError, match="no supported SM clock"):
        physics.operating_point(gpu, passes, min(gpu.supported_sm_clocks_mhz()) - 1, 1.0)


@pytest.mark.parametrize("limit_w", [700.0, 400.0, 150.0])
def test_a_remembered_schedule_is_the_schedule_computed_afresh(limit_w) -> None:
    gpu = gpu_profile("h100-sxm")
    phases = (passes_of(1, 2048, 16.0), passes_of(300, 64, 1500.0), passes_of(40, 8, 3000.0))
    first = physics.schedule(gpu, phases, 1980, limit_w)
    again = physics.schedule(gpu, phases, 1980, limit_w)
    assert again is first  # remembered
    fresh = physics._remembered_schedule.__wrapped__(gpu, phases, 1980, limit_w)
    assert len(first.points) == len(fresh.points)
    for got, want in zip(first.points, fresh.points, strict=True):
        assert_same_point(got, want)
    for got, want in zip(
        first.points,
        (replaced_operating_point(gpu, p, 1980, limit_w) for p in phases),
        strict=True,
    ):
        assert_same_point(got, want)
    assert np.array_equal(first.ends_ns, fresh.ends_ns)
    other = physics.schedule(gpu, phases, 1980, limit_w - 5.0)
    assert other is not first


@pytest.mark.parametrize("limits_w", [(400.0,), (400.0, 395.0, 390.0), (300.0, 400.0)])
def test_a_round_searched_down_the_clocks_finds_what_the_replaced_bisection_found(
    limits_w,
) -> None:
    """One round (the same passes) searched at each clock down from the top, as a sweep does,
    under one limit or a few (the leakage's steps): the table kept from a higher clock is read
    where it covers the passes over the limit, and every point is the one the replaced
    bisection finds."""
    gpu = gpu_profile("h100-sxm")
    passes = passes_of(40, 256, 1500.0)  # 40 passes x 86 clocks: one table
    tables: list[np.ndarray] = []  # each table timed (kept alive: told apart by identity)
    capped = 0
    for requested in range(1980, 704, -75):
        for limit_w in limits_w:
            got = physics.operating_point(gpu, passes, requested, limit_w)
            assert_same_point(got, replaced_operating_point(gpu, passes, requested, limit_w))
            capped += got.power_capped
            known = passes.__dict__.get(physics._POWER_TABLE)
            if known is not None and not any(t is known[3] for t in tables):
                tables.append(known[3])
    assert capped > 3
    assert 0 < len(tables) < 4  # timed at the top (and where a lower limit makes more hot)


def test_a_short_phase_under_limits_a_warm_die_leaves_finds_its_remembered_points() -> None:
    """A short phase's capped points are remembered by the clocks the search gives it, not by
    the limit: the limit a warm die leaves differs a little at every run, and a limit a little
    off finds the point the same clocks gave (the same object), equal to the replaced
    bisection's at that limit; a limit that changes the clocks finds another."""
    gpu = gpu_profile("h100-sxm")
    phase = passes_of(4, 2048, 16.0)
    physics._remembered_cap.cache_clear()
    try:
        peak = float(physics.time_passes(gpu, phase, 1980).power_w.max())
        first = physics.operating_point(gpu, fresh_copy(phase), 1980, peak - 60.0)
        assert first.power_capped
        found = 0
        for limit_w in (peak - 60.0 + 1e-6, peak - 60.0 - 1e-6):
            got = physics.operating_point(gpu, fresh_copy(phase), 1980, limit_w)
            assert_same_point(got, replaced_operating_point(gpu, phase, 1980, limit_w))
            if np.array_equal(got.timing.pass_clocks_mhz, first.timing.pass_clocks_mhz):
                assert got is first  # the same content, the same clocks: remembered
                found += 1
        assert found
        lower = physics.operating_point(gpu, fresh_copy(phase), 1980, peak - 250.0)
        assert_same_point(lower, replaced_operating_point(gpu, phase, 1980, peak - 250.0))
        assert not np.array_equal(lower.timing.pass_clocks_mhz, first.timing.pass_clocks_mhz)
    finally:
        physics._remembered_cap.cache_clear()


def fresh_copy(passes: Passes) -> Passes:
    """The same passes as a new sequence: nothing remembered with it."""
    return Passes(*(getattr(passes, f).copy() for f in Passes.__dataclass_fields__))


def assert_same_timing(got: PassTiming, want: PassTiming) -> None:
    assert got.sm_clock_mhz == want.sm_clock_mhz
    for name in ("duration_s", "power_w", "tensor_util", "memory_util", "pass_clocks_mhz"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 60),
    batch=st.sampled_from([1, 8, 64, 256]),
    clocks=st.lists(st.sampled_from([1980, 1755, 1410, 1005, 705]), min_size=1, max_size=4),
    limits_w=st.lists(st.sampled_from([700.0, 400.0, 250.0]), min_size=1, max_size=3),
)
def test_a_sweeps_schedules_from_remembered_timings_are_those_computed_afresh(
    n, batch, clocks, limits_w
) -> None:
    """A round scheduled at each clock under one limit, then at each again under the next
    (as a sweep does): every schedule's timing at the requested clock, read back from the one
    kept for the passes, and every point made from it, are those computed afresh (the same
    bits)."""
    gpu = gpu_profile("h100-sxm")
    phases = (passes_of(n, batch, 1500.0),)
    for limit_w in limits_w:
        for requested in clocks:
            got = physics._requested_timing(gpu, phases[0], requested)
            assert_same_timing(got, physics.time_passes(gpu, fresh_copy(phases[0]), requested))
            assert not got.power_w.flags.writeable  # shared by the schedules made from it
            made = physics._remembered_schedule.__wrapped__(gpu, phases, requested, limit_w)
            want = replaced_operating_point(gpu, fresh_copy(phases[0]), requested, limit_w)
            assert_same_point(made.points[0], want)
            assert made.power_capped == want.power_capped
            if not made.power_capped:  # no pass over the limit: the requested timing itself
                assert made.joined is not None
                assert_same_timing(made.joined, want.timing)
                assert made.joined.sm_clock_mhz == requested
                assert made.points[0].sm_clock_mhz == requested
    again = physics._requested_timing(gpu, phases[0], clocks[0])  # read back
    assert_same_timing(again, physics.time_passes(gpu, fresh_copy(phases[0]), clocks[0]))


def test_the_remembered_timings_stay_within_their_bytes(monkeypatch) -> None:
    """The timings kept at the requested clocks hold at most `REQUESTED_TIMINGS_BYTES`: the
    oldest go (from their passes too), and one asked for again is timed again, the same."""
    gpu = gpu_profile("h100-sxm")
    rounds = [passes_of(100, 8, 1000.0 + i) for i in range(6)]
    one = 2 * 100 * 8  # a timing's durations and powers, 100 floats each
    monkeypatch.setattr(physics, "_KEPT", collections.deque())  # none kept from other tests
    monkeypatch.setattr(physics, "_KEPT_SIZE", [0])
    monkeypatch.setattr(physics, "REQUESTED_TIMINGS_BYTES", 3 * one)
    first = [physics._requested_timing(gpu, p, 1980) for p in rounds]
    assert physics._KEPT_SIZE[0] <= physics.REQUESTED_TIMINGS_BYTES
    kept = [p.__dict__[physics._REQUESTED].get((gpu, 1980)) for p in rounds]
    assert [k is not None and k[0] is t.duration_s for k, t in zip(kept, first, strict=True)] == [
        False
    ] * 3 + [True] * 3
    again = physics._requested_timing(gpu, rounds[-1], 1980)  # kept
    assert again.duration_s is first[-1].duration_s and again.power_w is first[-1].power_w
    assert_same_timing(again, first[-1])
    again = physics._requested_timing(gpu, rounds[0], 1980)  # gone: timed again
    assert again.duration_s is not first[0].duration_s
    assert_same_timing(again, first[0])
    assert physics._KEPT_SIZE[0] <= physics.REQUESTED_TIMINGS_BYTES
