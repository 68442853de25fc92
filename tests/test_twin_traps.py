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

from dvfs.clock import VirtualClock
from dvfs.gpu.twin import TwinGpu
from dvfs.twin import physics, traps
from dvfs.twin import thermal as th
from dvfs.twin.counter import Sensor
from dvfs.twin.device import TwinDevice, TwinNode
from dvfs.twin.profiles import gpu_profile
from dvfs.twin.timeline import Timeline, Work, sensor_of, thermal_of
from tests.test_twin_physics import decode_passes

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
    # per segment: (power, duration), drawn together
    segments=st.lists(
        st.tuples(st.floats(50.0, 700.0), st.floats(0.01, 30.0)), min_size=1, max_size=6
    ),
    t0_c=st.floats(25.0, 85.0),
    leak=st.floats(0.0, 2.0),
)
def test_the_temperature_is_the_exact_solution_of_the_first_order_model(
    segments, t0_c, leak
) -> None:
    model = dataclasses.replace(thermal_of(H100), leakage_w_per_c=leak)
    powers, durations = ([s[i] for s in segments] for i in (0, 1))
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
    # per pass: (power, duration in ms), drawn together
    passes=st.lists(
        st.tuples(st.floats(80.0, 700.0), st.integers(1, 400)), min_size=1, max_size=40
    ),
    probes=st.lists(st.integers(0, 20_000), min_size=2, max_size=60),
)
def test_the_counter_steps_at_its_period_and_never_decreases(passes, probes) -> None:
    powers = [power for power, _ in passes]
    line = timeline(H100, powers, np.array([ms for _, ms in passes]) * MS)
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
        # every trap named to keep is the profile itself (it was every trap off)
        assert traps.only(profile, *traps.TRAPS) == profile
        assert gpu_profile(f"{profile.key}:{','.join(traps.TRAPS)}") == profile
    with pytest.raises(ValueError, match="unknown trap"):
        traps.without(H100, "gremlins")


@pytest.mark.parametrize(
    "key", ["h100-sxm:", "h100-sxm:-none", "h100-sxm: , ", "h100-sxm:none,-settle"]
)
def test_a_trap_list_that_names_no_trap_to_keep_or_drop_is_refused(key: str) -> None:
    """'KEY:' is no list, and '-none' drops no trap: neither is read as KEY (every trap) nor
    as 'none' (every trap off)."""
    from dvfs.errors import CampaignError

    with pytest.raises(CampaignError, match="after the colon name the traps"):
        gpu_profile(key)
    assert traps.active(gpu_profile("h100-sxm:none")) == ()
    assert traps.active(gpu_profile("h100-sxm:-settle")) == tuple(
        t for t in traps.TRAPS if t != "settle"
    )


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["h100-sxm", "h200-sxm"]),
    st.lists(st.sampled_from(list(traps.TRAPS)), unique=True),
)
def test_a_profile_with_any_traps_off_is_spelled_as_the_key_that_reads_back_as_it(
    key: str, kept: list[str]
) -> None:
    """A fit names its base profile in its file and on screen: a twin cube swept on
    `h100-sxm:none` was said fitted on base `h100-sxm` (every trap on). Each trap selection is
    spelled as a key `gpu_profile` reads back as the same profile; the shipped one as its key."""
    from dvfs.twin.profiles import spelled_key

    profile = traps.only(gpu_profile(key), *kept)
    spelled = spelled_key(profile)
    assert gpu_profile(spelled) == profile
    assert (spelled == key) == (set(kept) == set(traps.TRAPS))
    assert spelled_key(dataclasses.replace(profile, idle_power_w=1.0)) == key  # not a twin's own


# -- through the device and its Gpu, as the sampler and the meter see them ----------------------
def device(profile=H100, index: int = 0) -> tuple[VirtualClock, TwinDevice, TwinGpu]:
    clock = VirtualClock(10**12)
    d = TwinDevice(profile, clock, index)
    return clock, d, TwinGpu(d)


def load(batch: int, n: int) -> physics.Passes:
    return physics.Passes.concat([decode_passes(batch)] * n)


