"""NVML's measurement traps as the twin simulates them: each shows, each can be switched off.

The bounds below follow from the traps' definitions (counter period P = 100 ms, sampled window
w = 25 ms, 1-s average, thermal time constant tau ~ 20 s), not from a run of the code.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.twin import thermal as th
from dvfs.twin import traps
from dvfs.twin.counter import Sensor
from dvfs.twin.profiles import gpu_profile
from dvfs.twin.timeline import Timeline, Work, sensor_of, thermal_of

H100 = gpu_profile("h100-sxm")
H200 = gpu_profile("h200-sxm")
MS = 1_000_000
FOLD_NS = 10**12 + 12_345  # not on any update instant


def timeline(profile, dynamic_w, duration_ns, fold_ns=FOLD_NS, uuid="GPU-test") -> Timeline:
    """`profile`'s device at rest since long ago, running passes from `fold_ns`."""
    dynamic_w = np.asarray(dynamic_w, dtype=float)
    ends = fold_ns + np.cumsum(np.asarray(duration_ns, dtype=np.int64))
    starts = np.concatenate([[fold_ns], ends[:-1]]).astype(np.int64)
    n = len(dynamic_w)
    work = Work(starts, ends, dynamic_w, np.full(n, 1980), np.zeros(n, dtype=np.int64))
    return Timeline(
        profile,
        thermal_of(profile),
        sensor_of(profile, uuid),
        fold_ns,
        None,
        None,
        None,
        work,
        profile.idle_power_w,
        profile.idle_sm_clock_mhz,
        None,
    )


# -- the thermal model ------------------------------------------------------------------------
def euler(model: th.Thermal, t0_c: float, dynamic_w, duration_s, steps: int = 2000):
    """Reference: integrate C dT/dt = P - (T - T_amb) / R step by step, P with leakage."""
    temp, energy = t0_c, 0.0
    temps = [temp]
    for p, d in zip(dynamic_w, duration_s, strict=True):
        h = d / steps
        for _ in range(steps):
            power = p + model.leakage_w_per_c * (temp - model.reference_c)
            energy += power * h
            temp += h * (model.ambient_c + model.c_per_w * power - temp) / model.time_constant_s
        temps.append(temp)
    return np.array(temps), energy


@settings(max_examples=25, deadline=None)
@given(
    powers=st.lists(st.floats(50.0, 700.0), min_size=1, max_size=6),
    durations=st.lists(st.floats(0.01, 30.0), min_size=6, max_size=6),
    t0_c=st.floats(25.0, 85.0),
    leak=st.floats(0.0, 2.0),
)
def test_the_temperature_is_the_exact_solution_of_the_first_order_model(
    powers, durations, t0_c, leak
) -> None:
    model = dataclasses.replace(thermal_of(H100), leakage_w_per_c=leak)
    durations = durations[: len(powers)]
    temps = th.start_temperatures(model, t0_c, np.array(powers), np.array(durations))
    energy = th.segment_energy_j(model, temps[:-1], np.array(powers), np.array(durations)).sum()
    ref_temps, ref_energy = euler(model, t0_c, powers, durations)
    # Euler's error per step is O(h / tau): 30 s / 2000 steps against tau >= 20 s.
    np.testing.assert_allclose(temps, ref_temps, atol=0.02)
    assert energy == pytest.approx(ref_energy, rel=1e-3)


def test_a_long_schedule_is_solved_in_blocks_without_overflow() -> None:
    model = thermal_of(H100)
    n = 200_000  # 100,000 s: 5,000 time constants, many blocks
    temps = th.start_temperatures(model, 30.0, np.full(n, 400.0), np.full(n, 0.5))
    assert np.all(np.isfinite(temps))
    assert temps[-1] == pytest.approx(float(model.steady_c(400.0)), abs=1e-9)
    one = th.start_temperatures(model, 30.0, np.array([400.0, 75.0]), np.array([1e6, 1e6]))
    assert one[1] == pytest.approx(float(model.steady_c(400.0)))
    assert one[2] == pytest.approx(float(model.steady_c(75.0)))


