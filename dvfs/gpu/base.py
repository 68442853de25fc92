"""The `Gpu` protocol: the knobs and meters the runner needs, in NVML's units (MHz, mW, mJ).

Both backends (real NVML and the twin) implement it and raise the same `GpuError`s.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

# Clock-event reason bits, as NVML reports them (nvml.h, nvmlClocksEventReason*).
EVENT_GPU_IDLE = 0x1
EVENT_APPLICATIONS_CLOCKS = 0x2
EVENT_SW_POWER_CAP = 0x4
EVENT_HW_SLOWDOWN = 0x8
EVENT_SYNC_BOOST = 0x10
EVENT_SW_THERMAL = 0x20
EVENT_HW_THERMAL = 0x40
EVENT_HW_POWER_BRAKE = 0x80
EVENT_DISPLAY_CLOCKS = 0x100

EVENT_NAMES = {
    EVENT_GPU_IDLE: "GpuIdle",
    EVENT_APPLICATIONS_CLOCKS: "ApplicationsClocksSetting",
    EVENT_SW_POWER_CAP: "SwPowerCap",
    EVENT_HW_SLOWDOWN: "HwSlowdown",
    EVENT_SYNC_BOOST: "SyncBoost",
    EVENT_SW_THERMAL: "SwThermalSlowdown",
    EVENT_HW_THERMAL: "HwThermalSlowdown",
    EVENT_HW_POWER_BRAKE: "HwPowerBrakeSlowdown",
    EVENT_DISPLAY_CLOCKS: "DisplayClockSetting",
}

#: Reasons that mean the GPU was slowed by something other than the knob under test.
EVENT_THROTTLE_MASK = EVENT_HW_SLOWDOWN | EVENT_SW_THERMAL | EVENT_HW_THERMAL | EVENT_HW_POWER_BRAKE


# NVML's perf-policy types (nvml.h, nvmlPerfPolicyType_t): for each, a cumulative counter of the
# nanoseconds that policy held the GPU below its requested clocks, which
# `nvmlDeviceGetViolationStatus` reads (an nvmlViolationTime_t: violationTime in ns,
# referenceTime a CPU timestamp in microseconds). "The difference in violation times at two
# different reference times gives the indication of GPU throttling event" (nvml.h).
PERF_POLICY_POWER = 0
PERF_POLICY_THERMAL = 1
PERF_POLICY_SYNC_BOOST = 2
PERF_POLICY_BOARD_LIMIT = 3
PERF_POLICY_LOW_UTILIZATION = 4
PERF_POLICY_RELIABILITY = 5

#: The policies whose violation time means the GPU was slowed by something other than the knob
#: under test, as `EVENT_THROTTLE_MASK` does for the sampled reasons: thermal (SW and HW thermal
#: slowdown) and the board limit (nvml.h names no policy for HW slowdown or the power brake; the
#: board's own limiter is the nearest). Not POWER: under a power cap (a knob dvfs sets) the
#: power limit is expected to hold the GPU; not SYNC_BOOST (held to a group's clock, as the
#: reasons' mask leaves out), LOW_UTILIZATION (a round's idle edges) or RELIABILITY.
THROTTLE_POLICIES = (PERF_POLICY_THERMAL, PERF_POLICY_BOARD_LIMIT)


def describe_events(mask: int) -> list[str]:
    """Names of the reason bits set in `mask`."""
    return [name for bit, name in EVENT_NAMES.items() if mask & bit]


@dataclass(frozen=True)
class GpuIdentity:
    """Who a GPU is: enough to refuse mixing cubes from different hardware."""

    index: int
    uuid: str
    name: str
    driver_version: str
    backend: str
    memory_clock_mhz: int
    max_sm_clock_mhz: int
    #: Whether the GPU's memory runs with ECC ("on", "off"; "unsupported" where the board has
    #: none): ECC's check bits cost memory bandwidth and energy, and the mode changes only at a
    #: reboot, so a resume may find it changed. "" where not read (the twin, an older dvfs).
    ecc_mode: str = ""
    #: The board's VBIOS version, whose clock and power tables the knobs act through (a
    #: reflashed board may hold other ones); "" where not read.
    vbios_version: str = ""


def canonical_uuid(name: str) -> str:
    """A GPU UUID as NVML writes it ("GPU-" and lower-case hex), whatever case it was pasted
    in (some tools upper-case it: "GPU-181A77A6-..."), so that it opens and matches the GPU
    NVML names; anything else (an index, a MIG name, which dvfs refuses) unchanged."""
    if name[:4].upper() == "GPU-" and len(name) > 4:
        return "GPU-" + name[4:].lower()
    return name


def names_gpu(entry: str, uuid: str) -> bool:
    """Whether the CUDA_VISIBLE_DEVICES entry `entry` names the GPU `uuid`: its UUID in any
    case, or the start of it (`GPU-8932f937`), which CUDA takes for the GPU it alone begins."""
    given, full = canonical_uuid(entry.strip()), canonical_uuid(uuid)
    return given == full or (given.startswith("GPU-") and len(given) > 4 and full.startswith(given))


def unsupported_clock(mhz: int, supported: Collection[int], *, of: str = "") -> str | None:
    """Why `mhz` cannot be locked, or None when it can; the message names the two nearest
    supported clocks, so fixing it is one edit. `of` names the GPU (" of GPU 0")."""
    if mhz in supported:
        return None
    nearest = sorted(sorted(supported, key=lambda c: abs(c - mhz))[:2])
    return (
        f"{mhz} MHz is not a supported SM clock{of}; nearest supported: "
        f"{', '.join(map(str, nearest))} MHz (range {min(supported)}-{max(supported)} MHz)"
    )


def mig_off_advice(indices: Sequence[int]) -> str:
    """The command that turns MIG off on exactly these GPUs: `nvidia-smi -mig 0` without `-i`
    turns it off on every GPU of the host, other tenants' slices included."""
    return " and ".join(f"`sudo nvidia-smi -i {i} -mig 0`" for i in indices)