def test_idle_power_rises_with_the_locked_clock() -> None:
    powers = {}
    for locked in (None, 1005, 1500, 1980):
        clock, d, gpu = device()
        if locked is not None:
            gpu.lock_sm_clock(locked, locked)
        clock.sleep(1.0)
        powers[locked] = gpu.power_mw()
        assert gpu.sm_clock_mhz() == (locked or H100.idle_sm_clock_mhz)
    assert powers[None] == round(H100.idle_power_w * 1000)
    assert powers[None] < powers[1005] < powers[1500] < powers[1980]
    assert powers[1980] == pytest.approx(
        (H100.idle_power_w + H100.idle_clock_power_w) * 1000, rel=1e-3
    )
    clock, d, gpu = device(traps.without(H100, "idle_clock_power"))
    gpu.lock_sm_clock(1980, 1980)
    clock.sleep(1.0)
    assert gpu.power_mw() == round(H100.idle_power_w * 1000)


def test_a_clock_change_shows_after_the_settle_time_and_work_before_it_runs_at_the_old_clock() -> (
    None
):
    clock, d, gpu = device()
    gpu.lock_sm_clock(1980, 1980)
    clock.sleep(1.0)
    changed_ns = clock.now_ns()
    gpu.lock_sm_clock(1005, 1005)
    settle_ns = round(H100.settle_time_s * 1e9)
    t = changed_ns + np.linspace(0, settle_ns + 50 * MS, 200).astype(np.int64)
    seen = gpu.readings_at(t).sm_clock_mhz
    assert seen[0] == 1980  # the reading moves from the old clock
    assert seen.min() < 1005  # overshoots the new one
    assert np.all(seen[t >= changed_ns + settle_ns] == 1005)
    assert np.any(seen[t < changed_ns + settle_ns] != 1005)
    # Work started now runs at the old clock until the change has settled, then the new.
    schedule = TwinNode([d]).execute(load(8, 400))
    clocks = schedule.pass_clock_mhz
    assert clocks[0] == 1980 and clocks[-1] == 1005
    switch = int(np.argmax(clocks == 1005))
    assert schedule.ends_ns[switch - 1] >= settle_ns - schedule.ends_ns[0]
    assert (
        schedule.ends_ns[switch - 1] - round(schedule.timing.duration_s[switch - 1] * 1e9)
        < settle_ns
    )
    # Without the trap, the clock shows and the work runs at once.
    clock, d, gpu = device(traps.without(H100, "settle"))
    gpu.lock_sm_clock(1980, 1980)
    gpu.lock_sm_clock(1005, 1005)
    assert gpu.sm_clock_mhz() == 1005
    assert set(TwinNode([d]).execute(load(8, 400)).pass_clock_mhz.tolist()) == {1005}


def test_a_power_limit_takes_effect_after_the_settle_time() -> None:
    heavy = physics.Passes.concat([decode_passes(4096)] * 40)
    clock, d, gpu = device()
    gpu.set_power_limit_mw(300_000)
    early = TwinNode([d]).execute(heavy)
    assert not early.pass_capped[0] and early.pass_capped[-1]
    clock.sleep(early.timing.total_s + H100.settle_time_s)
    late = TwinNode([d]).execute(heavy)
    assert late.pass_capped.all()


