"""A timeline's segments and its counter's energy reads against the code they replaced (kept
here as it stood at 3c9bcb7): equal to the last bit, whatever the thermal constants."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.clock import VirtualClock
from dvfs.gpu.base import EVENT_SW_POWER_CAP
from dvfs.twin import thermal as th
from dvfs.twin import traps
from dvfs.twin.device import TwinDevice, TwinNode
from dvfs.twin.physics import OperatingPoint, Schedule, time_passes
from dvfs.twin.profiles import gpu_profile
from dvfs.twin.timeline import Work
from tests.test_speed_search import passes_of

H100 = gpu_profile("h100-sxm")


def replaced_segments(
    model: th.Thermal, t0_c: float, dynamic_w: np.ndarray, duration_s: np.ndarray, idle_w: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`Timeline.__init__`'s per-segment arrays at 3c9bcb7: steady temperature, settled power,
    start temperature, energy before each segment."""
    dynamic = np.append(dynamic_w, idle_w)
    steady = model.steady_c(dynamic)
    pass_steady = steady[:-1]
    start_c = th.start_temperatures(model, t0_c, dynamic_w, duration_s, pass_steady)
    per_pass = th.segment_energy_j(model, start_c[:-1], dynamic_w, duration_s, pass_steady)
    energy_before = np.concatenate([[0.0], np.cumsum(per_pass)])
    settled = dynamic + model.leakage_w_per_c * (steady - model.reference_c)
    return steady, settled, start_c, energy_before


thermals = st.builds(
    th.Thermal,
    ambient_c=st.floats(10.0, 40.0),
    c_per_w=st.floats(0.0, 0.2),
    time_constant_s=st.sampled_from([0.0, 0.5, 20.0, 60.0]),
    leakage_w_per_c=st.sampled_from([0.0, 0.3, 1.5]),
    reference_c=st.floats(20.0, 60.0),
).filter(lambda m: m.c_per_w * m.leakage_w_per_c < 0.9)


@settings(max_examples=120, deadline=None)
@given(
    model=thermals,
    t0_c=st.floats(20.0, 90.0),
    dynamic_w=st.lists(st.floats(50.0, 900.0), min_size=1, max_size=300),
    durations=st.lists(st.floats(1e-6, 40.0), min_size=1, max_size=300),
    idle_w=st.floats(40.0, 120.0),
)
def test_work_segments_are_the_replaced_steps(model, t0_c, dynamic_w, durations, idle_w) -> None:
    n = min(len(dynamic_w), len(durations))
    power, seconds = np.array(dynamic_w[:n]), np.array(durations[:n])
    got = th.work_segments(model, t0_c, power, seconds, idle_w)
    want = replaced_segments(model, t0_c, power, seconds, idle_w)
    for name, g, w in zip(("steady", "settled", "start", "energy"), got, want, strict=True):
        assert np.array_equal(g, w), name


@settings(max_examples=80, deadline=None)
@given(
    model=thermals,
    t0s_c=st.lists(st.floats(20.0, 90.0), min_size=1, max_size=4),
    dynamic_w=st.lists(st.floats(50.0, 900.0), min_size=1, max_size=300),
    durations=st.lists(st.floats(1e-6, 40.0), min_size=1, max_size=300),
    idle_w=st.floats(40.0, 120.0),
)
def test_segment_terms_made_once_give_every_start_temperature_the_same_bits(
    model, t0s_c, dynamic_w, durations, idle_w
) -> None:
    """A device makes the terms that do not depend on the start temperature once per schedule
    (a stabilising load runs one schedule again and again, from ever warmer dies): the
    segments from any start temperature are the replaced steps' to the bit, and the terms
    are not changed by their use (read-only)."""
    n = min(len(dynamic_w), len(durations))
    power, seconds = np.array(dynamic_w[:n]), np.array(durations[:n])
    terms = th.segment_terms(model, power, seconds, idle_w)
    for t0_c in t0s_c:
        got = th.work_segments(model, t0_c, power, seconds, idle_w, terms)
        want = replaced_segments(model, t0_c, power, seconds, idle_w)
        for name, g, w in zip(("steady", "settled", "start", "energy"), got, want, strict=True):
            assert np.array_equal(g, w), name


