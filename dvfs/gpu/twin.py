"""The `Gpu` protocol over a simulated device: NVML's integer units and NVML's refusals."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dvfs.errors import GpuValueError
from dvfs.gpu.base import (
    THROTTLE_POLICIES,
    BulkReadings,
    DeviceInfo,
    GpuIdentity,
    PowerLimitRange,
)
from dvfs.twin.device import TwinDevice
from dvfs.twin.identity import twin_driver_version
from dvfs.twin.scalars import zero_d
from dvfs.twin.timeline import Timeline

#: NVML's milli-units per SI unit, as a 0-d array (`dvfs.twin.scalars`)
(_MILLI,) = zero_d(1000.0)


def twin_gpu_name(nvml_name: str) -> str:
    """The name a twin GPU of a profile reports (its NVML name, marked), which a fleet mixing
    models also names its journal's folder by (`dvfs.fleet.folders.model_folder`)."""
    return f"{nvml_name} (twin)"


class TwinGpu:
    """A twin device seen through the same interface as a real GPU."""

    def __init__(self, device: TwinDevice) -> None:
        self.device = device
        profile = device.profile
        self._identity = GpuIdentity(
            index=device.index,
            uuid=device.uuid,
            name=twin_gpu_name(profile.nvml_name),
            driver_version=twin_driver_version(),  # names the twin (`dvfs.twin.identity`)
            backend="twin",
            memory_clock_mhz=profile.memory_clock_mhz,
            max_sm_clock_mhz=profile.max_sm_clock_mhz,
        )
        self._last: tuple[tuple[object, int], BulkReadings] | None = None

    @property
    def identity(self) -> GpuIdentity:
        return self._identity

    def supported_sm_clocks_mhz(self) -> tuple[int, ...]:
        return self.device.profile.supported_sm_clocks_mhz()

    def power_limit_range(self) -> PowerLimitRange:
        return self.device.profile.power_limit_range()

    def power_limit_mw(self) -> int:
        return round(self.device.power_limit_w * 1000)

    def enforced_power_limit_mw(self) -> int:
        return self.power_limit_mw()

    def lock_sm_clock(self, min_mhz: int, max_mhz: int) -> None:
        supported = self.supported_sm_clocks_mhz()
        lowest, highest = min(supported), max(supported)
        if not (lowest <= min_mhz <= max_mhz <= highest):
            raise GpuValueError(
                f"GPU {self.device.index}: cannot lock SM clocks to {min_mhz}-{max_mhz} MHz; "
                f"supported clocks span {lowest}-{highest} MHz"
            )

        def nearest(mhz: int) -> int:
            return min(supported, key=lambda c: (abs(c - mhz), c))

        self.device.locked_mhz = (nearest(min_mhz), nearest(max_mhz))

    def reset_sm_clock(self) -> None:
        self.device.locked_mhz = None

    def set_power_limit_mw(self, limit_mw: int) -> None:
        problem = self.power_limit_range().outside(limit_mw)
        if problem:
            raise GpuValueError(f"GPU {self.device.index}: {problem}")
        self.device.power_limit_w = limit_mw / 1000

    def readings_at(self, t_ns: np.ndarray) -> BulkReadings:
        """NVML's integers at each instant: energy truncated to mJ, power rounded to mW,
        temperature rounded to degrees (half to even, as `round` does).

        The reading at the last instant asked is remembered with the device's state it was
        read from: a sampler reads a round's end, then the next round's start at the same
        instant with nothing run between, and gets it again (read-only arrays)."""
        t_ns = np.asarray(t_ns, dtype=np.int64)
        timeline = self.device.timeline
        last = self._last
        if t_ns.shape == (1,) and last is not None:
            (seen, at_ns), readings = last
            if seen is timeline and at_ns == int(t_ns[0]):
                return readings
        out = _nvml_units(*timeline.reported(t_ns))
        if t_ns.ndim == 1 and len(t_ns):
            # the last reading's five integers copied into one read-only block, a row each
            block = out.block[:, -1:].copy()
            block.flags.writeable = False
            tail = _from_block(block)
            self._last = ((timeline, int(t_ns[-1])), tail)
            if len(t_ns) == 1:
                return tail
        return out

    def fields_at(self, t_ns: np.ndarray, fields: Sequence[str]) -> tuple[np.ndarray, ...]:
        """`readings_at(t_ns)`'s arrays named by `fields`: the temperature alone from the die's
        temperature alone (a thermal stabilisation's probe reads nothing else), the same
        numbers; any other choice from all the readings."""
        if tuple(fields) == ("temperature_c",):
            temperature_c = self.device.temperature_c_at(np.asarray(t_ns, dtype=np.int64))
            return (np.rint(temperature_c).astype(np.int64),)
        readings = self.readings_at(t_ns)
        return tuple(getattr(readings, f) for f in fields)

    def reading_state(self) -> object:
        """What the readings at any instant come from: the device's timeline, replaced (never
        changed) on every start and knob change."""
        return self.device.timeline

    def readings_of(self, state: object, t_ns: np.ndarray) -> BulkReadings:
        """`readings_at` from a state `reading_state` gave (a past one: what the GPU reported
        at those instants, which were due while it was current)."""
        if state is self.device.timeline:
            return self.readings_at(t_ns)
        assert isinstance(state, Timeline)
        return _nvml_units(*state.reported(np.asarray(t_ns, dtype=np.int64)))

    def energy_mj(self) -> int:
        return int(self.device.energy_j() * 1000)

    def power_mw(self) -> int:
        """Instant power (NVML's instant field, which `NvmlGpu.power_mw` reads)."""
        return round(self.device.power_w() * 1000)

    def power_average_mw(self) -> int:
        """The averaged power (`nvmlDeviceGetPowerUsage`: the last second's on Ampere and
        newer), as NVML reports it; the twin's part-time sensor feeds it."""
        return round(self.device.power_average_w() * 1000)

    def sm_clock_mhz(self) -> int:
        return self.device.sm_clock_mhz()

    def temperature_c(self) -> int:
        return round(self.device.temperature_c())

    def clock_event_reasons(self) -> int:
        return self.device.clock_event_reasons()

    def throttle_violation_ns(self) -> tuple[int | None, ...]:
        """The device's (`TwinDevice.throttle_violation_ns`: 0, as it never throttles but by
        its power limit), for each policy read."""
        return (self.device.throttle_violation_ns(),) * len(THROTTLE_POLICIES)

    def mig_enabled(self) -> bool:
        return False

    def compute_pids(self) -> frozenset[int] | None:
        """None: no server process runs on a simulated GPU (the twin engine is in-process)."""
        return None

    def persistence_mode(self) -> bool | None:
        return None

    def info(self) -> DeviceInfo:
        """What the twin knows; it has no architecture code or memory reading (None)."""
        return DeviceInfo(
            identity=self.identity,
            architecture=None,
            supported_sm_clocks_mhz=self.supported_sm_clocks_mhz(),
            supported_memory_clocks_mhz=(self.identity.memory_clock_mhz,),
            power_limits=self.power_limit_range(),
            power_limit_mw=self.power_limit_mw(),
            enforced_power_limit_mw=self.enforced_power_limit_mw(),
            persistence_mode=self.persistence_mode(),
            energy_counter=True,
            sm_clock_mhz=self.sm_clock_mhz(),
            power_mw=self.power_mw(),
            temperature_c=self.temperature_c(),
            event_reasons=self.clock_event_reasons(),
            mig=self.mig_enabled(),
            memory_total_bytes=None,
        )


