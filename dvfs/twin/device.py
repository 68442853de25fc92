"""A simulated GPU: knob state, the work it runs, and what it reports about it.

Work arrives as a `Passes` sequence starting "now" on the virtual clock; the device answers
readings (energy counter, power, clock, temperature, event reasons) for later instants from its
`Timeline` (`dvfs.twin.timeline`), the way a sampler thread sees a real GPU, NVML's traps
included (`dvfs.twin.traps`); `readings_at` answers a whole array of instants at once, so a
sampler on virtual time reads a round in one call. The truth behind the readings (true energy
and power) is kept beside them for tests (`true_energy_j_at`); dvfs's measurement never reads it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import cast

import numpy as np

from dvfs.clock import Clock
from dvfs.gpu.base import EVENT_SW_POWER_CAP
from dvfs.twin import physics, traps
from dvfs.twin import thermal as th
from dvfs.twin.physics import OperatingPoint, Passes, Schedule
from dvfs.twin.profiles import GpuProfile
from dvfs.twin.scalars import zero_d
from dvfs.twin.timeline import Readings, Timeline, Transition, Work, sensor_of, thermal_of

#: A nanosecond in seconds, as a 0-d array (`dvfs.twin.scalars`)
(_NS_S,) = zero_d(1e-9)


#: What a device reports at an array of instants, in SI units (one element per instant), and
#: the truth behind it; `dvfs.gpu.twin` turns the reports into NVML's integers.
DeviceReadings = Readings


def twin_uuid(profile_key: str, index: int) -> str:
    """A stable, GPU-looking UUID per (profile, index), so twin cubes merge like real ones."""
    digest = hashlib.sha256(f"dvfs-twin/{profile_key}/{index}".encode()).hexdigest()
    return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


class TwinDevice:
    """One simulated GPU on a shared virtual clock.

    Setting `locked_mhz` or `power_limit_w` is a knob change: the observed clock moves to the
    new setting over the profile's settle time, and work started before it has settled runs at
    the previous operating point (`TwinNode.execute`).
    """

    def __init__(self, profile: GpuProfile, clock: Clock, index: int = 0) -> None:
        self.profile = profile
        self.clock = clock
        self.index = index
        self.uuid = twin_uuid(profile.key, index)
        self._locked_mhz: tuple[int, int] | None = None
        self._power_limit_w: float = profile.power_limit_default_w
        self._thermal = thermal_of(profile)
        self._sensor = sensor_of(profile, self.uuid)
        self._transition: Transition | None = None
        self._previous: tuple[int, float] = (self.requested_clock_mhz(), self._power_limit_w)
        #: the idle power at the last idle clock asked (`_idle_power_w`)
        self._idle_w: tuple[int, float] | None = None
        #: the last schedule started, and its thermal terms once it started again (`start`)
        self._terms: tuple[Schedule, th.SegmentTerms | None] | None = None
        now = clock.now_ns()
        self._timeline = self._follow(now, None, None, None, None)

    # -- knobs ---------------------------------------------------------------------------------
    @property
    def locked_mhz(self) -> tuple[int, int] | None:
        return self._locked_mhz

    @locked_mhz.setter
    def locked_mhz(self, value: tuple[int, int] | None) -> None:
        if value != self._locked_mhz:
            self._change_knobs(value, self._power_limit_w)

    @property
    def power_limit_w(self) -> float:
        return self._power_limit_w

    @power_limit_w.setter
    def power_limit_w(self, value: float) -> None:
        if value != self._power_limit_w:
            self._change_knobs(self._locked_mhz, value)

    def requested_clock_mhz(self) -> int:
        """The clock the device would run at under load, before the power limit."""
        if self._locked_mhz is None:
            return self.profile.max_sm_clock_mhz
        return self._locked_mhz[1]

    def idle_clock_mhz(self) -> int:
        """The SM clock an idle device shows: the locked clock, else the idle clock."""
        if self._locked_mhz is None:
            return self.profile.idle_sm_clock_mhz
        return self._locked_mhz[1]

    def settled_ns(self) -> int:
        """When the last knob change has settled (work from then on runs at the new setting)."""
        if self._transition is None:
            return self.clock.now_ns()
        return self._transition.at_ns + round(self.profile.settle_time_s * 1e9)

    def previous_knobs(self) -> tuple[int, float]:
        """Requested clock and power limit before the last knob change (what work runs at
        until it settles)."""
        return self._previous

    def effective_power_limit_w(self, limit_w: float | None = None) -> float:
        """The limit left for the power model's draw: leakage above the reference temperature
        (the die now) counts against it, as the GPU's own limiter counts it: exactly (it was
        counted in 5 W steps, so a die 0.02 C warmer could lose 5 W of limit and a higher
        locked clock run a capped round 1.2% slower)."""
        limit = self._power_limit_w if limit_w is None else limit_w
        k = self._thermal.leakage_w_per_c
        if k == 0.0:
            return limit
        temp, _ = self._timeline.state_at(self.clock.now_ns())
        extra = k * (temp - self._thermal.reference_c)
        return limit - extra

    def _change_knobs(self, locked: tuple[int, int] | None, limit_w: float) -> None:
        now = self.clock.now_ns()
        before = self.readings_at(np.array([now], dtype=np.int64))
        self._previous = (self.requested_clock_mhz(), self._power_limit_w)
        self._locked_mhz, self._power_limit_w = locked, limit_w
        if self.profile.settle_time_s > 0:
            self._transition = Transition(now, float(before.sm_clock_mhz[0]))
        work = self._timeline.work.after(now) if self._timeline.work is not None else None
        self._timeline = self._follow(now, work, *self._carry(now))

    # -- work ----------------------------------------------------------------------------------
    def _carry(self, t_ns: int) -> tuple[float, float, tuple[np.ndarray, float] | None]:
        """The state a timeline folded at `t_ns` starts from: temperature, true energy and the
        energy counter's recent values."""
        return self._timeline.fold_state(t_ns)

    def _follow(
        self,
        t_ns: int,
        work: Work | None,
        temperature_c: float | None,
        true_energy_j: float | None,
        counter_start: tuple[np.ndarray, float] | None,
    ) -> Timeline:
        transition = self._transition
        if transition is not None and t_ns >= self.settled_ns():
            transition = self._transition = None
        idle_clock = self.idle_clock_mhz()
        return Timeline(
            self.profile,
            self._thermal,
            self._sensor,
            t_ns,
            temperature_c,
            true_energy_j,
            counter_start,
            work,
            self._idle_power_w(idle_clock),
            idle_clock,
            transition,
        )

    def start(self, schedule: Schedule) -> None:
        """Begin executing the scheduled passes at the clock's current instant (work still
        running is dropped, as before)."""
        now = self.clock.now_ns()
        work = None
        n = len(schedule.timing.duration_s)
        if n:
            # the passes' bounds in one array: now, then each pass's end (the next's start)
            bounds = np.empty(n + 1, dtype=np.int64)
            bounds[0] = now
            ends = np.add(schedule.ends_ns, now, out=bounds[1:])
            bounds.flags.writeable = False  # a timeline keeps it as its segments' starts
            starts = bounds[:n]
            reasons, clocks, duration_s = _pass_arrays(schedule)
            power_w = schedule.timing.power_w
            idle_w = self._idle_power_w(self.idle_clock_mhz())
            # The same schedule again (a stabilising load, run after run): its thermal terms,
            # made at its second start (a schedule run once needs none kept).
            terms = None
            last = self._terms
            if last is not None and last[0] is schedule:
                terms = last[1]
                if terms is None or terms.idle_w != idle_w:
                    terms = th.segment_terms(self._thermal, power_w, duration_s, idle_w)
            self._terms = (schedule, terms)
            work = Work(starts, ends, power_w, clocks, reasons, duration_s, terms, bounds)
        self._timeline = self._follow(now, work, *self._carry(now))

    def _idle_power_w(self, idle_clock_mhz: int) -> float:
        """`traps.idle_power_w` at this device's profile, remembered for the last clock."""
        known = self._idle_w
        if known is None or known[0] != idle_clock_mhz:
            idle_w = traps.idle_power_w(self.profile, idle_clock_mhz)
            known = self._idle_w = (idle_clock_mhz, idle_w)
        return known[1]

    # -- readings --------------------------------------------------------------------------
    @property
    def timeline(self) -> Timeline:
        """What the device does from its last `start` or knob change on (replaced, never
        changed, by the next one): readings at an instant depend on it alone."""
        return self._timeline

    def readings_at(self, t_ns: np.ndarray) -> DeviceReadings:
        """Every reading at each instant of `t_ns` (int64 ns, not before the last `start` or
        knob change): the one place that maps time to what the device reports, for single
        reads and bulk ones (`temperature_c_at` gives its temperatures alone, the same)."""
        return self._timeline.readings(np.asarray(t_ns, dtype=np.int64))

    def temperature_c_at(self, t_ns: np.ndarray) -> np.ndarray:
        """`readings_at(t_ns).temperature_c` alone (int64 ns instants, as there)."""
        return self._timeline.temperature_c(t_ns)

    def _now(self) -> DeviceReadings:
        return self.readings_at(np.array([self.clock.now_ns()], dtype=np.int64))

    def energy_j_at(self, t_ns: int) -> float:
        """What the energy counter reads at `t_ns` (J)."""
        return float(self.readings_at(np.array([t_ns], dtype=np.int64)).energy_j[0])

    def energy_j(self) -> float:
        return self.energy_j_at(self.clock.now_ns())

    def true_energy_j_at(self, t_ns: int) -> float:
        """Ground truth for tests: the exact integral of the true power up to `t_ns` (J), on
        the counter's scale (since the simulated driver loaded). Never read by measurement."""
        return self._timeline.state_at(t_ns)[1]

    def true_energy_j(self) -> float:
        return self.true_energy_j_at(self.clock.now_ns())

    def power_w(self) -> float:
        """The instant power (NVML's instant field): the true power now."""
        return float(self._now().power_w[0])

    def power_average_w(self) -> float:
        """The averaged power reading (`nvmlDeviceGetPowerUsage`: the last second's)."""
        return float(self._now().power_average_w[0])

    def busy(self) -> bool:
        return self._timeline.work is not None and self.clock.now_ns() < self._timeline.end_ns

    def sm_clock_mhz(self) -> int:
        return int(self._now().sm_clock_mhz[0])

    def clock_event_reasons(self) -> int:
        return int(self._now().reasons[0])

    def temperature_c(self) -> float:
        return float(self._now().temperature_c[0])

    def throttle_violation_ns(self) -> int:
        """The violation time of the throttle policies dvfs reads (`THROTTLE_POLICIES`:
        thermal, board limit), as NVML counts it: 0, never growing. The twin's one limiter
        is the power limit (SwPowerCap, NVML's POWER policy, which those leave out); its die
        heats (`dvfs.twin.thermal`) but nothing slows the clock for it, and no board limit
        is modelled, so no pass ever runs thermally throttled (`_pass_arrays`' reasons are
        SwPowerCap or none)."""
        return 0


