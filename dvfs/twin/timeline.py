"""What one simulated GPU does from an instant on, and what it reports then: the one place that
maps instants to readings, vectorised over any number of instants.

A `Timeline` starts at `fold_ns` (a device's last `start` or knob change) in a known state (die
temperature, true energy, the energy counter's recent values), runs its work (passes of
piecewise-constant dynamic power) and then idles. From that it answers, per instant:

- the truth: die temperature (`dvfs.twin.thermal`), true power (dynamic + leakage), true
  energy (its exact integral);
- what NVML reports: the stepped, part-time energy counter and the 1-second average
  (`dvfs.twin.counter`), the instant power (the true power), the observed SM clock (which
  shows a knob change settling, `dvfs.twin.traps.settle_progress`), the event reasons.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np

from dvfs.gpu.base import EVENT_GPU_IDLE
from dvfs.twin import thermal as th
from dvfs.twin.counter import Sensor, SteppedCounter, Tail
from dvfs.twin.profiles import GpuProfile
from dvfs.twin.scalars import zero_d
from dvfs.twin.traps import settle_progress

#: A nanosecond in seconds, and the reasons an idle GPU reports, as 0-d arrays
#: (`dvfs.twin.scalars`)
(_NS_S,) = zero_d(1e-9)
(_IDLE_REASONS,) = zero_d(EVENT_GPU_IDLE, dtype=np.int64)


@dataclass(frozen=True)
class Work:
    """Passes a device runs back to back: start and end (ns), dynamic power (the power model's,
    before leakage), clock and event reasons of each. Optionally, what follows from them
    alone and was made before: each pass's `duration_s` (end - start, in s), the thermal
    model's `terms` (`dvfs.twin.thermal.segment_terms`, for the idle power they name) and
    `bounds_ns`, the starts then the last end in one array (the segments' starts a timeline
    keeps: passes back to back, each starting where the one before ended)."""

    starts_ns: np.ndarray
    ends_ns: np.ndarray
    dynamic_w: np.ndarray
    sm_clock_mhz: np.ndarray
    reasons: np.ndarray
    duration_s: np.ndarray | None = field(default=None, compare=False)
    terms: th.SegmentTerms | None = field(default=None, compare=False)
    bounds_ns: np.ndarray | None = field(default=None, compare=False)

    def after(self, t_ns: int) -> Work | None:
        """What is left at `t_ns` (the pass under way cut to start there), None when done."""
        i = int(self.ends_ns.searchsorted(t_ns, side="right"))
        if i >= len(self.ends_ns):
            return None
        starts = self.starts_ns[i:].copy()
        starts[0] = max(int(starts[0]), t_ns)
        return Work(
            starts, self.ends_ns[i:], self.dynamic_w[i:], self.sm_clock_mhz[i:], self.reasons[i:]
        )


@dataclass(frozen=True)
class Transition:
    """A knob change: when, and what the SM clock read then (the reading moves from there)."""

    at_ns: int
    from_mhz: float


@dataclass(frozen=True)
class Readings:
    """Per instant, in SI units: what NVML reports and the truth behind it."""

    energy_j: np.ndarray
    power_w: np.ndarray
    power_average_w: np.ndarray
    sm_clock_mhz: np.ndarray
    temperature_c: np.ndarray
    reasons: np.ndarray
    true_energy_j: np.ndarray


def thermal_of(profile: GpuProfile) -> th.Thermal:
    """The profile's thermal constants; leakage is reckoned from the idle steady state, the
    temperature at which the profile's idle power was read."""
    return th.Thermal(
        ambient_c=profile.ambient_c,
        c_per_w=profile.thermal_c_per_w,
        time_constant_s=profile.thermal_time_constant_s,
        leakage_w_per_c=profile.leakage_w_per_c,
        reference_c=profile.ambient_c + profile.thermal_c_per_w * profile.idle_power_w,
    )


def sensor_of(profile: GpuProfile, uuid: str) -> Sensor | None:
    """The energy counter's timing on one device (None: the counter is exact); its phase is
    fixed per device, from its UUID, as two real GPUs' counters do not update together."""
    period_ns = round(profile.energy_counter_period_s * 1e9)
    if period_ns <= 0:
        return None
    sampled_ns = round(profile.power_sampled_s * 1e9) or period_ns
    phase = int(hashlib.sha256(f"{uuid}/energy-counter".encode()).hexdigest()[:12], 16) % period_ns
    average_n = max(1, round(profile.power_average_s * 1e9 / period_ns))
    return Sensor(period_ns, min(sampled_ns, period_ns), phase, average_n)