def test_temperature_rises_towards_r_p_plus_ambient_under_load_and_cools_when_idle() -> None:
    profile = traps.without(H100, "leakage")  # without leakage the target is exactly R P + T_amb
    load_w = 600.0
    line = timeline(profile, [load_w] * 6, [20_000 * MS] * 6)  # two minutes of load
    t = FOLD_NS + np.arange(0, 240_001, 1000) * MS
    temp = line.readings(t).temperature_c
    loaded, idle = t <= FOLD_NS + 120_000 * MS, t > FOLD_NS + 120_000 * MS
    assert np.all(np.diff(temp[loaded]) > 0) and np.all(np.diff(temp[idle]) < 0)
    target = profile.ambient_c + profile.thermal_c_per_w * load_w
    tau = profile.thermal_time_constant_s
    start = profile.ambient_c + profile.thermal_c_per_w * profile.idle_power_w
    # After 20 s (one tau) it has covered 1 - 1/e of the way; after 120 s, all but e^-6.
    at_tau = temp[t == FOLD_NS + round(tau * 1000) * MS][0]
    assert at_tau == pytest.approx(target - (target - start) / np.e, abs=0.01)
    assert temp[loaded][-1] == pytest.approx(target, abs=(target - start) * np.exp(-6) + 1e-6)
    assert temp[-1] == pytest.approx(start, abs=(target - start) * np.exp(-6) + 1e-6)


def test_leakage_makes_the_same_work_cost_more_when_started_hot() -> None:
    model = thermal_of(H100)
    work_w, work_s = np.array([300.0] * 10), np.array([1.0] * 10)
    cold = th.start_temperatures(model, model.reference_c, work_w, work_s)
    hot = th.start_temperatures(model, 75.0, work_w, work_s)
    e_cold = th.segment_energy_j(model, cold[:-1], work_w, work_s).sum()
    e_hot = th.segment_energy_j(model, hot[:-1], work_w, work_s).sum()
    # k (75 - T_ref) tau' (1 - e^(-10/tau')) more: ~20 W over ~8 s of a 10-s run.
    extra = (
        model.leakage_w_per_c
        * (75.0 - model.reference_c)
        * model.tau_s
        * -np.expm1(-10.0 / model.tau_s)
    )
    assert e_hot - e_cold == pytest.approx(extra, rel=1e-9)
    assert e_hot > e_cold * 1.04
    flat = dataclasses.replace(model, leakage_w_per_c=0.0)
    e0 = th.segment_energy_j(flat, cold[:-1], work_w, work_s).sum()
    assert e0 == pytest.approx(th.segment_energy_j(flat, hot[:-1], work_w, work_s).sum(), rel=1e-12)


def test_a_runaway_thermal_model_is_refused() -> None:
    with pytest.raises(ValueError, match="runaway"):
        dataclasses.replace(thermal_of(H100), leakage_w_per_c=1.0 / H100.thermal_c_per_w)


# -- the energy counter -----------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    powers=st.lists(st.floats(80.0, 700.0), min_size=1, max_size=40),
    durations_ms=st.lists(st.integers(1, 400), min_size=40, max_size=40),
    probes=st.lists(st.integers(0, 20_000), min_size=2, max_size=60),
)
def test_the_counter_steps_at_its_period_and_never_decreases(powers, durations_ms, probes) -> None:
    line = timeline(H100, powers, np.array(durations_ms[: len(powers)]) * MS)
    sensor = line.sensor
    assert sensor is not None and sensor.period_ns == 100 * MS
    t = FOLD_NS + np.array(sorted(probes), dtype=np.int64) * MS
    energy = line.readings(t).energy_j
    assert np.all(np.diff(energy) >= 0)
    # Two instants between the same pair of updates read the same; across an update, more.
    k = sensor.index(t)
    same = np.diff(k) == 0
    assert np.all(np.diff(energy)[same] == 0)
    assert np.all(np.diff(energy)[~same] > 0)


def test_the_counter_holds_the_true_integral_of_its_last_update_when_it_sees_all_the_time() -> None:
    profile = traps.without(H100, "part_time_power")
    line = timeline(profile, [600.0, 90.0, 300.0] * 50, [7 * MS, 13 * MS, 31 * MS] * 50)
    sensor = line.sensor
    assert sensor is not None
    t = FOLD_NS + np.arange(0, 10_000, 3, dtype=np.int64) * MS
    updates = sensor.instant_ns(sensor.index(t))
    t = t[updates >= FOLD_NS]  # the truth before the device started is not kept
    updates = updates[updates >= FOLD_NS]
    readings = line.readings(t)
    truth_then = line.readings(updates).true_energy_j
    np.testing.assert_allclose(readings.energy_j, truth_then, rtol=1e-12)
    assert np.any(readings.energy_j < readings.true_energy_j)  # it lags between updates


