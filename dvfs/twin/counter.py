"""NVML's energy counter and averaged power as the twin's GPU reports them: stepped and part-time.

- The total-energy counter (`nvmlDeviceGetTotalEnergyConsumption`, mJ) changes only at update
  instants u_k = phase + k x period: between two it holds its last value. ML.ENERGY's Zeus notes
  that the update period can exceed a short measurement window (release v0.6.1, which then falls
  back to power x time); PETSc's manual gives 20-100 ms for recent GPUs; ~100 ms on H100/H200.
- The power sensor samples only part of each period: on A100 and H100 about 25% of the runtime
  (Yang, Adamek and Armour, "Part-time Power Measurements: nvidia-smi's Lack of Attention",
  SC'24, arXiv 2312.02741). The twin samples the last `sampled` seconds of each period; an update
  adds period x (mean power over that sub-window), so a steady load is counted exactly and a load
  that changes faster than the period is mis-counted.
- `nvmlDeviceGetPowerUsage` is a 1-second average on Ampere (not GA100) and newer: the twin's is
  the counter's increase over the last `average_n` updates divided by their span, so it lags a
  step in power by up to a second. The instant field (`NVML_FI_DEV_POWER_INSTANT`) is not
  averaged: the twin reports the true power there.

`SteppedCounter` holds the counter from one instant on (a device's last `start`): the counter's
values at the updates before it (history), the true energy function of what runs after it, and
the idle tail after the work as a + b exp(-(t - t_e) / tau) (the GPU cooling: leakage falls), so
any number of idle updates is summed in closed form.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dvfs.twin.scalars import zero_d


@dataclass(frozen=True)
class Sensor:
    """When the counter updates and which part of each period the power sensor sees (ns)."""

    period_ns: int
    sampled_ns: int
    phase_ns: int
    average_n: int

    def __post_init__(self) -> None:
        if self.period_ns <= 0 or not 0 < self.sampled_ns <= self.period_ns:
            raise ValueError(f"bad sensor timing {self}")
        if not 0 <= self.phase_ns < self.period_ns or self.average_n < 0:
            raise ValueError(f"bad sensor timing {self}")

    @property
    def scale(self) -> float:
        """Period over sampled window: how much one sampled joule counts."""
        return self.period_ns / self.sampled_ns

    @functools.cached_property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The phase, period and sampled window (int64) and `scale` as 0-d arrays, for the
        arithmetic on a sampler's instants (`dvfs.twin.scalars`)."""
        phase, period, sampled = zero_d(
            self.phase_ns, self.period_ns, self.sampled_ns, dtype=np.int64
        )
        return phase, period, sampled, zero_d(self.scale)[0]

    def index(self, t_ns: np.ndarray) -> np.ndarray:
        """The last update at or before each instant."""
        phase, period, _, _ = self.arrays
        return (np.asarray(t_ns, dtype=np.int64) - phase) // period

    def instant_ns(self, k: np.ndarray) -> np.ndarray:
        return self.phase_ns + np.asarray(k, dtype=np.int64) * self.period_ns

    def index_of(self, t_ns: int) -> int:
        """`index` at one instant, in integer arithmetic (the same number, without numpy)."""
        return (int(t_ns) - self.phase_ns) // self.period_ns

    def instant_of(self, k: int) -> int:
        """`instant_ns` of one update."""
        return self.phase_ns + int(k) * self.period_ns


@dataclass(frozen=True)
class Tail:
    """True power after the work ends, from `start_ns` on: a + b exp(-(t - start) / tau)."""

    start_ns: int
    a_w: float
    b_w: float
    tau_s: float

    def energy_j(self, t0_ns: np.ndarray, t1_ns: np.ndarray) -> np.ndarray:
        """True energy between two instants of the tail (elementwise)."""
        s0 = (np.asarray(t0_ns) - self.start_ns) * 1e-9
        s1 = (np.asarray(t1_ns) - self.start_ns) * 1e-9
        out = self.a_w * (s1 - s0)
        if self.b_w and self.tau_s > 0:
            out = out + self.b_w * self.tau_s * (
                np.exp(-s0 / self.tau_s) - np.exp(-s1 / self.tau_s)
            )
        return out