class Timeline:
    """One device from `fold_ns` on: its `work` (None: idle), then idle at `idle_w` (dynamic,
    before leakage) showing `idle_clock_mhz`.

    `temperature_c`, `true_energy_j` and `counter_start` (the counter's recent values and the
    energy its sensor sampled before `fold_ns`, from `SteppedCounter.history_at`) carry the
    state over from the timeline before; None for all three: a device at rest since long ago
    (idle steady temperature, counter in step with the truth).
    """

    def __init__(
        self,
        profile: GpuProfile,
        thermal: th.Thermal,
        sensor: Sensor | None,
        fold_ns: int,
        temperature_c: float | None,
        true_energy_j: float | None,
        counter_start: tuple[np.ndarray, float] | None,
        work: Work | None,
        idle_w: float,
        idle_clock_mhz: int,
        transition: Transition | None,
    ) -> None:
        self.profile = profile
        self.thermal = thermal
        self.sensor = sensor
        self.fold_ns = fold_ns
        if temperature_c is None:
            temperature_c = float(thermal.steady_c(idle_w))
        self.work = work
        self.idle_w = idle_w
        self.idle_clock_mhz = idle_clock_mhz
        self.transition = transition
        k = thermal.leakage_w_per_c
        if work is not None:
            duration_s = work.duration_s
            if duration_s is None:
                duration_s = (work.ends_ns - work.starts_ns) * 1e-9
            terms = work.terms
            if terms is not None and (terms.thermal is not thermal or terms.idle_w != idle_w):
                terms = None  # made for another model or idle power: not these segments'
            steady, settled, pass_temp_c, energy_before = th.work_segments(
                thermal, temperature_c, work.dynamic_w, duration_s, idle_w, terms
            )
            self.end_ns = int(work.ends_ns[-1])
            end_temp, end_energy = float(pass_temp_c[-1]), float(energy_before[-1])
            seg_start = work.bounds_ns
            if seg_start is None:
                n = len(work.starts_ns)
                seg_start = np.empty(n + 1, dtype=np.int64)
                seg_start[:n] = work.starts_ns
                seg_start[n] = self.end_ns
            self._seg_ends_ns = work.ends_ns
        else:
            self.end_ns = fold_ns
            end_temp, end_energy = temperature_c, 0.0
            pass_temp_c, energy_before = np.array([end_temp]), np.array([0.0])
            dynamic, seg_start = np.array([idle_w]), np.array([fold_ns], dtype=np.int64)
            steady = thermal.steady_c(dynamic)
            settled = dynamic + k * (steady - thermal.reference_c)
            self._seg_ends_ns = np.empty(0, dtype=np.int64)
        # Per segment (each pass, then the idle tail): T(s) = S + (T0 - S) e^(-s/tau'),
        # power = A + k (T - S), energy since its start = A s + k (T0 - S) tau' (1 - e^(-s/tau')).
        self._seg_start_ns = seg_start
        self._seg_steady_c = steady
        self._seg_settled_w = settled
        self._seg_offset_c = pass_temp_c - steady  # T0 - S
        self._seg_energy_j = energy_before
        self.end_temp_c = end_temp
        self.end_energy_j = end_energy
        a, b = th.relaxation(thermal, end_temp, idle_w)
        self.tail = Tail(self.end_ns, a, b, thermal.tau_s)
        self.base_energy_j = self.rest_energy_j() if true_energy_j is None else true_energy_j
        self._state: tuple[int, tuple[float, float]] | None = None
        self.counter: SteppedCounter | None = None
        if sensor is not None:
            history, carry = counter_start if counter_start is not None else self._at_rest()
            self.counter = SteppedCounter(
                sensor, fold_ns, history, carry, self._energy_since, self.tail
            )

    def _at_rest(self) -> tuple[np.ndarray, float]:
        """A counter that has seen this state's idle power for `average_n` updates (its value 0
        `average_n` updates back), and the energy its sensor has sampled so far."""
        s = self.sensor
        assert s is not None
        power_w = float(self.thermal.power_w(self.idle_w, self.end_temp_c))
        last = s.index_of(self.fold_ns)
        ks = np.arange(last - s.average_n, last + 1, dtype=np.int64)
        history = power_w * s.period_ns * 1e-9 * (ks - ks[0])
        window_ns = s.instant_of(last + 1) - s.sampled_ns
        carry = power_w * max(0, self.fold_ns - window_ns) * 1e-9
        return history, carry

    def rest_energy_j(self) -> float:
        """True energy at `fold_ns` of a device that starts at rest: what its counter held
        `average_n` updates back plus the energy since (the counter's zero is the driver's)."""
        if self.sensor is None:
            return 0.0
        s = self.sensor
        power_w = float(self.thermal.power_w(self.idle_w, self.end_temp_c))
        last = s.index_of(self.fold_ns)
        first_ns = s.instant_of(last - s.average_n)
        return power_w * (self.fold_ns - first_ns) * 1e-9

    # -- the truth -------------------------------------------------------------------------
    def _truth(
        self, t_ns: np.ndarray, *, clipped: bool = False, energy: bool = True
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """busy, segment index (the idle tail is the last), temperature (C), true power (W),
        true energy since `fold_ns` (J; None without `energy`: NVML's stepped counter does not
        read it), at instants from `fold_ns` on (earlier ones clipped; `clipped`: the caller
        has clipped them)."""
        if not clipped:
            t_ns = np.maximum(t_ns, self.fold_ns)
        j = self._seg_ends_ns.searchsorted(t_ns, side="right")
        busy = j < len(self._seg_ends_ns)
        offset_s = np.subtract(t_ns, self._seg_start_ns[j])
        offset_s = np.multiply(offset_s, _NS_S)
        settled_w = self._seg_settled_w[j]
        since = self._seg_energy_j[j] + settled_w * offset_s if energy else None
        tau = self.thermal.tau_s
        if tau > 0:
            z = self.thermal.arrays
            start_lag = self._seg_offset_c[j]  # T0 - S
            # e^(-offset / tau'), as offset / -tau' (division rounds the same either sign)
            lag_c = np.divide(offset_s, z.minus_tau)
            lag_c = start_lag * np.exp(lag_c, out=lag_c)  # T - S
            temp = self._seg_steady_c[j] + lag_c
            k = self.thermal.leakage_w_per_c
            if k:
                if since is not None:
                    since += z.k_tau * (start_lag - lag_c)
                power = settled_w + z.k * lag_c
            else:
                power = settled_w
        else:
            temp, power = self._seg_steady_c[j], settled_w
        return busy, j, temp, power, since

    def temperature_c(self, t_ns: np.ndarray) -> np.ndarray:
        """`_truth`'s temperature alone at int64 instants (earlier than `fold_ns`: clipped, as
        `readings` clips them): the same arithmetic, without the power and the energy."""
        t_ns = np.maximum(t_ns, self.fold_ns)
        j = self._seg_ends_ns.searchsorted(t_ns, side="right")
        tau = self.thermal.tau_s
        if tau > 0:
            offset_s = (t_ns - self._seg_start_ns[j]) * 1e-9
            return self._seg_steady_c[j] + self._seg_offset_c[j] * np.exp(-offset_s / tau)
        return self._seg_steady_c[j]

    def energy_since_fold_j(self, t_ns: np.ndarray) -> np.ndarray:
        """`_truth`'s true energy alone (the counter's updates read nothing else): the same
        arithmetic, without the temperature and power."""
        return self._energy_since(np.maximum(np.asarray(t_ns, dtype=np.int64), self.fold_ns))

    def _energy_since(self, t_ns: np.ndarray) -> np.ndarray:
        """`energy_since_fold_j` at int64 instants none of which is before `fold_ns` (what the
        counter asks: its updates' windows, clipped to the fold already)."""
        j = self._seg_ends_ns.searchsorted(t_ns, side="right")
        offset_s = t_ns - self._seg_start_ns[j]
        offset_s = np.multiply(offset_s, _NS_S)
        # energy before the segment + settled power x offset, then + k tau' (T0 - S) (1 -
        # e^(-offset / tau')), each step in place in the order of the formula
        energy = self._seg_settled_w[j]
        energy *= offset_s
        energy += self._seg_energy_j[j]
        tau = self.thermal.tau_s
        k = self.thermal.leakage_w_per_c
        if tau > 0 and k:
            z = self.thermal.arrays
            start_lag = self._seg_offset_c[j]
            # -offset / tau' as offset / -tau' (division rounds the same either sign)
            decay = np.divide(offset_s, z.minus_tau, out=offset_s)
            np.exp(decay, out=decay)
            decay *= start_lag
            np.subtract(start_lag, decay, out=decay)
            decay *= z.k_tau
            energy += decay
        return energy

    def _point(self, t_ns: int) -> tuple[float, float]:
        """`_truth` at one instant in scalar arithmetic (a fold reads one or two): temperature
        (C) and true energy since `fold_ns` (J)."""
        t_ns = max(t_ns, self.fold_ns)
        # at or past the work's end (where the next start folds a timeline), the idle tail:
        # what the search finds there, without its call
        ends = self._seg_ends_ns
        j = len(ends) if t_ns >= self.end_ns else int(ends.searchsorted(t_ns, side="right"))
        offset_s = (t_ns - int(self._seg_start_ns[j])) * 1e-9
        energy = float(self._seg_energy_j[j]) + float(self._seg_settled_w[j]) * offset_s
        temp = float(self._seg_steady_c[j])
        tau = self.thermal.tau_s
        if tau > 0:
            start_lag = float(self._seg_offset_c[j])
            lag = start_lag * math.exp(-offset_s / tau)
            temp += lag
            energy += self.thermal.leakage_w_per_c * tau * (start_lag - lag)
        return temp, energy

    def state_at(self, t_ns: int) -> tuple[float, float]:
        """Temperature (C) and true energy (J, absolute) at one instant."""
        if self._state is not None and self._state[0] == t_ns:
            return self._state[1]
        temp, energy = self._point(t_ns)
        state = temp, self.base_energy_j + energy
        self._state = (t_ns, state)
        return state

    def fold_state(self, t_ns: int) -> tuple[float, float, tuple[np.ndarray, float] | None]:
        """What a timeline that follows this one from `t_ns` starts from: temperature, true
        energy (absolute) and the energy counter's recent values."""
        temp, energy = self.state_at(t_ns)
        counter = self.counter
        if counter is None:
            return temp, energy, None
        opened = counter.carry_from_ns(t_ns)
        sampled = 0.0 if opened is None else energy - self.base_energy_j - self._point(opened)[1]
        return temp, energy, counter.history_at(t_ns, sampled)

    # -- what NVML reports ---------------------------------------------------------------------
    def readings(self, t_ns: np.ndarray) -> Readings:
        t_ns = np.asarray(t_ns, dtype=np.int64)
        clipped = np.maximum(t_ns, self.fold_ns)  # the truth and the counter before the fold
        busy, i, temp, power, since_j = self._truth(clipped, clipped=True)
        assert since_j is not None
        clock, reasons = self._clock_and_reasons(t_ns, busy, i)
        true_j = self.base_energy_j + since_j
        if self.counter is None:
            energy, average = true_j, power
        else:
            energy, average = self.counter.read(clipped)
            if self.profile.power_average_s <= 0:
                average = power
        return Readings(energy, power, average, clock, temp, reasons, true_j)

    def reported(
        self, t_ns: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`readings`' energy counter (J), power (W), SM clock, temperature (C) and event
        reasons alone, the same numbers: what a GPU's bulk read reports (`dvfs.gpu.twin`),
        without the averaged power and the true energy, which it does not (a sampler reads
        every round; both cost a quarter of the reading)."""
        t_ns = np.asarray(t_ns, dtype=np.int64)
        clipped = np.maximum(t_ns, self.fold_ns)
        counter = self.counter
        busy, i, temp, power, since_j = self._truth(clipped, clipped=True, energy=counter is None)
        clock, reasons = self._clock_and_reasons(t_ns, busy, i)
        if counter is not None:
            return counter.at(clipped), power, clock, temp, reasons
        assert since_j is not None
        return self.base_energy_j + since_j, power, clock, temp, reasons

    def _clock_and_reasons(
        self, t_ns: np.ndarray, busy: np.ndarray, i: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The observed SM clock (a knob change settling) and the event reasons at `t_ns`,
        from `_truth`'s busy and segment index there."""
        work = self.work
        if work is not None:
            i = np.minimum(i, len(work.ends_ns) - 1)
            clock = np.where(busy, work.sm_clock_mhz[i], self.idle_clock_mhz)
            reasons = np.where(busy, work.reasons[i], _IDLE_REASONS)
        else:
            clock = np.full(t_ns.shape, self.idle_clock_mhz, dtype=np.int64)
            reasons = np.full(t_ns.shape, EVENT_GPU_IDLE, dtype=np.int64)
        change = self.transition
        if change is not None:
            elapsed_s = (t_ns - change.at_ns) * 1e-9
            moving = elapsed_s < self.profile.settle_time_s
            if moving.any():
                left = 1.0 - settle_progress(self.profile, elapsed_s[moving])
                target = clock[moving]
                clock = clock.astype(np.int64, copy=True)
                clock[moving] = np.round(target + (change.from_mhz - target) * left)
        return clock, reasons