@dataclass(frozen=True)
class PowerLimitRange:
    """Power-limit constraints of a device (mW, as NVML reports them)."""

    min_mw: int
    max_mw: int
    default_mw: int

    def __post_init__(self) -> None:
        if not self.min_mw <= self.default_mw <= self.max_mw:
            raise ValueError(f"inconsistent power-limit range {self}")

    def describe_w(self) -> str:
        """The allowed range in watts, for messages ("200-700 W")."""
        return f"{self.min_mw / 1000:g}-{self.max_mw / 1000:g} W"

    def outside(self, limit_mw: float) -> str | None:
        """Why `limit_mw` cannot be set, or None when it can: the one power-range rule that the
        backends, campaign checks and caps all apply."""
        if self.min_mw <= limit_mw <= self.max_mw:
            return None
        return f"power limit {limit_mw / 1000:g} W is outside the allowed range {self.describe_w()}"


class Gpu(Protocol):
    """One GPU's knobs and meters. Setters may raise `GpuPermissionError` / `GpuValueError`."""

    @property
    def identity(self) -> GpuIdentity: ...

    def supported_sm_clocks_mhz(self) -> tuple[int, ...]: ...

    def power_limit_range(self) -> PowerLimitRange: ...

    def power_limit_mw(self) -> int:
        """The configured power limit: what `set_power_limit_mw` sets and a restore puts back."""
        ...

    def enforced_power_limit_mw(self) -> int:
        """The limit the GPU enforces (can be lower than configured, e.g. an out-of-band cap)."""
        ...

    def lock_sm_clock(self, min_mhz: int, max_mhz: int) -> None: ...

    def reset_sm_clock(self) -> None: ...

    def set_power_limit_mw(self, limit_mw: int) -> None: ...

    def energy_mj(self) -> int:
        """Monotone energy counter (mJ since driver load)."""
        ...

    def power_mw(self) -> int:
        """Instantaneous board power."""
        ...

    def sm_clock_mhz(self) -> int: ...

    def temperature_c(self) -> int: ...

    def clock_event_reasons(self) -> int: ...

    def throttle_violation_ns(self) -> tuple[int | None, ...]:
        """Nanoseconds, cumulative and monotone, that each `THROTTLE_POLICIES` policy held
        the GPU below its requested clocks, in that order: what the sampled reasons miss
        between two samples shows as a difference of two reads. Each policy's apart, as
        NVML's policies may count the same throttle (`throttle_violation_delta` combines
        their differences). None for a policy the GPU or its driver cannot tell (unknown,
        never a failure)."""
        ...

    def mig_enabled(self) -> bool:
        """Whether MIG is on (dvfs refuses such GPUs: energy is per GPU, not per slice)."""
        ...

    def persistence_mode(self) -> bool | None:
        """Persistence mode (a power limit survives a driver unload only with it); None: unknown."""
        ...

    def info(self) -> DeviceInfo:
        """A read-only snapshot for `dvfs gpu info`; readings the GPU lacks are None."""
        ...

    def compute_pids(self) -> frozenset[int] | None:
        """PIDs of the compute processes on this GPU, as the driver (the host's PID namespace)
        sees them; None: it cannot tell (not supported, not permitted, a simulated GPU)."""
        ...