@settings(max_examples=30, deadline=None)
@given(
    script=st.lists(
        st.tuples(
            st.sampled_from(["work", "lock", "limit", "reset", "sleep"]),
            st.integers(1, 400),
        ),
        min_size=1,
        max_size=12,
    ),
    sampled=st.booleans(),
)
def test_the_counter_stays_in_step_with_the_truth_across_work_and_knob_changes(
    script, sampled
) -> None:
    """Whatever the device does, its counter never decreases; seeing all the time, it holds
    the true energy of its last update exactly; seeing part of it, never far from it."""
    profile = H100 if sampled else traps.without(H100, "part_time_power")
    clock, d, gpu = device(profile)
    sensor = sensor_of(profile, d.uuid)
    assert sensor is not None
    probes: list[int] = []
    read: list[int] = []  # the counter as read live, across every fold
    fold_ns = clock.now_ns()  # the truth is kept from the last start or knob change on
    for action, n in script:
        if action != "sleep":
            fold_ns = clock.now_ns()
        if action == "work":
            TwinNode([d]).execute(load(1 + n % 64, n))
        elif action == "lock":
            gpu.lock_sm_clock(210 + 15 * (n % 119), 210 + 15 * (n % 119))
        elif action == "limit":
            gpu.set_power_limit_mw(200_000 + 1000 * n)
        elif action == "reset":
            gpu.reset_sm_clock()
        start = clock.now_ns()
        read.append(gpu.energy_mj())
        clock.sleep(n * 1e-3)
        read.append(gpu.energy_mj())
        probes.extend(np.linspace(start, clock.now_ns(), 7).astype(np.int64).tolist())
    assert all(b >= a for a, b in zip(read, read[1:], strict=False))
    t = np.array(probes, dtype=np.int64)
    t = t[t >= fold_ns]  # readings before the last fold are not kept
    r = d.readings_at(t)
    assert np.all(np.diff(r.energy_j) >= 0)
    updates = sensor.instant_ns(sensor.index(t))
    t, r = t[updates >= fold_ns], d.readings_at(t[updates >= fold_ns])
    updates = updates[updates >= fold_ns]
    truth = np.array([d.true_energy_j_at(int(u)) for u in updates])
    if not sampled:
        np.testing.assert_allclose(r.energy_j, truth, rtol=1e-9)
    else:  # mis-counted by at most the power's spread over the run (< 700 W) x 0.1 s a step
        steps = (updates - 10**12) / sensor.period_ns + 1
        assert np.all(np.abs(r.energy_j - truth) <= 700 * 0.1 * steps)
    energies = [gpu.energy_mj() for _ in range(2)]
    assert energies[0] == energies[1]


def test_leakage_makes_the_same_work_cost_more_on_a_hot_device() -> None:
    work = load(64, 3000)
    cold_clock, cold, _ = device()
    hot_clock, hot, _ = device()
    TwinNode([hot]).execute(physics.Passes.concat([decode_passes(4096)] * 2000))  # heat it
    hot_clock.sleep(60.0)
    assert hot.temperature_c() > cold.temperature_c() + 10
    costs = []
    for clock, d in ((cold_clock, cold), (hot_clock, hot)):
        before = d.true_energy_j()
        schedule = TwinNode([d]).execute(work)
        clock.sleep(schedule.timing.total_s)
        costs.append(d.true_energy_j() - before)
    assert costs[1] > costs[0] * 1.01
    flat = traps.without(H100, "leakage")
    costs = []
    for warm in (False, True):
        clock, d, _ = device(flat)
        if warm:
            TwinNode([d]).execute(physics.Passes.concat([decode_passes(4096)] * 2000))
            clock.sleep(60.0)
        before = d.true_energy_j()
        schedule = TwinNode([d]).execute(work)
        clock.sleep(schedule.timing.total_s)
        costs.append(d.true_energy_j() - before)
    assert costs[0] == pytest.approx(costs[1], rel=1e-12)


@pytest.mark.parametrize("trap", list(traps.TRAPS))
def test_each_trap_off_gives_the_exact_behaviour_it_replaces(trap) -> None:
    """With one trap off (the others on), the reading it distorted is exact again."""
    profile = traps.without(H100, trap)
    clock, d, gpu = device(profile)
    gpu.lock_sm_clock(1500, 1500)
    schedule = TwinNode([d]).execute(
        physics.Passes.concat([decode_passes(4096)] * 300 + [decode_passes(1)] * 3000)
    )
    start = clock.now_ns()
    t = start + np.linspace(0, schedule.ends_ns[-1] + 2_000 * MS, 500).astype(np.int64)
    r = d.readings_at(t)
    truth = np.array([d.true_energy_j_at(int(x)) for x in t])
    if trap == "energy_steps":
        np.testing.assert_allclose(r.energy_j, truth, rtol=1e-12)
    elif trap == "part_time_power":
        sensor = sensor_of(profile, d.uuid)
        assert sensor is not None
        u = sensor.instant_ns(sensor.index(t))
        keep = u >= start
        at_u = np.array([d.true_energy_j_at(int(x)) for x in u[keep]])
        np.testing.assert_allclose(r.energy_j[keep], at_u, rtol=1e-12)
    elif trap == "power_average":
        np.testing.assert_array_equal(r.power_average_w, r.power_w)
    elif trap == "thermal_lag":
        model = thermal_of(profile)
        dynamic = r.power_w - model.leakage_w_per_c * (r.temperature_c - model.reference_c)
        np.testing.assert_allclose(r.temperature_c, model.steady_c(dynamic), rtol=1e-9)
    elif trap == "leakage":
        busy = t < start + schedule.ends_ns[-1]
        i = np.searchsorted(start + schedule.ends_ns, t[busy], side="right")
        np.testing.assert_allclose(r.power_w[busy], schedule.timing.power_w[i], rtol=1e-12)
    elif trap == "idle_clock_power":
        idle = t > start + schedule.ends_ns[-1]
        model = thermal_of(profile)
        np.testing.assert_allclose(
            r.power_w[idle],
            model.power_w(H100.idle_power_w, r.temperature_c[idle]),
            rtol=1e-12,
        )
    else:
        assert schedule.pass_clock_mhz.tolist() == [1500] * len(schedule.pass_clock_mhz)
        assert r.sm_clock_mhz[0] == 1500


