"""Baselines: idle power at the current setting from a window of distinct energy-counter
updates (not samples), and thermal stabilisation by the temperature's fitted slope, against
scripted GPUs on virtual time (a stepping counter, idle power that rises with the locked
clock, a die that heats towards a steady temperature) and the twin."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.clock import VirtualClock
from dvfs.gpu.base import GpuIdentity, PowerLimitRange
from dvfs.gpu.knobs import KnobController, KnobSetting
from dvfs.measure.baseline import (
    idle_baseline,
    slope_window_s,
    stabilise,
    temperature_slope_c_per_min,
)


class IdleGpu:
    """An idle GPU on a virtual clock: power 60 W + 0.025 W/MHz of its clock (345 MHz
    unlocked), an energy counter that holds its value between updates every `counter_period_s`
    (phase `phase_s`), a temperature that follows `temperature(t_s)`."""

    def __init__(
        self,
        clock: VirtualClock,
        *,
        counter_period_s: float = 0.1,
        phase_s: float = 0.037,
        index: int = 0,
        temperature=lambda t_s: 40.0,
    ) -> None:
        self.clock = clock
        self.counter_period_s = counter_period_s
        self.phase_s = phase_s
        self.temperature = temperature
        self.lock: int | None = None
        self.limit_mw = 700_000
        self._energy_j = 0.0
        self._held_mj = 0
        self._since_s = clock.now_ns() / 1e9
        uuid = f"GPU-idle-{index}"
        self._identity = GpuIdentity(index, uuid, "idle", "0", "test", 0, 1980)

    @property
    def identity(self) -> GpuIdentity:
        return self._identity

    def watts(self) -> float:
        return 60.0 + 0.025 * (self.lock if self.lock is not None else 345)

    def _true_energy_j(self) -> float:
        return self._energy_j + self.watts() * (self.clock.now_ns() / 1e9 - self._since_s)

    def _fold(self) -> None:
        self._held_mj = self.energy_mj()
        self._energy_j = self._true_energy_j()
        self._since_s = self.clock.now_ns() / 1e9

    def supported_sm_clocks_mhz(self) -> tuple[int, ...]:
        return tuple(range(1980, 209, -15))

    def power_limit_range(self) -> PowerLimitRange:
        return PowerLimitRange(200_000, 700_000, 700_000)

    def power_limit_mw(self) -> int:
        return self.limit_mw

    def lock_sm_clock(self, min_mhz: int, max_mhz: int) -> None:
        self._fold()
        self.lock = max_mhz

    def reset_sm_clock(self) -> None:
        self._fold()
        self.lock = None

    def set_power_limit_mw(self, limit_mw: int) -> None:
        self.limit_mw = limit_mw

    def energy_mj(self) -> int:
        """The true energy at the counter's last update (the value it holds until the next)."""
        now_s = self.clock.now_ns() / 1e9
        if self.counter_period_s <= 0:
            return 5_000_000
        k = math.floor((now_s - self.phase_s) / self.counter_period_s)
        last_s = max(0.0, self.phase_s + k * self.counter_period_s)
        if last_s < self._since_s:
            return self._held_mj
        return int((self._energy_j + self.watts() * (last_s - self._since_s)) * 1000)

    def power_mw(self) -> int:
        return round(self.watts() * 1000)

    def sm_clock_mhz(self) -> int:
        return self.lock if self.lock is not None else 345

    def temperature_c(self) -> int:
        return round(self.temperature(self.clock.now_ns() / 1e9))


def test_idle_power_from_distinct_counter_updates() -> None:
    clock = VirtualClock()
    gpu = IdleGpu(clock, counter_period_s=0.1)
    result = idle_baseline([gpu], clock, min_s=1.0, sample_period_s=0.01, min_updates=10)
    assert result.enough and result.source == "energy counter"
    # exact up to the counter's mJ truncation over ~1 s
    assert result.power_w == pytest.approx(gpu.watts(), rel=1e-3)
    assert result.seconds >= 1.0
    # 100 samples a second but 10 updates: the count is of updates, not samples
    assert result.counter_updates == pytest.approx(result.seconds / 0.1 + 1, abs=1)
    assert result.gpu_time_s >= result.seconds


def test_a_known_counter_period_sizes_the_window() -> None:
    clock = VirtualClock()
    gpu = IdleGpu(clock, counter_period_s=0.1)
    result = idle_baseline(
        [gpu], clock, min_s=0.2, sample_period_s=0.01, counter_period_s=0.1, min_updates=25
    )
    assert result.enough and result.seconds >= 2.5 and result.counter_updates >= 25


def test_idle_baseline_rises_with_the_locked_clock() -> None:
    clock = VirtualClock()
    gpus = [IdleGpu(clock), IdleGpu(clock, index=1, phase_s=0.061)]
    baselines = {}
    with KnobController(gpus) as knobs:
        for mhz in (990, 1500, 1980):
            knobs.apply(KnobSetting(mhz, None))
            baselines[mhz] = idle_baseline(gpus, clock, min_s=1.0)
    for mhz, result in baselines.items():
        assert result.power_w == pytest.approx(2 * (60 + 0.025 * mhz), rel=1e-3)  # summed
    assert baselines[990].power_w < baselines[1500].power_w < baselines[1980].power_w


