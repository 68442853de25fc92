"""The counter's remembered grids: an update grid found again is the grid fitted anew, to the
bit, whatever the updates' absolute instants, the memory stays bounded, and threads sharing
them (a local fleet's workers) each get their grid."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from conftest import race
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.measure import counter


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def fresh_instants(lo: np.ndarray, hi: np.ndarray, period_s: float) -> tuple[np.ndarray, bool]:
    counter._GRIDS.clear()
    return counter._instants(lo, hi, period_s)


@settings(max_examples=200, deadline=None)
@given(
    # per update: (counter periods since the last, offset), drawn together
    st.lists(st.tuples(st.integers(1, 3), st.integers(0, 30_000_000)), min_size=3, max_size=40),
    st.integers(0, 40_000_000),
    st.integers(0, 10**12),
    st.integers(-(10**9), 10**9),
    st.sampled_from([0.1, 0.05, 0.1003]),
)
def test_remembered_grid_gives_the_instants_computed_anew(
    updates, width, start_ns, shift_ns, period_s
) -> None:
    periods, offsets = (np.array(column) for column in zip(*updates, strict=True))
    base = start_ns + np.cumsum(periods * 100_000_000) + offsets
    lo = base.astype(np.int64)
    hi = lo + width + 1
    for a, b in ((lo, hi), (lo + shift_ns, hi + shift_ns)):  # same offsets, other instants
        expected_t, expected_regular = fresh_instants(a, b, period_s)
        counter._instants(a, b, period_s)  # remembered now
        again_t, again_regular = counter._instants(a.copy(), b.copy(), period_s)
        assert again_regular == expected_regular
        assert same_bits(again_t, expected_t)
    counter._instants(lo, hi, period_s)
    shifted_t, shifted_regular = counter._instants(lo + shift_ns, hi + shift_ns, period_s)
    expected_t, expected_regular = fresh_instants(lo + shift_ns, hi + shift_ns, period_s)
    assert shifted_regular == expected_regular
    assert same_bits(shifted_t, expected_t)


def test_grid_is_the_fit_and_its_steps_are_read_only() -> None:
    since = np.array([0.0, 1e8 + 3, 2e8 - 7, 4e8 + 1])
    grid = counter._grid(since, 1e8)
    assert grid is not None
    steps, slope, intercept = grid
    fresh = counter._fit_grid(since, 1e8)
    assert fresh is not None
    assert same_bits(steps, fresh[0]) and (slope, intercept) == fresh[1:]
    assert not steps.flags.writeable
    assert counter._grid(since.copy(), 1e8) is grid
    assert counter._grid(since, 2e8) is not grid  # the period is part of the key
    # two updates in one period: no grid, remembered as such
    assert counter._grid(np.array([0.0, 1e8, 1.1e8, 3e8]), 1e8) is None


def test_memory_is_bounded() -> None:
    since = np.arange(5, dtype=float) * 1e8
    for i in range(counter._GRIDS_SIZE + 50):
        counter._grid(since + i * np.arange(5), 1e8)
    assert len(counter._GRIDS) <= counter._GRIDS_SIZE


def test_grids_remembered_by_threads_at_once_drop_each_oldest_once(monkeypatch) -> None:
    """A local fleet's workers measure in threads of one process and share the remembered
    grids: on real GPUs every round's updates fall at new offsets, so once the grids are full
    each round drops the oldest, and two threads dropping the same one at once raised KeyError
    in one (its worker lost, 'dvfs sweep --gpus 0,1' exiting 1). Threads switched as often as
    the interpreter allows, a few grids kept so that each new one drops the oldest: every
    thread gets the fit of its own offsets, none fails, the memory stays bounded."""
    monkeypatch.setattr(counter, "_GRIDS_SIZE", 4)
    counter._GRIDS.clear()

    def measure(seed: int) -> Callable[[], None]:
        rng = np.random.default_rng(seed)

        def one_round() -> None:
            since = np.arange(5) * 1e8 + rng.integers(0, 1000, 5)
            since -= since[0]  # new offsets each round, as a real GPU's
            grid = counter._grid(since, 1e8)
            assert grid is not None and grid[1] == pytest.approx(1e8, rel=1e-4)

        return one_round

    assert race(measure, 20_000) == []
    assert len(counter._GRIDS) <= 4
