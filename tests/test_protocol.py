"""The measurement protocol: windows on the energy counter's updates, the counter's period,
the precision a cell stops at, and the campaign keys that set them.

The window arithmetic is tested on hand-built readings of a stepping counter (exact ground
truth: constant power, steady tokens), and end to end on the twin.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import SMALL_CAMPAIGN, replace_block
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.measure.counter import (
    TokenCurve,
    counter_window,
    length_uncertainty,
    relative_half_width,
    round_energy,
    update_period_s,
    updates,
)

MS = 1_000_000


def stepping_readings(
    *,
    power_w: float,
    period_ms: float,
    phase_ms: float,
    sample_ms: float,
    duration_ms: float,
    start_ms: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Readings every `sample_ms` of a counter that updates at phase + k * period to the
    true energy (mJ) of a constant power since t = 0."""
    t = np.arange(start_ms, start_ms + duration_ms, sample_ms) * MS
    t = t.astype(np.int64)
    k = np.floor((t / MS - phase_ms) / period_ms)
    last_update_ms = phase_ms + k * period_ms
    value = np.floor(np.maximum(last_update_ms, 0.0) * power_w)  # mJ, truncated as NVML's
    return t, value


def samples_of(t: np.ndarray, value: np.ndarray) -> dict[str, np.ndarray]:
    return {
        "t_ns": t,
        "energy_mj": value,
        "gpu_energy_t_ns": t.reshape(-1, 1),
        "gpu_energy_mj": value.reshape(-1, 1),
    }


def steady_tokens(step_ms: float, tokens_per_step: int, until_ms: float) -> TokenCurve:
    """A decode producing `tokens_per_step` every `step_ms` from t = 0."""
    chunk = (np.arange(1, int(until_ms / step_ms) + 1) * step_ms * MS).astype(np.int64)
    return TokenCurve.of([chunk], [np.full(len(chunk), tokens_per_step)])


# -- updates and the period ------------------------------------------------------------------


def test_a_stepping_counter_shows_one_update_per_period_and_its_period():
    t, v = stepping_readings(
        power_w=300, period_ms=100, phase_ms=37, sample_ms=20, duration_ms=2000
    )
    seen = updates(t, v)
    # updates at 37, 137, ... 1937 ms, each seen once however many readings fall in a period
    assert len(seen) == 20
    assert np.all((seen.lo_ns < seen.t_ns) & (seen.t_ns <= seen.hi_ns))
    assert update_period_s(t, v) == pytest.approx(0.1, abs=0.02)


def test_a_regular_counter_is_pinned_well_inside_its_brackets():
    t, v = stepping_readings(
        power_w=300, period_ms=100, phase_ms=37.3, sample_ms=7, duration_ms=3000
    )
    fitted = updates(t, v, period_s=0.1)
    truth = (37.3 + 100 * np.arange(0, 30)) * MS
    assert len(fitted) == len(truth)
    # the middles are off by up to half a bracket (3.5 ms); the grid by far less
    assert np.max(np.abs(fitted.t_ns - truth)) < 1 * MS
    middles = updates(t, v)
    assert np.max(np.abs(middles.t_ns - truth)) > 2 * MS


def test_an_irregular_counter_keeps_the_middles():
    t = np.arange(0, 2000, 10, dtype=np.int64) * MS
    instants = np.array([50, 130, 260, 330, 480, 530, 700, 760, 950, 990, 1200]) * MS
    v = np.searchsorted(instants, t, side="right").astype(float) * 100
    seen = updates(t, v, period_s=0.1)
    assert np.array_equal(seen.t_ns, (seen.lo_ns + seen.hi_ns) / 2)


def test_too_few_updates_give_no_period():
    t = np.arange(0, 500, 20, dtype=np.int64) * MS
    v = np.where(t > 250 * MS, 10.0, 0.0)
    assert update_period_s(t, v) is None


# -- windows on the updates ------------------------------------------------------------------


