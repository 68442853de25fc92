"""Baselines a measurement stands on: idle power at the current setting, and a GPU warmed to a
steady temperature.

`idle_baseline` measures static power at whatever knob setting the GPUs hold (the caller
applies it, with the server loaded and idle), over a window that spans enough DISTINCT updates
of each GPU's energy counter: the counter steps (every ~100 ms on H100), so a window counted
in samples can hide how few updates it really saw. The window runs from one observed update to
another, so the counter's step does not bias it.

`stabilise` runs a caller's load over and over until the temperature's least-squares slope over
a sliding window falls below a threshold (leakage rises with temperature, so energy depends on
the starting temperature), bounded in time.

Both work through the `Gpu` and `Clock` protocols (virtual time on the twin) and return the GPU
time they took, so a runner can account it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dvfs.clock import Clock
from dvfs.gpu.base import Gpu
from dvfs.measure.counter import CounterWindow, update_window
from dvfs.measure.settle import Probe


@dataclass(frozen=True)
class IdleBaseline:
    """Static power of the GPUs (summed, W) at the setting they held.

    `seconds`: the shortest GPU's window, from one observed counter update to a later one;
    `counter_updates`: the fewest distinct counter updates in any GPU's window (its ends
    included: the intervals between them number one fewer); `enough`: whether
    every window reached `min_s` and `min_updates`. `source` is "energy counter", or "power
    readings" (the mean of the instant power) when a counter updated less than twice.
    `gpu_time_s`: how long the measurement held the GPUs.
    """

    power_w: float
    seconds: float
    counter_updates: int
    enough: bool
    gpu_time_s: float
    source: str = "energy counter"
    note: str = ""

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def counter_windows(
    t_ns: np.ndarray, energy_mj: np.ndarray, period_s: float | None = None
) -> list[CounterWindow]:
    """Per GPU (columns of `energy_mj`): the window from its first distinct counter update
    to its last (`dvfs.measure.counter`: each update placed in the bracket of the readings
    around it, on the counter's grid when `period_s` is known). A counter that went backwards
    (reset by a driver reload or a GPU reset) counts from its reading after the last such
    step: the energy across a reset is not the energy spent."""
    if len(t_ns) == 0:
        return [CounterWindow(0.0, 0.0, 0, math.nan) for _ in range(energy_mj.shape[1])]
    windows = []
    for g in range(energy_mj.shape[1]):
        t, values = t_ns, energy_mj[:, g]
        back = (values[1:] < values[:-1]).nonzero()[0]
        if len(back):
            t, values = t[back[-1] + 1 :], values[back[-1] + 1 :]
        windows.append(update_window(t, values, period_s, int(t[0]), int(t[-1])))
    return windows


#: The longest an idle baseline waits for enough counter updates by default (s).
IDLE_BASELINE_MAX_S = 10.0


def idle_baseline(
    gpus: Sequence[Gpu],
    clock: Clock,
    *,
    min_s: float = 1.0,
    sample_period_s: float = 0.01,
    counter_period_s: float | None = None,
    min_updates: int = 10,
    max_s: float = IDLE_BASELINE_MAX_S,
) -> IdleBaseline:
    """Idle power at the current setting, from the energy counters.

    Samples every `sample_period_s` (well below the counter's update period, so an update is
    seen within one sample of when it happened) until each GPU's window between observed
    updates spans at least `min_s`, `min_updates` updates and, when the counter's update period
    is known (`counter_period_s`), `min_updates` periods; at most `max_s`. Each update's
    instant is known to half a sample period (better when `counter_period_s` lets them be
    fitted to the counter's grid), so the power is within about `sample_period_s` / `seconds`
    (relative) of the truth: 0.5% for 10 ms samples over 2 s.
    """
    if min_s <= 0 or sample_period_s <= 0 or max_s <= 0 or min_updates < 1:
        raise ValueError("min_s, sample_period_s, max_s and min_updates must be positive")
    span_s = max(min_s, min_updates * counter_period_s if counter_period_s else 0.0)
    start_ns = clock.now_ns()
    deadline_ns = start_ns + round(max_s * 1e9)
    step_s = max(sample_period_s, min(span_s / 4, 0.25))
    span_ns, step_ns = round(span_s * 1e9), round(step_s * 1e9)
    with Probe(gpus, clock, sample_period_s, ("energy_mj", "power_mw")) as probe:
        while True:
            # The whole steps that end before span_s has passed, slept at once (the same
            # instants as one at a time): no judgement falls among them.
            now_ns = clock.now_ns()
            steps = -(-(start_ns + span_ns - now_ns) // step_ns) - 1
            steps = min(steps, (deadline_ns - now_ns) // step_ns - 1)
            if steps > 1:
                clock.sleep(steps * step_ns / 1e9)
            left_s = (deadline_ns - clock.now_ns()) / 1e9
            clock.sleep(max(sample_period_s, min(step_s, left_s)))
            probe.check()
            now_ns = clock.now_ns()
            if now_ns - start_ns < span_ns and now_ns < deadline_ns:
                # No window between updates spans span_s before span_s has passed: not judged
                # (each judgement reads every sample so far, so judging every step made a long
                # idle_s quadratic: 3600 s took the dry run's estimate of a small grid 287 s).
                continue
            t, values = probe.arrays()
            windows = counter_windows(t, values["energy_mj"], counter_period_s)
            enough = all(w.seconds >= span_s and w.updates >= min_updates for w in windows)
            if enough or clock.now_ns() >= deadline_ns:
                break
    gpu_time_s = (clock.now_ns() - start_ns) / 1e9
    seconds = min(w.seconds for w in windows)
    fewest = min(w.updates for w in windows)
    if fewest < 2:
        mean_w = float(values["power_mw"].sum(axis=1).mean()) / 1000.0
        return IdleBaseline(
            power_w=mean_w,
            seconds=(int(t[-1]) - int(t[0])) / 1e9,
            counter_updates=fewest,
            enough=False,
            gpu_time_s=gpu_time_s,
            source="power readings",
            note=f"an energy counter updated less than twice in {max_s:g} s: the mean of the "
            "instant power readings instead",
        )
    note = ""
    if not enough:
        note = (
            f"only {fewest} counter updates over {seconds:.2f} s within {max_s:g} s "
            f"(wanted {min_updates} over {span_s:g} s)"
        )
    return IdleBaseline(
        power_w=sum(w.energy_mj / 1000.0 / w.seconds for w in windows),
        seconds=seconds,
        counter_updates=fewest,
        enough=enough,
        gpu_time_s=gpu_time_s,
        note=note,
    )


@dataclass(frozen=True)
class Stabilised:
    """Thermal stabilisation: the hottest GPU's temperature at the start and the end (°C),
    the seconds it took (all GPU time), whether the slope fell below the threshold, the last
    slope fitted (°C/min; None before a full window) and how many times the load ran."""

    start_c: float
    end_c: float
    seconds: float
    reached: bool
    slope_c_per_min: float | None
    loads: int

    @property
    def gpu_time_s(self) -> float:
        return self.seconds

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def temperature_slope_c_per_min(t_ns: np.ndarray, temperature_c: np.ndarray) -> float | None:
    """Least-squares slope of temperature over time, in °C per minute (None: too few points)."""
    if len(t_ns) < 2:
        return None
    t = (np.asarray(t_ns, dtype=np.int64) - int(t_ns[0])) / 60e9
    if float(np.ptp(t)) == 0.0:
        return None
    y = np.asarray(temperature_c, dtype=float)
    dt = t - t.mean()
    return float((dt * (y - y.mean())).sum() / (dt * dt).sum())


#: The shortest window a temperature slope is judged over (s), however fine the sensor.
MIN_SLOPE_WINDOW_S = 10.0


def slope_window_s(slope_c_per_min: float, resolution_c: float = 1.0) -> float:
    """How long the temperature must be watched to tell its slope from the threshold: a
    reading that does not move for T seconds bounds the slope only by resolution / T, so
    T = 60 x resolution / threshold (60 s for NVML's whole degrees at 1 °C/min, 30 s at
    2 °C/min, 6 s for a sensor reading tenths), at least MIN_SLOPE_WINDOW_S. A flat
    temperature passes as soon as the window is full; no shorter window can tell a GPU that
    is stable from one still heating below the sensor's step."""
    if slope_c_per_min <= 0 or resolution_c <= 0:
        raise ValueError("slope_c_per_min and resolution_c must be positive")
    return max(MIN_SLOPE_WINDOW_S, 60.0 * resolution_c / slope_c_per_min)


def stabilise(
    gpus: Sequence[Gpu],
    clock: Clock,
    *,
    run_load: Callable[[], None],
    slope_c_per_min: float = 1.0,
    max_s: float = 120.0,
    window_s: float | None = None,
    sample_period_s: float = 0.5,
    resolution_c: float = 1.0,
) -> Stabilised:
    """Run `run_load` until the hottest GPU's temperature slope, fitted over the last
    `window_s`, is within ±`slope_c_per_min`, or `max_s` has passed.

    The slope is checked after each call of `run_load`, so a call should last a few seconds at
    most; the last call may run past `max_s`. The window defaults to what the sensor's
    resolution needs for the threshold (`slope_window_s`: 60 s for whole degrees at
    1 °C/min; one step in its middle reads as 1.5 °C/min at worst).
    """
    if window_s is None:
        window_s = slope_window_s(slope_c_per_min, resolution_c)
    if slope_c_per_min <= 0 or max_s <= 0 or window_s <= 0 or sample_period_s <= 0:
        raise ValueError("slope_c_per_min, max_s, window_s and sample_period_s must be positive")
    start_ns = clock.now_ns()
    window_ns = round(window_s * 1e9)
    deadline_ns = start_ns + round(max_s * 1e9)
    loads = 0
    slope: float | None = None
    fitted: tuple[int, int] | None = None  # the probe's span of readings `slope` was fitted to
    reached = False
    with Probe(gpus, clock, sample_period_s, ("temperature_c",)) as probe:
        while True:
            before_ns = clock.now_ns()
            run_load()
            loads += 1
            now_ns = clock.now_ns()
            if now_ns == before_ns and clock.virtual:
                raise ValueError("run_load returned without advancing the clock")
            probe.check()
            if now_ns - start_ns >= window_ns:
                # The same readings in the window as at the last fit (a load shorter than the
                # probe's period may add none and drop none): the same slope, not below.
                span = probe.span(now_ns - window_ns)
                if span is None or span != fitted:
                    fitted = span
                    t, values = probe.arrays(now_ns - window_ns)
                    slope = temperature_slope_c_per_min(t, values["temperature_c"].max(axis=1))
                    if slope is not None and abs(slope) < slope_c_per_min:
                        reached = True
                        break
            if now_ns >= deadline_ns:
                break
        t, values = probe.arrays()
    hottest = values["temperature_c"].max(axis=1)
    return Stabilised(
        start_c=float(hottest[0]),
        end_c=float(hottest[-1]),
        seconds=(clock.now_ns() - start_ns) / 1e9,
        reached=reached,
        slope_c_per_min=slope,
        loads=loads,
    )