def test_a_steady_load_is_counted_right_and_a_bursty_one_is_not() -> None:
    sensor = sensor_of(H100, "GPU-test")
    assert sensor is not None
    # Start on an update instant, so the bursts stay locked to the sensor's windows.
    fold = int(sensor.instant_ns(np.array(10_000)))
    window = (fold + 1_000 * MS, fold + 9_000 * MS)  # 80 updates, each window on an update
    steady = timeline(H100, [400.0] * 1000, [10 * MS] * 1000, fold_ns=fold)
    r = steady.readings(np.array(window))
    counted, truth = np.diff(r.energy_j)[0], np.diff(r.true_energy_j)[0]
    # Only leakage's slow rise moves power within a period: well under 0.1%.
    assert counted == pytest.approx(truth, rel=1e-3)
    # 5 ms high, 5 ms low: the 25-ms sampled window ends on a low and sees three lows and
    # two highs, 40% high where the truth is 50%.
    high, low = 650.0, 150.0
    bursty = timeline(H100, [high, low] * 1000, [5 * MS] * 2000, fold_ns=fold)
    r = bursty.readings(np.array(window))
    counted, truth = np.diff(r.energy_j)[0], np.diff(r.true_energy_j)[0]
    seconds = 8.0
    assert truth == pytest.approx((high + low) / 2 * seconds, rel=0.02)
    assert counted == pytest.approx((0.4 * high + 0.6 * low) * seconds, rel=0.02)
    assert counted < truth * 0.92
    # The same bursts counted the whole time (part-time sampling off) come out right.
    full = timeline(
        traps.without(H100, "part_time_power"), [high, low] * 1000, [5 * MS] * 2000, fold_ns=fold
    )
    r = full.readings(np.array(window))
    assert np.diff(r.energy_j)[0] == pytest.approx(np.diff(r.true_energy_j)[0], rel=1e-9)


def test_the_one_second_average_lags_a_step_while_the_instant_reading_does_not() -> None:
    line = timeline(H100, [100.0, 600.0], [3_000 * MS, 3_000 * MS])
    step = FOLD_NS + 3_000 * MS
    t = step + np.array([-1, 1, 200, 500, 900, 1_200, 1_500], dtype=np.int64) * MS
    r = line.readings(t)
    assert r.power_w[0] < 120 and r.power_w[1] > 590  # the instant field follows at once
    assert r.power_average_w[1] < 120  # the average has not seen it yet
    assert r.power_average_w[2] < r.power_average_w[3] < r.power_average_w[4] < 590
    assert r.power_average_w[5] == pytest.approx(r.power_w[5], rel=0.01)
    off = timeline(traps.without(H100, "power_average"), [100.0, 600.0], [3_000 * MS] * 2)
    r = off.readings(t)
    np.testing.assert_array_equal(r.power_average_w, r.power_w)


def test_a_sensor_must_sample_inside_its_period() -> None:
    with pytest.raises(ValueError):
        Sensor(period_ns=100 * MS, sampled_ns=200 * MS, phase_ns=0, average_n=10)
    with pytest.raises(ValueError):
        Sensor(period_ns=100 * MS, sampled_ns=25 * MS, phase_ns=100 * MS, average_n=10)


def test_counters_of_two_devices_update_at_different_instants() -> None:
    a, b = sensor_of(H100, "GPU-a"), sensor_of(H100, "GPU-b")
    assert a is not None and b is not None and a.phase_ns != b.phase_ns


# -- switches ---------------------------------------------------------------------------------
def test_the_shipped_profiles_simulate_every_trap_and_each_switches_off() -> None:
    for profile in (H100, H200):
        assert traps.active(profile) == tuple(traps.TRAPS)
        for name in traps.TRAPS:
            assert name not in traps.active(traps.without(profile, name))
            assert traps.active(traps.only(profile, name)) == (name,)
        assert traps.active(traps.without(profile)) == ()
    with pytest.raises(ValueError, match="unknown trap"):
        traps.without(H100, "gremlins")
