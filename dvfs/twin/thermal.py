"""The twin's die temperature and the leakage power it drives: a first-order thermal model.

    C dT/dt = P(t) - (T - T_amb) / R        (R: thermal resistance, tau = R C: time constant)
    P(t)    = P_dyn(t) + k (T - T_ref)       (leakage, linear in T)

`P_dyn` is what the power model gives (piecewise constant: one value per pass, or idle), `T_ref`
the temperature at which the profile's powers were calibrated (the idle steady state, where the
idle power was read). Leakage current grows roughly exponentially with temperature (De Vogeleer et
al., arXiv 1404.3381, measured 20-85 C); over a data-centre GPU's 30-85 C it is taken linear in
T, which keeps the model linear in T: substituting P gives the same first-order ODE with an
effective time constant tau' = tau / (1 - R k) and steady state
T_ss = (T_amb + R (P_dyn - k T_ref)) / (1 - R k). So for piecewise-constant P_dyn the temperature
and the leakage are exact (no fixed-point iteration): on a segment of constant P_dyn starting at
T0, T(s) = T_ss + (T0 - T_ss) exp(-s / tau'), and its energy has a closed form.

`tau = 0` is the history-free model (T jumps to its steady state); `k = 0` has no leakage: both
off give the old `ambient + R P` temperature and unchanged power.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from dvfs.twin.scalars import zero_d

#: Largest decay exponent (sum of d / tau') evaluated in one block of the recurrence: e^500 is
#: far inside float64's range, so the scaled sums below never overflow.
_BLOCK_EXPONENT = 500.0


@dataclass(frozen=True)
class Thermal:
    """One GPU's thermal constants (units in each name)."""

    ambient_c: float
    c_per_w: float
    time_constant_s: float
    leakage_w_per_c: float
    reference_c: float

    def __post_init__(self) -> None:
        if self.c_per_w < 0 or self.time_constant_s < 0 or self.leakage_w_per_c < 0:
            raise ValueError(f"thermal constants must be >= 0: {self}")
        if self.c_per_w * self.leakage_w_per_c >= 1.0:
            raise ValueError(
                f"thermal runaway: R x dP_leak/dT = {self.c_per_w * self.leakage_w_per_c:g} >= 1"
            )

    @functools.cached_property
    def gain(self) -> float:
        """1 / (1 - R k): how much leakage amplifies a temperature rise."""
        return 1.0 / (1.0 - self.c_per_w * self.leakage_w_per_c)

    @functools.cached_property
    def tau_s(self) -> float:
        """Effective time constant with the leakage feedback (0: no thermal lag)."""
        return self.time_constant_s * self.gain

    @functools.cached_property
    def arrays(self) -> ThermalArrays:
        """The constants the arithmetic on a round's segments and a sampler's instants uses,
        as 0-d arrays (`dvfs.twin.scalars`)."""
        k, tau = self.leakage_w_per_c, self.tau_s
        return ThermalArrays(
            *zero_d(
                k * self.reference_c,
                self.c_per_w,
                self.ambient_c,
                self.gain,
                self.reference_c,
                k,
                tau,
                -tau,
                k * tau,
            )
        )

    def steady_c(self, dynamic_w: np.ndarray | float) -> np.ndarray:
        """Temperature a constant `dynamic_w` settles at, leakage included."""
        k = self.leakage_w_per_c
        return (self.ambient_c + self.c_per_w * (np.asarray(dynamic_w) - k * self.reference_c)) * (
            self.gain
        )

    def power_w(
        self, dynamic_w: np.ndarray | float, temperature_c: np.ndarray | float
    ) -> np.ndarray:
        """True power: the dynamic power model's plus the leakage's change since `reference_c`."""
        return np.asarray(dynamic_w) + self.leakage_w_per_c * (
            np.asarray(temperature_c) - self.reference_c
        )


class ThermalArrays(NamedTuple):
    """`Thermal.arrays`: a model's constants as read-only 0-d float64 arrays."""

    k_ref: np.ndarray  # k T_ref
    c_per_w: np.ndarray  # R
    ambient_c: np.ndarray
    gain: np.ndarray
    reference_c: np.ndarray
    k: np.ndarray
    tau: np.ndarray  # tau'
    minus_tau: np.ndarray  # -tau'
    k_tau: np.ndarray  # k tau'