def test_energy_between_updates_has_no_step_error_where_interpolation_has():
    power_w, step_ms, batch = 400.0, 15.0, 8
    t, v = stepping_readings(
        power_w=power_w, period_ms=100, phase_ms=11, sample_ms=20, duration_ms=1400
    )
    curve = steady_tokens(step_ms, batch, 1400)
    window = (int(152 * MS), int(1277 * MS))  # arbitrary edges between updates
    truth = power_w * step_ms * 1e-3 / batch  # J per token
    on_updates = round_energy(samples_of(t, v), curve, window, [0.1])
    assert on_updates.on_updates
    assert on_updates.updates == 11
    assert on_updates.energy_per_token_j == pytest.approx(truth, rel=1e-3)
    # the old way: the counter interpolated at the window's edges
    e0, e1 = np.interp(window, t, v)
    old = (e1 - e0) / 1000 / curve.between(*window)
    assert abs(old / truth - 1) > 0.01


def test_a_window_shorter_than_two_updates_falls_back_and_says_so():
    t, v = stepping_readings(power_w=300, period_ms=100, phase_ms=0, sample_ms=20, duration_ms=600)
    curve = steady_tokens(10, 1, 600)
    r = round_energy(samples_of(t, v), curve, (int(210 * MS), int(290 * MS)), [0.1])
    assert not r.on_updates
    assert r.updates == 0
    assert counter_window(updates(t, v), int(210 * MS), int(290 * MS)).seconds == 0.0


def test_two_gpus_each_on_their_own_updates():
    power = (300.0, 500.0)
    readings = [
        stepping_readings(power_w=p, period_ms=100, phase_ms=ph, sample_ms=20, duration_ms=2000)
        for p, ph in zip(power, (13.0, 71.0), strict=True)
    ]
    t = readings[0][0]
    values = np.stack([r[1] for r in readings], axis=1)
    samples = {
        "t_ns": t,
        "energy_mj": values.sum(axis=1),
        "gpu_energy_t_ns": np.stack([t, t], axis=1),
        "gpu_energy_mj": values,
    }
    curve = steady_tokens(12, 4, 2000)
    r = round_energy(samples, curve, (int(100 * MS), int(1900 * MS)), [0.1, 0.1])
    truth = sum(power) * 12e-3 / 4
    assert r.energy_per_token_j == pytest.approx(truth, rel=2e-3)


@settings(max_examples=60, deadline=None)
@given(
    power_w=st.floats(50, 700),
    period_ms=st.sampled_from([20.0, 50.0, 100.0]),
    phase_frac=st.floats(0, 0.999),
    sample_ms=st.sampled_from([2.0, 5.0, 10.0]),
    step_ms=st.floats(5, 40),
    batch=st.integers(1, 64),
    start_ms=st.floats(100, 400),
    length_ms=st.floats(800, 3000),
)
def test_window_arithmetic_properties(
    power_w, period_ms, phase_frac, sample_ms, step_ms, batch, start_ms, length_ms
):
    """Between updates the counter's difference is the energy of the interval between the
    update instants; an estimated instant lies in its bracket; energy per token is off by no
    more than the length's stated uncertainty over the spanned time (plus the counter's mJ
    truncation)."""
    duration = start_ms + length_ms + 200
    t, v = stepping_readings(
        power_w=power_w,
        period_ms=period_ms,
        phase_ms=phase_frac * period_ms,
        sample_ms=sample_ms,
        duration_ms=duration,
    )
    seen = updates(t, v, period_s=period_ms / 1000)
    assert np.all((seen.lo_ns <= seen.t_ns) & (seen.t_ns <= seen.hi_ns))
    assert len(np.unique(seen.value_mj)) == len(seen)  # distinct updates, not samples
    window = (int(start_ms * MS), int((start_ms + length_ms) * MS))
    w = counter_window(seen, *window)
    inside = (seen.t_ns >= window[0]) & (seen.t_ns <= window[1])
    assert w.updates == int(inside.sum())
    if w.updates >= 2:
        assert window[0] <= w.start_ns < w.end_ns <= window[1]
    curve = steady_tokens(step_ms, batch, duration)
    r = round_energy(samples_of(t, v), curve, window, [period_ms / 1000])
    truth = power_w * step_ms * 1e-3 / batch
    if r.on_updates:
        span_ms = r.seconds * 1000
        assert r.uncertainty_s * 1000 <= sample_ms  # never worse than a bracket
        bound = r.uncertainty_s * 1000 / span_ms + 2 / (power_w * span_ms) + 1e-9
        assert abs(r.energy_per_token_j / truth - 1) <= bound
        assert length_uncertainty([r]) == pytest.approx(r.uncertainty_s / r.seconds)