def _pass_arrays(schedule: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per pass of `schedule`: its event reasons, its clock (MHz) and its duration (s) as the
    clock runs it (between whole-ns ends: a pass's end less its start, wherever it starts).
    Made once per schedule (read-only) and kept with it, beside its cached properties: every
    device of a node starts the same schedule, and a stabilising load the same one again."""
    known = schedule.__dict__.get("_pass_arrays")
    if known is not None:
        return cast(tuple[np.ndarray, np.ndarray, np.ndarray], known)
    n = len(schedule.timing.duration_s)
    if schedule.joined is not None:  # every pass at the one requested clock, none capped
        reasons = np.zeros(n, dtype=np.int64)
        clocks = np.empty(n, dtype=np.int64)  # (np.full's own two steps)
        clocks.fill(int(schedule.joined.sm_clock_mhz))
    else:  # `pass_clock_mhz`, from the clocks `timing` has already joined
        if schedule.power_capped:
            reasons = schedule.per_pass(
                [EVENT_SW_POWER_CAP if p.power_capped else 0 for p in schedule.points], np.int64
            )
        else:
            reasons = np.zeros(n, dtype=np.int64)
        clocks = schedule.timing.pass_clocks_mhz.astype(np.int64)
    ends = schedule.ends_ns
    steps = np.empty(n, dtype=np.int64)
    steps[0] = ends[0]
    np.subtract(ends[1:], ends[:-1], out=steps[1:])
    duration_s = np.multiply(steps, _NS_S)
    for a in (reasons, clocks, duration_s):
        a.flags.writeable = False
    schedule.__dict__["_pass_arrays"] = (reasons, clocks, duration_s)
    return reasons, clocks, duration_s


class TwinNode:
    """The GPUs one tensor-parallel server spans: they run in lock-step at the slowest clock."""

    def __init__(self, devices: list[TwinDevice]) -> None:
        if not devices:
            raise ValueError("a twin node needs at least one device")
        self.devices = devices
        self.profile = devices[0].profile
        self.clock = devices[0].clock
        #: the devices' last schedules and the node's schedule made of them (`_slowest`)
        self._slowest: tuple[tuple[Schedule, ...], Schedule] | None = None

    @property
    def tp_size(self) -> int:
        return len(self.devices)

    def plan(self, passes: Passes, *, previous: bool = False) -> OperatingPoint:
        """The operating point the node would reach on `passes` (nothing is started); with
        `previous`, at the knobs before the last change (work that starts before it settles)."""
        points = []
        for d in self.devices:
            requested, limit = d.previous_knobs() if previous else (d.requested_clock_mhz(), None)
            points.append(
                physics.operating_point(
                    d.profile, passes, requested, d.effective_power_limit_w(limit)
                )
            )
        return _slowest(points)

    def execute(self, *phases: Passes) -> Schedule:
        """Start the phases on every device now, each at its own operating point; the caller
        advances the clock. Passes that start before a knob change has settled run at the
        previous knobs' operating point (a phase straddling the instant is split in two)."""
        work = tuple([p for p in phases if len(p.flops)])  # (`len(p)` without its call)
        devices = self.devices
        if len(devices) == 1:
            settled_ns = devices[0].settled_ns()
        else:
            settled_ns = max(d.settled_ns() for d in devices)
        if not work:
            schedule = Schedule(())
        elif settled_ns > self.clock.now_ns():
            schedule = Schedule(self._settling(work, settled_ns - self.clock.now_ns()))
        else:
            per_device = [
                physics.schedule(
                    d.profile, work, d.requested_clock_mhz(), d.effective_power_limit_w()
                )
                for d in self.devices
            ]
            schedule = per_device[0] if len(per_device) == 1 else self._slowest_of(per_device)
        for device in self.devices:
            device.start(schedule)
        return schedule

    def _slowest_of(self, per_device: list[Schedule]) -> Schedule:
        """The devices' schedules as one, phase by phase the slowest device's point (as `plan`
        gives it). The same one again for the same schedules (a Schedule is immutable, and the
        physics gives the same inputs the same Schedule): a load run again and again then
        starts one schedule, whose per-pass arrays and thermal terms each device keeps."""
        last = self._slowest
        if (
            last is not None
            and len(last[0]) == len(per_device)
            and all(a is b for a, b in zip(last[0], per_device, strict=True))
        ):
            return last[1]
        phases = zip(*(s.points for s in per_device), strict=True)
        schedule = Schedule(tuple(_slowest(points) for points in phases))
        self._slowest = (tuple(per_device), schedule)
        return schedule

    def _settling(self, phases: tuple[Passes, ...], left_ns: int) -> tuple[OperatingPoint, ...]:
        """Operating points of phases that start `left_ns` before the knobs settle."""
        points: list[OperatingPoint] = []
        elapsed_ns = 0
        for phase in phases:
            if elapsed_ns >= left_ns:
                points.append(self.plan(phase))
                continue
            old = self.plan(phase, previous=True)
            ends = elapsed_ns + np.cumsum(np.round(old.timing.duration_s * 1e9))
            starts = np.concatenate([[elapsed_ns], ends[:-1]])
            cut = int(np.searchsorted(starts, left_ns, side="left"))  # passes starting before
            if cut >= len(phase):
                points.append(old)
                elapsed_ns = int(ends[-1])
                continue
            head = self.plan(phase.slice(0, cut), previous=True)
            rest = self.plan(phase.slice(cut))
            points.extend([head, rest])
            elapsed_ns += round(head.timing.total_s * 1e9) + round(rest.timing.total_s * 1e9)
        return tuple(points)


def _slowest(points: Sequence[OperatingPoint]) -> OperatingPoint:
    """The node's point among its devices' for one phase: tensor-parallel ranks wait for each
    other, so the lowest clock sets the pace (the first of equals, as `min` keeps it)."""
    return min(points, key=lambda p: p.sm_clock_mhz)


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
