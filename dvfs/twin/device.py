"""A simulated GPU: knob state, and an energy counter that integrates the power of the work it ran.

Work arrives as a `Passes` sequence starting "now" on the virtual clock; the device answers
readings (energy, power, clock, temperature, event reasons) for later instants by looking up
where they fall in the sequence, the way a sampler thread sees a real GPU. `readings_at` answers
a whole array of instants at once, so a sampler on virtual time reads a round in one call.
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


@dataclass(frozen=True)
class DeviceReadings:
    """What a device reports at an array of instants, in SI units (one element per instant);
    `dvfs.gpu.twin` turns them into NVML's integers."""

    energy_j: np.ndarray
    power_w: np.ndarray
    sm_clock_mhz: np.ndarray
    temperature_c: np.ndarray
    reasons: np.ndarray


@dataclass(frozen=True)
class _Trace:
    """The passes a device is running (at least one): where each starts and ends, the energy
    spent before it, its power, clock and event reasons."""

    start_ns: int
    ends_ns: np.ndarray
    seg_start_ns: np.ndarray
    energy_before_j: np.ndarray
    power_w: np.ndarray
    sm_clock_mhz: np.ndarray
    reasons: np.ndarray

    @classmethod
    def of(cls, start_ns: int, schedule: Schedule) -> _Trace:
        timing = schedule.timing
        ends = start_ns + schedule.ends_ns
        starts = np.concatenate([[start_ns], ends[:-1]]).astype(np.int64)
        cum = np.cumsum(timing.power_w * ((ends - starts) * 1e-9))
        return cls(
            start_ns=start_ns,
            ends_ns=ends,
            seg_start_ns=starts,
            energy_before_j=np.concatenate([[0.0], cum]),  # the last one: the whole trace
            power_w=timing.power_w,
            sm_clock_mhz=schedule.pass_clock_mhz,
            reasons=schedule.per_pass(
                [EVENT_SW_POWER_CAP if p.power_capped else 0 for p in schedule.points], np.int64
            ),
        )

    @property
    def end_ns(self) -> int:
        return int(self.ends_ns[-1])

    def busy(self, t_ns: np.ndarray) -> np.ndarray:
        return (self.start_ns <= t_ns) & (t_ns < self.end_ns)

    def locate(self, t_ns: np.ndarray, idle_w: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per instant: whether the device is busy, its pass (clipped to the last one when it is
        not) and the energy since the trace started (idle power after the work ends)."""
        n = len(self.ends_ns)
        found = np.searchsorted(self.ends_ns, t_ns, side="right")
        busy = (t_ns >= self.start_ns) & (found < n)
        i = np.minimum(found, n - 1)
        inside = self.energy_before_j[i] + self.power_w[i] * (t_ns - self.seg_start_ns[i]) * 1e-9
        after = self.energy_before_j[n] + idle_w * (t_ns - self.end_ns) * 1e-9
        energy = np.where(busy, inside, np.where(t_ns <= self.start_ns, 0.0, after))
        return busy, i, energy


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
        if len(schedule.timing.duration_s):
            self._trace = _Trace.of(now, schedule)

    # -- readings --------------------------------------------------------------------------
    def readings_at(self, t_ns: np.ndarray) -> DeviceReadings:
        """Every reading at each instant of `t_ns` (int64 ns, not before the last `start`): the
        one place that maps time to what the device reports, for single reads and bulk ones."""
        t_ns = np.asarray(t_ns, dtype=np.int64)
        idle_w = self.profile.idle_power_w
        idle_clock = self.profile.idle_sm_clock_mhz
        if self.locked_mhz is not None:
            idle_clock = self.locked_mhz[1]
        trace = self._trace
        busy, i, since_j = self._locate(t_ns)
        if trace is None:
            power = np.full(t_ns.shape, idle_w)
            clock = np.full(t_ns.shape, idle_clock, dtype=np.int64)
            reasons = np.full(t_ns.shape, EVENT_GPU_IDLE, dtype=np.int64)
        else:
            power = np.where(busy, trace.power_w[i], idle_w)
            clock = np.where(busy, trace.sm_clock_mhz[i], idle_clock)
            reasons = np.where(busy, trace.reasons[i], EVENT_GPU_IDLE)
        return DeviceReadings(
            energy_j=self._base_energy_j + since_j,
            power_w=power,
            sm_clock_mhz=clock,
            # elementwise arithmetic: an array of powers gives an array of temperatures
            temperature_c=physics.temperature_c(self.profile, power),  # type: ignore[arg-type]
            reasons=reasons,
        )

    def _locate(self, t_ns: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`_Trace.locate` for the running trace (busy never, pass 0, idle energy without one):
        the energy since the last `start` at each instant."""
        idle_w = self.profile.idle_power_w
        if self._trace is None:
            since_j = idle_w * np.maximum(0, t_ns - self._base_ns) * 1e-9
            return np.zeros(t_ns.shape, dtype=bool), np.zeros(t_ns.shape, dtype=np.intp), since_j
        return self._trace.locate(t_ns, idle_w)

    def _now(self) -> DeviceReadings:
        return self.readings_at(np.array([self.clock.now_ns()], dtype=np.int64))

    def energy_j_at(self, t_ns: int) -> float:
        """The energy counter alone (what `readings_at` reports as energy_j)."""
        _, _, since_j = self._locate(np.array([t_ns], dtype=np.int64))
        return float(self._base_energy_j + since_j[0])

    def energy_j(self) -> float:
        return self.energy_j_at(self.clock.now_ns())

    def power_w(self) -> float:
        return float(self._now().power_w[0])

    def busy(self) -> bool:
        return self._trace is not None and bool(self._trace.busy(np.array(self.clock.now_ns())))

    def sm_clock_mhz(self) -> int:
        return int(self._now().sm_clock_mhz[0])

    def clock_event_reasons(self) -> int:
        return int(self._now().reasons[0])

    def temperature_c(self) -> float:
        return float(self._now().temperature_c[0])


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
        work = tuple(p for p in phases if len(p))
        if not work:
            schedule = Schedule(())
        else:
            per_device = [
                physics.schedule(d.profile, work, d.requested_clock_mhz(), d.power_limit_w)
                for d in self.devices
            ]
            schedule = per_device[0]
            if len(per_device) > 1:  # as `plan` gives phase by phase: the slowest device's point
                schedule = Schedule(
                    tuple(
                        min(points, key=lambda p: p.sm_clock_mhz)
                        for points in zip(*(s.points for s in per_device), strict=True)
                    )
                )
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