@settings(max_examples=40, deadline=None)
@given(
    clock_mhz=st.sampled_from([705, 1200, 1980]),
    n=st.integers(1, 200),
    batch=st.integers(1, 256),
    offsets_s=st.lists(st.floats(-1.0, 30.0), min_size=1, max_size=50),
)
def test_the_counters_energy_reads_are_the_truths(clock_mhz, n, batch, offsets_s) -> None:
    """`energy_since_fold_j` (what the counter's updates read) is `_truth`'s energy, during
    the work, after it and before the fold (clipped)."""
    clock = VirtualClock()
    device = TwinDevice(H100, clock, 0)
    clock.sleep(3.0)
    passes = passes_of(n, batch, 1500.0)
    device.start(
        Schedule((OperatingPoint(clock_mhz, False, time_passes(H100, passes, clock_mhz)),))
    )
    timeline = device.timeline
    t_ns = timeline.fold_ns + np.round(np.array(offsets_s) * 1e9).astype(np.int64)
    assert np.array_equal(timeline.energy_since_fold_j(t_ns), timeline._truth(t_ns)[4])


@settings(max_examples=40, deadline=None)
@given(
    exact=st.booleans(),
    clock_mhz=st.sampled_from([705, 1200, 1980]),
    n=st.integers(1, 200),
    batch=st.integers(1, 256),
    change_after_s=st.none() | st.floats(0.0, 2.0),
    offsets_s=st.lists(st.floats(-1.0, 30.0), min_size=1, max_size=50),
)
def test_what_a_gpu_reports_is_its_readings_to_the_bit(
    exact, clock_mhz, n, batch, change_after_s, offsets_s
) -> None:
    """`reported` (what the twin's GPU reads in bulk: the sampler's every round) is
    `readings`' counter, power, clock, temperature and reasons to the bit: with a stepped
    counter or an exact one, while a knob change settles, after the work and before the
    fold (clipped)."""
    profile = traps.without(H100) if exact else H100
    clock = VirtualClock()
    device = TwinDevice(profile, clock, 0)
    clock.sleep(3.0)
    passes = passes_of(n, batch, 1500.0)
    device.start(
        Schedule((OperatingPoint(clock_mhz, False, time_passes(profile, passes, clock_mhz)),))
    )
    if change_after_s is not None:  # a power cap mid-work: a new timeline, settling
        clock.sleep(change_after_s)
        device.power_limit_w = 300.0
    timeline = device.timeline
    t_ns = timeline.fold_ns + np.round(np.array(offsets_s) * 1e9).astype(np.int64)
    want = timeline.readings(t_ns)
    got = timeline.reported(t_ns)
    names = ("energy_j", "power_w", "sm_clock_mhz", "temperature_c", "reasons")
    for name, g in zip(names, got, strict=True):
        w = getattr(want, name)
        assert g.dtype == w.dtype and g.tobytes() == w.tobytes(), name


def replaced_work(schedule: Schedule, now: int) -> Work:
    """`TwinDevice.start`'s work at 3c9bcb7."""
    ends = now + schedule.ends_ns
    starts = np.concatenate([[now], ends[:-1]]).astype(np.int64)
    reasons = schedule.per_pass(
        [EVENT_SW_POWER_CAP if p.power_capped else 0 for p in schedule.points], np.int64
    )
    return Work(starts, ends, schedule.timing.power_w, schedule.pass_clock_mhz, reasons)


@pytest.mark.parametrize("limit_w", [700.0, 300.0])
@pytest.mark.parametrize("clock_mhz", [705, 1500, 1980])
def test_a_started_rounds_work_is_the_replaced_arrays(clock_mhz, limit_w) -> None:
    """Start times, clocks and event reasons per pass, for a schedule timed as one array (no
    pass capped), one with capped phases, and one split by a knob change still settling."""
    clock = VirtualClock()
    device = TwinDevice(H100, clock, 0)
    node = TwinNode([device])
    clock.sleep(3.0)
    phases = (passes_of(1, 2048, 16.0), passes_of(300, 64, 1500.0), passes_of(40, 8, 3000.0))
    for settling in (False, True):
        if settling:
            device.locked_mhz = (705, 705)
        device.locked_mhz, device.power_limit_w = (clock_mhz, clock_mhz), limit_w
        if not settling:
            clock.sleep(5.0)
        now = clock.now_ns()
        schedule = node.execute(*phases)
        got, want = device.timeline.work, replaced_work(schedule, now)
        assert got is not None
        for f in fields(Work):
            a, b = getattr(got, f.name), getattr(want, f.name)
            if f.name == "duration_s":  # made with the schedule: end less start, to the bit
                b = (got.ends_ns - got.starts_ns) * 1e-9
            if f.name == "terms":  # kept for a schedule started again, none at its first start
                assert b is None and (a is None or a.thermal is device.timeline.thermal)
                continue
            if f.name == "bounds_ns":  # the starts, then the last end, in one array
                assert b is None and a[-1] == got.ends_ns[-1]
                assert np.array_equal(a[:-1], got.starts_ns)
                continue
            assert a.dtype == b.dtype and np.array_equal(a, b), f.name
        clock.sleep(float(schedule.timing.total_s) + 1.0)
