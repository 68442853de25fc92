"""The counter's remembered line fits: a fit found again is the fit made anew, to the bit, and
the memory stays bounded."""

from __future__ import annotations

import struct

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.measure import counter


def bits(pair: tuple[float, float]) -> bytes:
    return struct.pack("<2d", *pair)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 300), min_size=2, max_size=40, unique=True),
    st.floats(1e6, 2e8),
    st.floats(0, 5e6),
    st.integers(0, 2**32 - 1),
)
def test_remembered_fit_is_the_fit_made_anew(steps, period_ns, jitter_ns, seed) -> None:
    x = np.array(sorted(steps), dtype=float)
    y = x * period_ns + np.random.default_rng(seed).uniform(-jitter_ns, jitter_ns + 1, len(x))
    first = counter._line_fit(x, y)
    again = counter._line_fit(x.copy(), y.copy())  # equal inputs, other arrays
    fresh = counter._fit_line(x, y)
    assert bits(first) == bits(again) == bits(fresh)
    slope, intercept = np.polyfit(x, y, 1)
    assert bits(first) == bits((float(slope), float(intercept)))


def test_fits_differ_when_inputs_differ_by_one_bit() -> None:
    x = np.arange(10, dtype=float)
    y = x * 1e8
    z = y.copy()
    z[3] = np.nextafter(z[3], np.inf)
    assert counter._line_fit(x, y) == counter._fit_line(x, y)
    assert counter._line_fit(x, z) == counter._fit_line(x, z)


def test_memory_is_bounded() -> None:
    x = np.arange(5, dtype=float)
    for i in range(counter._FITS_SIZE + 50):
        counter._line_fit(x, x * (1e6 + i))
    assert len(counter._FITS) <= counter._FITS_SIZE