def start_temperatures(
    th: Thermal,
    t0_c: float,
    dynamic_w: np.ndarray,
    duration_s: np.ndarray,
    steady_c: np.ndarray | None = None,
) -> np.ndarray:
    """Temperature at the start of each segment and at the end of the last (n + 1 values).

    The exact solution of the linear recurrence T[i+1] = S[i] + (T[i] - S[i]) a[i],
    a[i] = exp(-d[i] / tau'), with L[i] = sum(d[:i]) / tau' and within a block starting at c:
    T[i] = exp(-(L[i] - L[c])) (T[c] + sum_{c<=j<i} S[j] exp(L[j] - L[c]) expm1(d[j] / tau')).
    Blocks keep L[i] - L[c] below `_BLOCK_EXPONENT`, so nothing overflows or underflows to a
    wrong answer; a schedule of tens of seconds against a tau' of tens of seconds is one block.
    """
    dynamic_w = np.asarray(dynamic_w, dtype=float)
    duration_s = np.asarray(duration_s, dtype=float)
    steady = th.steady_c(dynamic_w) if steady_c is None else steady_c
    tau = th.tau_s
    return _start_temperatures(th, t0_c, steady, duration_s / tau if tau > 0.0 else None)


def _start_temperatures(
    th: Thermal, t0_c: float, steady: np.ndarray, x: np.ndarray | None
) -> np.ndarray:
    """`start_temperatures` given the segments' steady temperatures and their durations over
    tau' (`x`; None when tau' is 0)."""
    n = len(steady)
    out = np.empty(n + 1)
    if x is None:  # no lag: each segment is at its steady state from its first instant
        out[0] = t0_c
        out[1:] = steady
        return out
    cum = _decay_sums(x)
    if cum[n] <= _BLOCK_EXPONENT:  # one block (the usual case: seconds against tens of s)
        terms, decay = _one_block(steady, x, cum)
        return _from_one_block(t0_c, terms, decay)
    return _by_blocks(t0_c, steady, x, cum)


def _decay_sums(x: np.ndarray) -> np.ndarray:
    """L[i] = sum(x[:i]), i = 0..n."""
    cum = np.empty(len(x) + 1)
    cum[0] = 0.0
    # (np.add.accumulate is what ndarray.cumsum calls, without its dispatch)
    np.add.accumulate(x, out=cum[1:])
    return cum