def gpu_names(gpus: Iterable[Gpu]) -> str:
    """GPUs as messages name them by index ("GPU 0, GPU 2"), one wording for every line."""
    return ", ".join(f"GPU {g.identity.index}" for g in gpus)


#: A GPU's UUID where NVML could not read it (`GpuProcesses.uuid`).
UNREAD_UUID = "?"


@dataclass(frozen=True)
class GpuProcesses:
    """One GPU of the machine and the compute PIDs on it (None: NVML cannot tell, and `why`),
    with its memory as NVML reads it then: where a server that NVML does not list by a PID dvfs
    knows (a container's PID namespace) took its memory (`dvfs.engines.sglang.memory_outcome`)."""

    index: int
    uuid: str
    pids: frozenset[int] | None
    why: str = ""
    #: Its used and total memory (bytes, nvmlDeviceGetMemoryInfo); None: NVML cannot tell
    #: (`memory_why` says why).
    used_bytes: int | None = None
    total_bytes: int | None = None
    memory_why: str = ""
    #: Each listed process's own memory (NVML's usedGpuMemory, bytes), where NVML gives it.
    process_bytes: Mapping[int, int] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class BulkReadings:
    """One GPU's readings at many instants, in NVML's units (int64 arrays, one per instant)."""

    energy_mj: np.ndarray
    power_mw: np.ndarray
    sm_clock_mhz: np.ndarray
    temperature_c: np.ndarray
    reasons: np.ndarray


@runtime_checkable
class BulkReadable(Protocol):
    """A GPU that can answer its readings for an array of instants at once (the twin, whose
    readings are a function of virtual time): the sampler reads a round in one call instead
    of five calls per tick. Real GPUs cannot, and are read one tick at a time."""

    def readings_at(self, t_ns: np.ndarray) -> BulkReadings:
        """Readings at each instant (int64 ns), as the scalar getters would return them then."""
        ...


@runtime_checkable
class FieldReadable(Protocol):
    """A `BulkReadable` GPU that can answer some of its readings alone, for less than all of
    them (the twin: its die temperature needs none of the energy counter's arithmetic)."""

    def fields_at(self, t_ns: np.ndarray, fields: Sequence[str]) -> tuple[np.ndarray, ...]:
        """`readings_at(t_ns)`'s arrays named by `fields` (`BulkReadings` fields), in order."""
        ...


@dataclass(frozen=True)
class DeviceInfo:
    """Everything `dvfs gpu info` shows about a device (read-only)."""

    identity: GpuIdentity
    architecture: int | None
    supported_sm_clocks_mhz: tuple[int, ...]
    supported_memory_clocks_mhz: tuple[int, ...]
    #: None (both): NVML does not support this GPU's power limit (not settable)
    power_limits: PowerLimitRange | None
    power_limit_mw: int | None
    enforced_power_limit_mw: int
    persistence_mode: bool | None
    energy_counter: bool
    sm_clock_mhz: int
    power_mw: int | None
    temperature_c: int | None
    event_reasons: int | None
    mig: bool
    memory_total_bytes: int | None
