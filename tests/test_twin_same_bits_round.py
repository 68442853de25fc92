"""The twin's round, faster, gives the same numbers as the code it replaced (issue 15): each
reference here is the plain expression the twin evaluated before, compared exactly."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.twin import physics
from dvfs.twin.profiles import gpu_profile

H100 = gpu_profile("h100-sxm")
H200 = gpu_profile("h200-sxm")


def reference_main_clock(clocks: np.ndarray, duration_s: np.ndarray) -> float:
    """The clock passes spend the most time at (the highest on a tie), through `np.unique`."""
    if len(clocks) == 0:
        return 0.0
    values, where = np.unique(clocks, return_inverse=True)
    time_at = np.bincount(where, weights=duration_s, minlength=len(values))
    return float(values[len(values) - 1 - int(np.argmax(time_at[::-1]))])


@settings(max_examples=80, deadline=None)
@given(
    profile=st.sampled_from([H100, H200]),
    n=st.integers(0, 600),
    used=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    tie=st.booleans(),
)
def test_the_main_clock_of_supported_clocks_is_the_sorted_ones(profile, n, used, seed, tie) -> None:
    """Found from where each pass's clock is in the GPU's table: the same clock as sorting
    the passes' clocks finds, ties (equal sums) included."""
    rng = np.random.default_rng(seed)
    supported = np.array(profile.supported_sm_clocks_mhz(), dtype=float)
    clocks = rng.choice(rng.choice(supported, size=used), size=n)
    duration_s = rng.uniform(1e-5, 1e-2, size=n)
    if tie and n:
        duration_s[:] = 1e-3  # whole equal durations: equal counts tie exactly
    timing = physics.time_passes(profile, passes_of(n, seed), clocks)
    assert timing.sm_clock_mhz == reference_main_clock(clocks, timing.duration_s)
    _, _, at = physics._clocks_lookup(profile, clocks)
    assert at is not None
    got = physics._main_known(profile, at, duration_s)
    assert got == reference_main_clock(clocks, duration_s)


def test_a_clock_off_the_table_is_still_sorted_out() -> None:
    clocks = np.array([1980.0, 1000.5, 1000.5, 1980.0, 1000.5])
    timing = physics.time_passes(H100, passes_of(5, 3), clocks)
    assert timing.sm_clock_mhz == reference_main_clock(clocks, timing.duration_s)
    assert physics._clocks_lookup(H100, clocks)[2] is None


def passes_of(n: int, seed: int) -> physics.Passes:
    """`n` passes of assorted work."""
    rng = np.random.default_rng(seed)
    return physics.Passes(
        flops=rng.uniform(1e9, 1e13, size=n),
        bytes=rng.uniform(1e6, 2e10, size=n),
        layers=np.full(n, 32.0),
        comm_bytes=np.zeros(n),
        comm_calls=np.zeros(n),
        tokens=rng.integers(1, 512, size=n).astype(float),
    )


def test_a_replaced_timeline_is_freed_at_once_without_the_cyclic_collector() -> None:
    """A device's timeline (its counter, tail and work) is no reference cycle: replaced by the
    next start, reference counting frees it, so a sweep leaves no cyclic garbage per round."""
    import gc
    import weakref

    from dvfs.clock import VirtualClock
    from dvfs.twin.device import TwinDevice, TwinNode

    clock = VirtualClock(10**12)
    device = TwinDevice(H100, clock, 0)
    node = TwinNode([device])
    node.execute(passes_of(40, 7))
    first = device.timeline
    assert first.counter is not None  # the shipped profile's counter steps (the trap is on)
    gone = weakref.ref(first)
    del first
    enabled = gc.isenabled()
    gc.disable()
    try:
        clock.sleep(1.0)
        node.execute(passes_of(40, 8))
        assert gone() is None
    finally:
        if enabled:
            gc.enable()