# -- how many updates, and the interval --------------------------------------------------------


def test_an_irregular_counter_is_uncertain_by_its_edge_brackets():
    t = np.arange(0, 2000, 10, dtype=np.int64) * MS
    instants = np.array([50, 130, 260, 330, 480, 530, 700, 760, 950, 990, 1200]) * MS
    v = np.searchsorted(instants, t, side="right").astype(float) * 100
    w = counter_window(updates(t, v, period_s=0.1), 100 * MS, 1000 * MS)
    assert w.updates == 9  # 130 ... 990
    assert w.uncertainty_s == pytest.approx(0.010)  # half of each edge's 10 ms bracket


def test_no_window_on_the_updates_has_no_bounded_length():
    assert length_uncertainty([]) == math.inf


def test_relative_half_width():
    assert math.isnan(relative_half_width([1.0], 0.95))
    assert relative_half_width([2.0, 2.0, 2.0], 0.95) == 0.0
    a = relative_half_width([1.0, 1.1, 0.9, 1.05], 0.95)
    assert relative_half_width([10.0, 11.0, 9.0, 10.5], 0.95) == pytest.approx(a)
    assert relative_half_width([1.0, 1.1, 0.9, 1.05], 0.99) > a
    # t(0.975, 3) = 3.182; sd of (1, 1.1, 0.9, 1.05) = 0.0854; mean 1.0125
    assert a == pytest.approx(3.1824 * 0.085391 / 2 / 1.0125, rel=1e-3)


# -- the campaign keys -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "fragments"),
    [
        ("precision = 0", ("measurement.precision", "greater than 0")),
        ("precision = 1.5", ("measurement.precision", "1.5", "below 1")),
        ("confidence = 1.0", ("measurement.confidence", "between 0 and 1")),
        ("max_repeats = 1", ("measurement.max_repeats", "below repeats = 2")),
        ('mode = "sideways"', ("measurement.mode", "'sideways'", "per-level, in-flight")),
        ('settle = "soon"', ("measurement.settle", "'soon'", '"measured"')),
        ("settle = -1", ("measurement.settle", "at least 0")),
        ("thermal_slope_c_per_min = 0", ("measurement.thermal_slope_c_per_min", "greater than 0")),
        ("idle_per_setting = 1", ("measurement.idle_per_setting", "true or false")),
    ],
)
def test_protocol_keys_are_validated(tmp_path: Path, line: str, fragments: tuple[str, ...]) -> None:
    from dvfs.campaign import load_campaign
    from dvfs.errors import CampaignError

    text = replace_block(SMALL_CAMPAIGN, "idle_s = 1.0", f"idle_s = 1.0\n{line}")
    path = tmp_path / "c.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(CampaignError) as info:
        load_campaign(path)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_protocol_keys_default_and_enter_the_hash(tmp_path: Path) -> None:
    from dvfs.campaign import load_campaign

    def load(extra: str) -> Any:
        path = tmp_path / f"c{abs(hash(extra))}.toml"
        text = replace_block(SMALL_CAMPAIGN, "idle_s = 1.0", f"idle_s = 1.0\n{extra}")
        path.write_text(text, encoding="utf-8")
        return load_campaign(path)

    base = load("")
    m = base.measurement
    assert (m.precision, m.confidence, m.mode, m.settle) == (0.01, 0.95, "per-level", "measured")
    assert m.max_repeats == m.repeats == 2  # no adaptive repeats unless asked
    assert (m.thermal_slope_c_per_min, m.thermal_max_s, m.idle_per_setting) == (1.0, 120.0, True)
    assert load("settle = 0.5").measurement.settle == 0.5
    for extra in (
        "precision = 0.02",
        "confidence = 0.9",
        "max_repeats = 4",
        'mode = "in-flight"',
        "settle = 3",
        "thermal_slope_c_per_min = 2.0",
        "thermal_max_s = 0",
        "idle_per_setting = false",
    ):
        assert load(extra).hash != base.hash, extra
    assert load("precision = 0.01").hash == base.hash  # the default, spelt out