class SteppedCounter:
    """The counter's value at every update from one instant (`fold_ns`) on.

    `history[i]` is the counter at update `first + i`, the updates up to the last one at or
    before `fold_ns` (at least `average_n` of them, for the average); `carry_j` the energy
    the sensor already sampled before `fold_ns` in the window of the first update after it;
    `true_energy_j(t)` the true energy since `fold_ns` at instants from `fold_ns` on (read
    while the counter is made, and not kept: it is a bound method of the timeline that keeps
    this counter, and keeping it would make each timeline a reference cycle, garbage only the
    cyclic collector frees), and `tail` the idle stretch after the work (where the closed form
    takes over).
    """

    def __init__(
        self,
        sensor: Sensor,
        fold_ns: int,
        history: np.ndarray,
        carry_j: float,
        true_energy_j: Callable[[np.ndarray], np.ndarray],
        tail: Tail,
    ) -> None:
        self.sensor = sensor
        self.fold_ns = fold_ns
        self.last = sensor.index_of(fold_ns)
        self.first = self.last - len(history) + 1
        self.history = np.asarray(history, dtype=float)
        self.carry_j = carry_j
        self.tail = tail
        s = sensor
        # Updates whose sampled window starts in the tail follow the closed form; the ones
        # before (their windows overlap the work) are evaluated one by one.
        self.tail_first = max(
            self.last + 1,
            -((s.phase_ns - s.sampled_ns - tail.start_ns) // s.period_ns),  # ceil division
        )
        # `instant_ns` of updates last + 1 .. tail_first - 1, in integer steps of a period
        u = np.arange(
            s.instant_of(self.last + 1), s.instant_of(self.tail_first), s.period_ns, dtype=np.int64
        )
        m, h = len(u), len(self.history)
        _, _, sampled_ns, scale = s.arrays
        # the window ends, then their starts (not before the fold): one pass over the timeline
        ends_starts = np.empty(2 * m, dtype=np.int64)
        ends_starts[:m] = u
        starts = np.subtract(u, sampled_ns, out=ends_starts[m:])
        np.maximum(starts, fold_ns, out=starts)
        both = true_energy_j(ends_starts)
        sampled = both[:m] - both[m:]
        if m:
            sampled[0] += carry_j
        #: The counter at updates first .. tail_first - 1, in one array: the history, then
        #: its last value + scale x the running sum of what the sensor sampled.
        self.known = np.empty(h + m)
        self.known[:h] = self.history
        explicit = np.add.accumulate(sampled, out=self.known[h:])  # (ndarray.cumsum's own)
        explicit *= scale
        explicit += self.known[h - 1 : h]  # the history's last value (a view: no scalar made)
        self._before_tail = float(self.known[-1])

    def at_updates(self, k: np.ndarray) -> np.ndarray:
        """The counter (J) just after update k, for k >= `first` (elementwise)."""
        k = np.asarray(k, dtype=np.int64)
        i = k - self.first
        n = len(self.known)
        if i.size:  # (the ufuncs' reductions, without ndarray.min's and max's wrappers)
            if np.minimum.reduce(i, axis=None) < 0:
                raise ValueError("the counter's history does not reach that far back")
            if np.maximum.reduce(i, axis=None) < n:  # none in the closed-form tail
                return self.known[i]
        out = self.known[np.minimum(i, n - 1)]
        late = i >= n
        if late.any():
            out[late] = self._before_tail + self._tail_sum(k[late] - self.tail_first + 1)
        return out

    def _tail_sum(self, n: np.ndarray) -> np.ndarray:
        """Counted energy of the first n tail updates: a period each at the base power, plus
        the sampled share of the decaying term (a geometric series)."""
        s, tail = self.sensor, self.tail
        period_s = s.period_ns * 1e-9
        out = tail.a_w * period_s * n
        if tail.b_w and tail.tau_s > 0:
            tau = tail.tau_s
            u0 = (s.instant_of(self.tail_first) - tail.start_ns) * 1e-9
            w = s.sampled_ns * 1e-9
            first = tail.b_w * tau * math.exp(-u0 / tau) * math.expm1(w / tau)
            # sum_{i<n} q^i with q = exp(-period / tau), stable for q near 1
            series = np.expm1(-n * period_s / tau) / math.expm1(-period_s / tau)
            out = out + s.scale * first * series
        return out

    def at(self, t_ns: np.ndarray) -> np.ndarray:
        """What the counter reads (J) at each instant (not before `fold_ns`)."""
        return self.at_updates(self.sensor.index(t_ns))

    def average_w(self, t_ns: np.ndarray) -> np.ndarray:
        """The averaged power reading: the counter's rise over the last `average_n` updates."""
        return self.read(t_ns)[1]

    def read(self, t_ns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The counter (J) and the averaged power (W) at each instant, in one lookup."""
        n = self.sensor.average_n
        k = self.sensor.index(t_ns)
        both = self.at_updates(np.concatenate([k, k - n]))
        now, back = both[: len(k)], both[len(k) :]
        return now, (now - back) / (n * self.sensor.period_ns * 1e-9)

    def carry_from_ns(self, t_ns: int) -> int | None:
        """Where the sensor's window of the first update after `t_ns` opened, when before
        `t_ns` (clipped to this counter's fold); None when it opens later. A counter folded at
        `t_ns` needs the true energy between that instant and `t_ns`."""
        s = self.sensor
        k = s.index_of(t_ns)
        window_ns = s.instant_of(k + 1) - s.sampled_ns
        if window_ns >= t_ns:
            return None
        return max(window_ns, self.fold_ns)

    def history_at(self, t_ns: int, sampled_j: float) -> tuple[np.ndarray, float]:
        """What a counter folded at `t_ns` (>= `fold_ns`) starts from: the values of its last
        `average_n` + 1 updates, and the energy its sensor sampled before `t_ns` in the window
        of the next update (`sampled_j`: the true energy from `carry_from_ns(t_ns)` to `t_ns`,
        0 when that is None; this counter's own carry is added when the window opened before
        its fold)."""
        s = self.sensor
        k = s.index_of(t_ns)
        start = k - s.average_n - self.first
        if start >= 0 and k - self.first < len(self.known):  # all known: `at_updates`' values
            history = self.known[start : k - self.first + 1].copy()
        else:
            history = self.at_updates(np.arange(k - s.average_n, k + 1, dtype=np.int64))
        window_ns = s.instant_of(k + 1) - s.sampled_ns
        if window_ns >= t_ns:
            return history, 0.0
        if window_ns >= self.fold_ns:
            return history, sampled_j
        return history, self.carry_j + sampled_j