class BlockReadings(BulkReadings):
    """`BulkReadings` whose arrays are the rows of one int64 array (`block`: the fields in
    order, a row each): a sampler joins a round's readings in one copy of the blocks
    (`dvfs.measure.sampler.Samples`), not one per field."""

    block: np.ndarray


def _from_block(block: np.ndarray) -> BlockReadings:
    readings = BlockReadings(*block)
    object.__setattr__(readings, "block", block)  # (a frozen dataclass's own way to set)
    return readings


def _nvml_units(
    energy_j: np.ndarray,
    power_w: np.ndarray,
    sm_clock_mhz: np.ndarray,
    temperature_c: np.ndarray,
    reasons: np.ndarray,
) -> BlockReadings:
    """A timeline's reports (`Timeline.reported`) in NVML's integers (see
    `TwinGpu.readings_at`), written into the rows of one int64 block."""
    # np.round with no decimals is rint (half to even), called as the ufunc it is, in place
    # on the product it rounds; a float written into an int64 row is truncated toward zero,
    # as a cast with astype(np.int64) is (the same cast)
    block = np.empty((5, *energy_j.shape), dtype=np.int64)
    block[0] = energy_j * _MILLI
    power_mw = power_w * _MILLI
    block[1] = np.rint(power_mw, out=power_mw)
    block[2] = sm_clock_mhz
    block[3] = np.rint(temperature_c)
    block[4] = reasons
    return _from_block(block)
