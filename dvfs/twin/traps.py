"""NVML's measurement traps as the twin simulates them, and the switches that turn each off.

Each trap is a few `GpuProfile` fields whose zero is the trap off (the exact, history-free twin):

| trap | fields | what it does |
|---|---|---|
| `energy_steps` | `energy_counter_period_s` | the energy counter holds its value between updates |
| `part_time_power` | `power_sampled_s` | the sensor sees only the end of each update period |
| `power_average` | `power_average_s` | `nvmlDeviceGetPowerUsage` averages the last second |
| `thermal_lag` | `thermal_time_constant_s` | the die heats and cools over tens of seconds |
| `leakage` | `leakage_w_per_c` | power rises with the die temperature |
| `idle_clock_power` | `idle_clock_power_w` | an idle GPU locked at a high clock draws more |
| `settle` | `settle_time_s`, `settle_overshoot` | a knob change shows late, and overshoots |

The shipped profiles (`gpus.toml`) turn them all on. `without(profile, "leakage")` gives the
same GPU with that trap off, `without(profile)` with every trap off; `only(profile, ...)` keeps
just the named ones.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from dvfs.twin.physics import dynamic_scale
from dvfs.twin.profiles import TRAPS, GpuProfile, active, only, without

__all__ = ["TRAPS", "active", "idle_power_w", "only", "settle_progress", "without"]


@functools.lru_cache(maxsize=1024)
def idle_power_w(profile: GpuProfile, idle_clock_mhz: float) -> float:
    """Idle power (before leakage's temperature term) with the SMs idling at `idle_clock_mhz`.

    The profile's idle power is read at the idle clock; the clock tree and idling SMs draw
    `idle_clock_power_w` more at the top clock, scaling like dynamic power (f V(f)^2), so an
    idle GPU locked high draws more than one locked low (below the idle clock, slightly less).
    """
    if not profile.idle_clock_power_w or idle_clock_mhz == profile.idle_sm_clock_mhz:
        return profile.idle_power_w
    base = float(dynamic_scale(profile, profile.idle_sm_clock_mhz))
    scale = float(dynamic_scale(profile, idle_clock_mhz))
    return profile.idle_power_w + profile.idle_clock_power_w * (scale - base) / (1.0 - base)


def settle_progress(profile: GpuProfile, elapsed_s: np.ndarray) -> np.ndarray:
    """How far a knob change has gone `elapsed_s` after it (0 at the change, 1 once settled).

    A second-order step response: with overshoot o > 0 it is under-damped with damping
    zeta = -ln o / sqrt(pi^2 + ln^2 o) (so its first peak is 1 + o); with o = 0 it is
    critically damped. Its decay rate puts it within ~2% of the target at `settle_time_s`,
    from which it reads exactly 1 (the GPU has settled; the work runs at the new point).
    """
    elapsed = np.asarray(elapsed_s, dtype=float)
    settle = profile.settle_time_s
    if settle <= 0:
        return np.ones(elapsed.shape)
    s = np.clip(elapsed, 0.0, None)
    o = profile.settle_overshoot
    if o <= 0:
        sigma = 5.8 / settle  # (1 + x) e^-x = 0.02 at x ~ 5.8
        r = 1.0 - np.exp(-sigma * s) * (1.0 + sigma * s)
    else:
        log_o = math.log(o)
        zeta = -log_o / math.sqrt(math.pi**2 + log_o**2)
        sigma = 4.0 / settle  # envelope e^-4 ~ 2%
        omega = sigma * math.sqrt(1.0 - zeta**2) / zeta
        r = 1.0 - np.exp(-sigma * s) * (np.cos(omega * s) + sigma / omega * np.sin(omega * s))
    return np.where(elapsed >= settle, 1.0, r)