def _one_block(steady: np.ndarray, x: np.ndarray, cum: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The one-block recurrence's terms that do not depend on T0: the running sum of
    steady e^L[i] expm1(x[i]), and e^-L[i+1]."""
    terms = np.exp(cum[:-1])
    terms *= steady
    terms *= np.expm1(x)
    np.add.accumulate(terms, out=terms)
    decay = np.negative(cum[1:])
    np.exp(decay, out=decay)
    return terms, decay


def _from_one_block(t0_c: float, terms: np.ndarray, decay: np.ndarray) -> np.ndarray:
    """`_start_temperatures` from `_one_block`'s terms: T0 added to the running sum, times
    e^-L[i+1] (`terms` is left as it was)."""
    out = np.empty(len(terms) + 1)
    out[0] = t0_c
    np.multiply(decay, np.add(terms, t0_c), out=out[1:])
    return out


def _by_blocks(t0_c: float, steady: np.ndarray, x: np.ndarray, cum: np.ndarray) -> np.ndarray:
    """`_start_temperatures` over blocks that each keep their decay below the bound."""
    n = len(steady)
    out = np.empty(n + 1)
    out[0] = t0_c
    start, temp = 0, float(t0_c)
    while start < n:
        # The block: segments start..stop-1, with L[stop] - L[start] <= the bound (at least one).
        stop = int(np.searchsorted(cum, cum[start] + _BLOCK_EXPONENT, side="right")) - 1
        stop = min(max(stop, start + 1), n)
        rel = cum[start : stop + 1] - cum[start]
        if rel[-1] > _BLOCK_EXPONENT:  # one segment alone decays past the bound: it settles
            out[start + 1 : stop + 1] = steady[start:stop]
        else:
            terms = steady[start:stop] * np.exp(rel[:-1]) * np.expm1(x[start:stop])
            out[start + 1 : stop + 1] = np.exp(-rel[1:]) * (temp + np.cumsum(terms))
        temp = float(out[stop])
        start = stop
    return out


@dataclass(frozen=True, eq=False)
class SegmentTerms:
    """What `work_segments` works out before it needs the start temperature: the same for
    every run of the same passes from any temperature (a thermal stabilisation runs one load
    again and again), so a device makes them once per schedule. Read-only arrays.

    Per segment (the passes, then the idle tail): `steady` temperature and `settled` power;
    per pass: `x` (duration over tau'; None without lag), and with it the one block's
    `rise` and `decay` (`_one_block`; None over several blocks, `cum` then kept), the
    energy's `settled_j` (settled power x duration) and `lag_decay` (expm1(-x)); `per_pass`
    the energies when no term depends on T0 (no leakage, or no lag)."""

    thermal: Thermal
    idle_w: float
    steady: np.ndarray
    settled: np.ndarray
    x: np.ndarray | None
    cum: np.ndarray | None
    rise: np.ndarray | None
    decay: np.ndarray | None
    settled_j: np.ndarray | None
    lag_decay: np.ndarray | None
    per_pass: np.ndarray | None


def segment_terms(
    th: Thermal, dynamic_w: np.ndarray, duration_s: np.ndarray, idle_w: float
) -> SegmentTerms:
    """`SegmentTerms` of passes of `dynamic_w` lasting `duration_s` each, then idle at
    `idle_w`."""
    arrays = _terms(th, dynamic_w, duration_s, idle_w)
    for a in arrays:
        if a is not None:
            a.flags.writeable = False
    return SegmentTerms(th, idle_w, *arrays)


#: `SegmentTerms`' arrays, in its order (work that runs once makes them and keeps none).
_Terms = tuple[
    np.ndarray,
    np.ndarray,
    np.ndarray | None,
    np.ndarray | None,
    np.ndarray | None,
    np.ndarray | None,
    np.ndarray | None,
    np.ndarray | None,
    np.ndarray | None,
]


def _terms(th: Thermal, dynamic_w: np.ndarray, duration_s: np.ndarray, idle_w: float) -> _Terms:
    """`segment_terms`' arrays (writable)."""
    dynamic_w = np.asarray(dynamic_w, dtype=float)
    duration_s = np.asarray(duration_s, dtype=float)
    n = len(dynamic_w)
    dynamic = np.empty(n + 1)
    dynamic[:n] = dynamic_w
    dynamic[n] = idle_w
    k = th.leakage_w_per_c
    z = th.arrays
    # `steady_c`, then dynamic + k (steady - T_ref): each step in place, in the same order
    steady = np.subtract(dynamic, z.k_ref)
    steady *= z.c_per_w
    steady += z.ambient_c
    steady *= z.gain
    settled = np.subtract(steady, z.reference_c)
    settled *= z.k
    settled += dynamic
    pass_steady = steady[:n]
    tau = th.tau_s
    x = np.divide(duration_s, z.tau) if tau > 0.0 else None
    cum = rise = decay = settled_j = lag_decay = per_pass = None
    if x is not None:
        cum = _decay_sums(x)
        if cum[n] <= _BLOCK_EXPONENT:
            rise, decay = _one_block(pass_steady, x, cum)
            cum = None
    if k == 0.0:
        per_pass = dynamic_w * duration_s
    elif x is None:
        per_pass = settled[:n] * duration_s
    else:
        # (-d / tau' is -x to the bit: division rounds the same either sign)
        lag_decay = np.negative(x)
        np.expm1(lag_decay, out=lag_decay)
        settled_j = settled[:n] * duration_s
    return steady, settled, x, cum, rise, decay, settled_j, lag_decay, per_pass


def work_segments(
    th: Thermal,
    t0_c: float,
    dynamic_w: np.ndarray,
    duration_s: np.ndarray,
    idle_w: float,
    terms: SegmentTerms | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Passes of `dynamic_w` lasting `duration_s` each from `t0_c`, then idle at `idle_w`: per
    segment (each pass, then the idle tail) its steady temperature, settled power (dynamic
    plus the leakage at the steady temperature), start temperature and the true energy before
    it. The numbers `steady_c`, `start_temperatures` and `segment_energy_j` give, with the
    terms they share computed once, and those that do not depend on `t0_c` taken from `terms`
    when given (`segment_terms` of the same passes, thermal model and idle power)."""
    if terms is None:
        steady, settled, x, cum, rise, decay, settled_j, lag_decay, per_pass = _terms(
            th, dynamic_w, duration_s, idle_w
        )
    else:
        steady, settled, x, cum = terms.steady, terms.settled, terms.x, terms.cum
        rise, decay, settled_j = terms.rise, terms.decay, terms.settled_j
        lag_decay, per_pass = terms.lag_decay, terms.per_pass
    n = len(steady) - 1
    pass_steady = steady[:n]
    if x is None:
        start_c = _start_temperatures(th, t0_c, pass_steady, None)
    elif rise is not None and decay is not None:
        start_c = _from_one_block(t0_c, rise, decay)
    else:
        assert cum is not None
        start_c = _by_blocks(t0_c, pass_steady, x, cum)
    if per_pass is None:
        assert settled_j is not None and lag_decay is not None
        # settled d + k (T0 - S) tau' (-expm1(-d / tau')), in that order (adding a y (-e)
        # is subtracting a y e: rounding is symmetric in sign)
        z = th.arrays
        lag = start_c[:n] - pass_steady
        lag *= z.k
        lag *= z.tau
        lag *= lag_decay
        per_pass = np.subtract(settled_j, lag)
    energy_before = np.empty(n + 1)
    energy_before[0] = 0.0
    np.add.accumulate(per_pass, out=energy_before[1:])
    return steady, settled, start_c, energy_before


def segment_energy_j(
    th: Thermal,
    t_start_c: np.ndarray | float,
    dynamic_w: np.ndarray | float,
    offset_s: np.ndarray | float,
    steady_c: np.ndarray | None = None,
) -> np.ndarray:
    """True energy from a segment's start to `offset_s` into it (elementwise):
    (P_dyn + k (T_ss - T_ref)) s + k (T0 - T_ss) tau' (1 - exp(-s / tau'))."""
    dynamic_w = np.asarray(dynamic_w, dtype=float)
    offset_s = np.asarray(offset_s, dtype=float)
    k = th.leakage_w_per_c
    if k == 0.0:
        return dynamic_w * offset_s
    steady = th.steady_c(dynamic_w) if steady_c is None else steady_c
    settled = (dynamic_w + k * (steady - th.reference_c)) * offset_s
    tau = th.tau_s
    if tau <= 0.0:
        return settled
    return settled + k * (np.asarray(t_start_c) - steady) * tau * -np.expm1(-offset_s / tau)


def segment_temperature_c(
    th: Thermal,
    t_start_c: np.ndarray | float,
    dynamic_w: np.ndarray | float,
    offset_s: np.ndarray | float,
) -> np.ndarray:
    """Temperature `offset_s` into a segment that started at `t_start_c` (elementwise)."""
    steady = th.steady_c(dynamic_w)
    tau = th.tau_s
    if tau <= 0.0:
        return np.broadcast_to(steady, np.broadcast(steady, np.asarray(offset_s)).shape).copy()
    return steady + (np.asarray(t_start_c) - steady) * np.exp(-np.asarray(offset_s) / tau)


def relaxation(th: Thermal, t_start_c: float, dynamic_w: float) -> tuple[float, float]:
    """A constant-`dynamic_w` stretch from `t_start_c` as true power a + b exp(-s / tau'):
    (a, b). The energy counter sums its sampled windows in closed form from these."""
    k = th.leakage_w_per_c
    # `steady_c` in float arithmetic (the same operations: the same number)
    steady = (th.ambient_c + th.c_per_w * (float(dynamic_w) - k * th.reference_c)) * th.gain
    a = dynamic_w + th.leakage_w_per_c * (steady - th.reference_c)
    b = th.leakage_w_per_c * (t_start_c - steady) if th.tau_s > 0 else 0.0
    return float(a), float(b)


def settle_time_s(th: Thermal, fraction: float = 0.02) -> float:
    """How long a step takes to come within `fraction` of its final temperature."""
    return th.tau_s * math.log(1.0 / fraction) if th.tau_s > 0 else 0.0