def test_a_slow_counter_is_reported_not_enough() -> None:
    clock = VirtualClock()
    gpu = IdleGpu(clock, counter_period_s=1.0)
    result = idle_baseline([gpu], clock, min_s=1.0, min_updates=10, max_s=3.0)
    assert not result.enough and result.counter_updates <= 4
    assert "counter updates" in result.note and result.gpu_time_s >= 3.0
    assert result.power_w == pytest.approx(gpu.watts(), rel=1e-3)  # still right, just short


def test_a_stuck_counter_falls_back_to_power_readings() -> None:
    clock = VirtualClock()
    gpu = IdleGpu(clock, counter_period_s=0.0)
    result = idle_baseline([gpu], clock, max_s=2.0)
    assert result.source == "power readings" and not result.enough
    assert result.power_w == pytest.approx(gpu.watts())
    assert "updated less than twice" in result.note


def test_idle_baseline_on_the_twin_is_cheap_and_counts_updates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the twin (virtual time) a baseline of several seconds waits on the virtual clock
    alone, never the wall clock (no real sleep: asserted as such, not as an elapsed time a
    loaded machine may exceed); its counter updates are distinct readings, however the twin
    steps them."""
    import time

    from dvfs.backends import twin_gpus

    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    clock = VirtualClock()
    gpus = twin_gpus("h100-sxm", [0], clock)
    result = idle_baseline(gpus, clock, min_s=2.0, sample_period_s=0.01)
    assert slept == []
    assert clock.now_ns() >= 2_000_000_000
    assert result.enough and result.seconds >= 2.0 and result.counter_updates >= 10
    assert 20 < result.power_w < 300


# -- thermal stabilisation --------------------------------------------------------------------


def _load(clock: VirtualClock, seconds: float = 2.0):
    return lambda: clock.sleep(seconds)


def test_stabilise_stops_when_the_slope_falls() -> None:
    clock = VirtualClock()
    gpu = IdleGpu(clock, temperature=lambda t: 80 - 50 * math.exp(-t / 20))
    result = stabilise([gpu], clock, run_load=_load(clock), slope_c_per_min=1.0, max_s=600)
    assert result.reached and result.start_c == 30
    # the exponential's slope is 150 e^(-t/20) C/min: under 1 C/min after 100 s, and the
    # fit over the last 60 s lags it by about half a window
    assert 100 <= result.seconds <= 200
    assert result.end_c >= 78 and abs(result.slope_c_per_min) < 1.0
    assert result.gpu_time_s == result.seconds and result.loads == round(result.seconds / 2)


def test_stabilise_reports_not_reached_at_max_s() -> None:
    clock = VirtualClock()
    gpu = IdleGpu(clock, temperature=lambda t: 30 + 3 * t / 60)  # 3 C/min, for ever
    result = stabilise([gpu], clock, run_load=_load(clock), slope_c_per_min=1.0, max_s=120)
    assert not result.reached and 120 <= result.seconds < 122
    assert result.slope_c_per_min == pytest.approx(3.0, abs=0.3)
    assert result.end_c == pytest.approx(36, abs=1)


def test_a_cooling_gpu_is_not_stable_either() -> None:
    clock = VirtualClock()
    gpu = IdleGpu(clock, temperature=lambda t: max(40.0, 80 - 4 * t / 60))  # cools to 40 C
    result = stabilise([gpu], clock, run_load=_load(clock), slope_c_per_min=1.0, max_s=900)
    assert result.reached and result.seconds >= 600  # 10 minutes of cooling first
    assert result.end_c == 40


def test_the_hottest_gpu_decides() -> None:
    clock = VirtualClock()
    gpus = [
        IdleGpu(clock, temperature=lambda t: 50.0),
        IdleGpu(clock, index=1, temperature=lambda t: 90 - 50 * math.exp(-t / 30)),
    ]
    result = stabilise(gpus, clock, run_load=_load(clock), max_s=900)
    assert result.reached and result.seconds >= 150 and result.end_c >= 87


@pytest.mark.parametrize(
    ("slope", "resolution", "window"), [(1.0, 1.0, 60.0), (2.0, 1.0, 30.0), (1.0, 0.1, 10.0)]
)
def test_a_stable_gpu_is_judged_over_the_window_its_sensor_needs(
    slope: float, resolution: float, window: float
) -> None:
    """A GPU already at a steady temperature passes as soon as the window the sensor's
    resolution needs for the threshold is full: 60 s for whole degrees at 1 °C/min, half that
    at 2 °C/min, the 10 s floor for a sensor reading tenths; never sooner."""
    assert slope_window_s(slope, resolution) == window
    clock = VirtualClock()
    gpu = IdleGpu(clock, temperature=lambda t: 55.0)
    result = stabilise(
        [gpu], clock, run_load=_load(clock), slope_c_per_min=slope, resolution_c=resolution
    )
    assert result.reached and window <= result.seconds < window + 2
    assert result.start_c == result.end_c == 55 and result.slope_c_per_min == 0
    # a GPU still heating below the sensor's step over a shorter window is not passed early
    clock = VirtualClock()
    warming = IdleGpu(clock, temperature=lambda t: 55.0 + 1.9 * slope * t / 60)
    late = stabilise([warming], clock, run_load=_load(clock), slope_c_per_min=slope, max_s=300)
    assert not late.reached


@settings(max_examples=30, deadline=None)
@given(
    loads_s=st.lists(st.floats(0.05, 1.5), min_size=1, max_size=8),
    tau_s=st.floats(5.0, 60.0),
    max_s=st.floats(30.0, 200.0),
    slope=st.sampled_from([0.5, 1.0, 2.0]),
    period_s=st.sampled_from([0.5, 0.7]),
)
def test_a_window_of_the_same_readings_is_not_fitted_again_to_the_same_end(
    loads_s: list[float], tau_s: float, max_s: float, slope: float, period_s: float
) -> None:
    """Loads shorter than the probe's period may add no reading and drop none from the
    window: the fit is not made again, and the result is the one a fit after every load
    gives (a window that is no whole number of periods drops readings between arrivals)."""
    from dvfs.measure.settle import Probe

    def run(fit_every_load: bool) -> object:
        clock = VirtualClock()
        gpu = IdleGpu(clock, temperature=lambda t: 75 - 40 * math.exp(-t / tau_s))
        turn = iter(range(10**6))

        def load() -> None:
            clock.sleep(loads_s[next(turn) % len(loads_s)])

        with pytest.MonkeyPatch.context() as patch:
            if fit_every_load:
                patch.setattr(Probe, "span", lambda self, since_ns: None)
            return stabilise(
                [gpu],
                clock,
                run_load=load,
                slope_c_per_min=slope,
                max_s=max_s,
                sample_period_s=period_s,
            )

    assert run(fit_every_load=False) == run(fit_every_load=True)


def test_a_load_that_takes_no_time_is_refused() -> None:
    clock = VirtualClock()
    with pytest.raises(ValueError, match="without advancing"):
        stabilise([IdleGpu(clock)], clock, run_load=lambda: None)


@settings(max_examples=100, deadline=None)
@given(slope=st.floats(-20, 20), offset=st.floats(-50, 100), n=st.integers(3, 200))
def test_slope_of_a_line_is_its_slope(slope: float, offset: float, n: int) -> None:
    t_ns = np.arange(n, dtype=np.int64) * 500_000_000 + 7
    temperature = offset + slope * (t_ns - t_ns[0]) / 60e9
    assert temperature_slope_c_per_min(t_ns, temperature) == pytest.approx(slope, abs=1e-9)


# -- on the twin, with NVML's traps on --------------------------------------------------------


def _twin(profile: str = "h100-sxm", indices=(0,)):
    from dvfs.backends import twin_gpus

    clock = VirtualClock()
    return clock, twin_gpus(profile, list(indices), clock)


def test_twin_idle_baseline_rises_with_the_clock_and_matches_the_truth() -> None:
    """The twin's counter steps every 100 ms and its idle power follows the locked clock: the
    baseline at each setting is within 0.5% of the twin's true mean power over its window,
    and counts updates (about 10 a second), not samples (100 a second)."""
    clock, gpus = _twin()
    device = gpus[0].device
    period = device.profile.energy_counter_period_s
    assert period == pytest.approx(0.1)
    found = {}
    with KnobController(gpus) as knobs:
        for mhz in (990, 1500, 1980):
            knobs.apply(KnobSetting(mhz, None))
            clock.sleep(1.0)  # past the settle
            t0 = clock.now_ns()
            result = idle_baseline(
                gpus, clock, min_s=2.0, sample_period_s=0.01, counter_period_s=period
            )
            t1 = clock.now_ns()
            truth_w = (device.true_energy_j_at(t1) - device.true_energy_j_at(t0)) / (
                (t1 - t0) / 1e9
            )
            assert result.enough and result.power_w == pytest.approx(truth_w, rel=5e-3)
            assert result.counter_updates == pytest.approx(result.seconds / period + 1, abs=1)
            found[mhz] = result.power_w
    assert found[990] < found[1500] < found[1980]


def test_twin_stabilise_under_a_load() -> None:
    """A GEMM load heats the twin's die (time constant 20 s): stabilised once the slope
    falls, not within a minute."""
    from dvfs.measure.loads import twin_gemm_load

    clock, gpus = _twin()
    load = twin_gemm_load(gpus, passes=2000)  # about a second a call
    short = stabilise(gpus, clock, run_load=load, slope_c_per_min=1.0, max_s=60)
    assert not short.reached and short.end_c > short.start_c + 5
    clock, gpus = _twin()
    load = twin_gemm_load(gpus, passes=2000)
    long = stabilise(gpus, clock, run_load=load, slope_c_per_min=1.0, max_s=600)
    assert long.reached and 60 < long.seconds < 600
    assert long.end_c > short.end_c and abs(long.slope_c_per_min) < 1.0