def test_every_trap_off_is_the_exact_twin() -> None:
    profile = traps.without(H100)
    clock, d, gpu = device(profile)
    gpu.set_power_limit_mw(400_000)
    schedule = TwinNode([d]).execute(
        physics.Passes.concat([decode_passes(4096)] * 100 + [decode_passes(8)] * 500)
    )
    start, start_j = clock.now_ns(), d.energy_j()
    ends = start + schedule.ends_ns
    t = start + np.linspace(0, schedule.ends_ns[-1] + 500 * MS, 300).astype(np.int64)
    r = d.readings_at(t)
    power = schedule.timing.power_w
    cum = np.concatenate(
        [[0.0], np.cumsum(power * np.diff(np.concatenate([[start], ends])) * 1e-9)]
    )
    i = np.searchsorted(ends, t, side="right")
    busy = i < len(ends)
    seg = np.concatenate([[start], ends[:-1]])
    want_power = np.where(busy, power[np.minimum(i, len(power) - 1)], H100.idle_power_w)
    want_j = np.where(
        busy,
        cum[np.minimum(i, len(power) - 1)]
        + want_power * (t - seg[np.minimum(i, len(power) - 1)]) * 1e-9,
        cum[-1] + H100.idle_power_w * (t - ends[-1]) * 1e-9,
    )
    np.testing.assert_allclose(r.power_w, want_power, rtol=1e-12)
    np.testing.assert_allclose(r.energy_j - start_j, want_j, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(r.temperature_c, H100.ambient_c + H100.thermal_c_per_w * want_power)
    np.testing.assert_array_equal(r.power_average_w, r.power_w)
    np.testing.assert_array_equal(r.energy_j, r.true_energy_j)


def test_the_readmes_one_place_that_maps_instants_to_readings_is_the_timeline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """README ("How it works") called `BulkReadable.readings_at` "the one place that maps
    instants to readings", a protocol method the sampler on the twin mostly bypasses: a tick due
    before a knob change is read through `TwinGpu.readings_of` from that past state. Both
    reads are answered by the device's `Timeline` (`twin/timeline.py`, whose docstring claims
    the role), which the README names now."""
    from pathlib import Path

    import dvfs.twin.timeline as timeline_module

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = " ".join(readme.split("\n## How it works\n", 1)[1].split("\n## ", 1)[0].split())
    role = "the one place that maps instants to readings"
    assert f"`twin/timeline.py`, {role}" in section
    assert role in " ".join((timeline_module.__doc__ or "").split())

    clock, _, gpu = device()
    before = gpu.reading_state()
    gpu.set_power_limit_mw(400_000)  # a knob change: the device's timeline is replaced
    now = gpu.reading_state()
    assert now is not before
    asked: list[object] = []
    reported = Timeline.reported

    def spy(self: Timeline, t_ns: np.ndarray) -> tuple[np.ndarray, ...]:
        asked.append(self)
        return reported(self, t_ns)

    monkeypatch.setattr(Timeline, "reported", spy)
    t_ns = clock.now_ns() + np.arange(1, 4, dtype=np.int64) * 100_000_000
    gpu.readings_at(t_ns)
    gpu.readings_of(before, t_ns)
    assert asked == [now, before]
