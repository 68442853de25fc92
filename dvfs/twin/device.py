"""A simulated GPU: knob state, and an energy counter that integrates the power of the work it ran.

Work arrives as a `Passes` sequence starting "now" on the virtual clock; the device answers
readings (energy, power, clock, temperature, event reasons) for any later instant by looking
up where that instant falls in the sequence, the way a sampler thread sees a real GPU.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from dvfs.clock import Clock
from dvfs.gpu.base import EVENT_GPU_IDLE, EVENT_SW_POWER_CAP
from dvfs.twin import physics
from dvfs.twin.physics import OperatingPoint, Passes, Schedule
from dvfs.twin.profiles import GpuProfile


@dataclass
class _Trace:
    start_ns: int
    ends_ns: np.ndarray
    power_w: np.ndarray
    cum_energy_j: np.ndarray
    sm_clock_mhz: np.ndarray
    reasons: np.ndarray

    @property
    def end_ns(self) -> int:
        return int(self.ends_ns[-1]) if len(self.ends_ns) else self.start_ns

    def _segment(self, t_ns: int) -> int:
        return int(np.searchsorted(self.ends_ns, t_ns, side="right"))

    def energy_j(self, t_ns: int, idle_w: float) -> float:
        """Energy from trace start to `t_ns` (idle power after the work ends)."""
        if t_ns <= self.start_ns:
            return 0.0
        if t_ns >= self.end_ns:
            tail = self.cum_energy_j[-1] if len(self.cum_energy_j) else 0.0
            return float(tail + idle_w * (t_ns - self.end_ns) * 1e-9)
        i = self._segment(t_ns)
        seg_start = self.start_ns if i == 0 else int(self.ends_ns[i - 1])
        before = 0.0 if i == 0 else float(self.cum_energy_j[i - 1])
        return before + float(self.power_w[i]) * (t_ns - seg_start) * 1e-9

    def busy(self, t_ns: int) -> bool:
        return self.start_ns <= t_ns < self.end_ns

    def power_w_at(self, t_ns: int, idle_w: float) -> float:
        return float(self.power_w[self._segment(t_ns)]) if self.busy(t_ns) else idle_w

    def clock_at(self, t_ns: int) -> int:
        return int(self.sm_clock_mhz[self._segment(t_ns)])

    def reasons_at(self, t_ns: int) -> int:
        return int(self.reasons[self._segment(t_ns)])


def twin_uuid(profile_key: str, index: int) -> str:
    """A stable, GPU-looking UUID per (profile, index), so twin cubes merge like real ones."""
    digest = hashlib.sha256(f"dvfs-twin/{profile_key}/{index}".encode()).hexdigest()
    return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


class TwinDevice:
    """One simulated GPU on a shared virtual clock."""

    def __init__(self, profile: GpuProfile, clock: Clock, index: int = 0) -> None:
        self.profile = profile
        self.clock = clock
        self.index = index
        self.uuid = twin_uuid(profile.key, index)
        self.locked_mhz: tuple[int, int] | None = None
        self.power_limit_w: float = profile.power_limit_default_w
        self._base_energy_j = 0.0
        self._base_ns = clock.now_ns()
        self._trace: _Trace | None = None

    # -- knobs ---------------------------------------------------------------------------------
    def requested_clock_mhz(self) -> int:
        """The clock the device would run at under load, before the power limit."""
        if self.locked_mhz is None:
            return self.profile.max_sm_clock_mhz
        return self.locked_mhz[1]

    # -- work ----------------------------------------------------------------------------------
    def _fold(self, t_ns: int) -> None:
        self._base_energy_j = self.energy_j_at(t_ns)
        self._base_ns = t_ns
        self._trace = None

    def start(self, schedule: Schedule) -> None:
        """Begin executing the scheduled passes at the clock's current instant."""
        now = self.clock.now_ns()
        self._fold(now)
        timing = schedule.timing
        ends = now + np.cumsum(np.round(timing.duration_s * 1e9)).astype(np.int64)
        seg_s = np.diff(np.concatenate([[now], ends])) * 1e-9
        self._trace = _Trace(
            start_ns=now,
            ends_ns=ends,
            power_w=timing.power_w,
            cum_energy_j=np.cumsum(timing.power_w * seg_s),
            sm_clock_mhz=schedule.pass_clock_mhz,
            reasons=np.where(schedule.pass_capped, EVENT_SW_POWER_CAP, 0),
        )

    # -- readings at an instant ----------------------------------------------------------------
    def energy_j_at(self, t_ns: int) -> float:
        idle = self.profile.idle_power_w
        if self._trace is None:
            return self._base_energy_j + idle * max(0, t_ns - self._base_ns) * 1e-9
        return self._base_energy_j + self._trace.energy_j(t_ns, idle)

    def energy_j(self) -> float:
        return self.energy_j_at(self.clock.now_ns())

    def power_w(self) -> float:
        idle = self.profile.idle_power_w
        if self._trace is None:
            return idle
        return self._trace.power_w_at(self.clock.now_ns(), idle)

    def busy(self) -> bool:
        return self._trace is not None and self._trace.busy(self.clock.now_ns())

    def sm_clock_mhz(self) -> int:
        if self.busy():
            assert self._trace is not None
            return self._trace.clock_at(self.clock.now_ns())
        if self.locked_mhz is not None:
            return self.locked_mhz[1]
        return self.profile.idle_sm_clock_mhz

    def clock_event_reasons(self) -> int:
        if self.busy():
            assert self._trace is not None
            return self._trace.reasons_at(self.clock.now_ns())
        return EVENT_GPU_IDLE

    def temperature_c(self) -> float:
        return physics.temperature_c(self.profile, self.power_w())


class TwinNode:
    """The GPUs one tensor-parallel server spans: they run in lock-step at the slowest clock."""

    def __init__(self, devices: list[TwinDevice]) -> None:
        if not devices:
            raise ValueError("a twin node needs at least one device")
        self.devices = devices
        self.profile = devices[0].profile
        self.clock = devices[0].clock

    @property
    def tp_size(self) -> int:
        return len(self.devices)

    def plan(self, passes: Passes) -> OperatingPoint:
        """The operating point the node would reach on `passes` (nothing is started)."""
        points = [
            physics.operating_point(d.profile, passes, d.requested_clock_mhz(), d.power_limit_w)
            for d in self.devices
        ]
        return min(points, key=lambda p: p.sm_clock_mhz)

    def execute(self, *phases: Passes) -> Schedule:
        """Start the phases on every device now, each at its own operating point; the caller
        advances the clock."""
        schedule = Schedule(tuple(self.plan(p) for p in phases if len(p)))
        for device in self.devices:
            device.start(schedule)
        return schedule


class FreeRunningNode:
    """Timing for a twin engine on hardware the twin does not model (e.g. real NVML).

    It runs at the profile's top clock with no power limit: a synthetic load for checking the
    control path, not a measurement.
    """

    def __init__(self, profile: GpuProfile, clock: Clock, tp_size: int = 1) -> None:
        self.profile = profile
        self.clock = clock
        self._tp_size = tp_size

    @property
    def tp_size(self) -> int:
        return self._tp_size

    def execute(self, *phases: Passes) -> Schedule:
        top = self.profile.max_sm_clock_mhz
        return Schedule(
            tuple(
                OperatingPoint(top, False, physics.time_passes(self.profile, p, top))
                for p in phases
                if len(p)
            )
        )
