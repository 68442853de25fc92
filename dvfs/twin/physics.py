"""The twin's physics: roofline step times and a voltage-frequency power model.

Everything is vectorised over a sequence of forward passes so a whole measurement cell
(hundreds of passes) costs a few numpy operations.

step time  = host overhead + kernel cycles / f + soft-max(compute time, memory time) + comm
compute    = FLOPs / (tensor peak at f x GEMM efficiency)
memory     = bytes / achievable bandwidth at f (falls off below the bandwidth knee)
power      = idle + busy x (SM power + tensor power x tensor util) x s(f) + memory power x bw util
s(f)       = (f / f_max) x (V(f) / V_max)^2   (dynamic CMOS power)
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass, field

import numpy as np

from dvfs.twin.profiles import GpuProfile

#: Exponent of the soft maximum that blends compute and memory time: kernels overlap the two
#: imperfectly near the ridge point, so the transition is smooth rather than a sharp corner.
ROOFLINE_BLEND = 4.0

#: Latency of one all-reduce over NVLink (s), INF.
ALLREDUCE_LATENCY_S = 8e-6


@dataclass(frozen=True, eq=False)
class Passes:
    """A sequence of forward passes as seen by ONE GPU (tensor-parallel shares already applied).

    Compared and hashed by identity (arrays have no single truth value), so that what was
    learnt about one sequence (`operating_point`'s capped clocks) can be remembered with it.
    """

    flops: np.ndarray
    bytes: np.ndarray
    layers: np.ndarray
    comm_bytes: np.ndarray
    comm_calls: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.flops)
        for name in ("bytes", "layers", "comm_bytes", "comm_calls"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Passes.{name} has {len(getattr(self, name))} entries, not {n}")

    @staticmethod
    def concat(parts: list[Passes]) -> Passes:
        return Passes(
            *(np.concatenate([getattr(p, f) for p in parts]) for f in Passes.__dataclass_fields__)
        )

    def __len__(self) -> int:
        return len(self.flops)

    def slice(self, start: int, stop: int | None = None) -> Passes:
        return Passes(*(getattr(self, f)[start:stop] for f in Passes.__dataclass_fields__))


@dataclass(frozen=True)
class PassTiming:
    """Durations and power of each pass at one SM clock."""

    sm_clock_mhz: float
    duration_s: np.ndarray
    power_w: np.ndarray
    tensor_util: np.ndarray
    memory_util: np.ndarray

    def slice(self, start: int, stop: int) -> PassTiming:
        return PassTiming(
            self.sm_clock_mhz,
            self.duration_s[start:stop],
            self.power_w[start:stop],
            self.tensor_util[start:stop],
            self.memory_util[start:stop],
        )

    @property
    def energy_j(self) -> float:
        return float(np.dot(self.duration_s, self.power_w))

    @property
    def total_s(self) -> float:
        return float(self.duration_s.sum())

    @property
    def mean_power_w(self) -> float:
        total = self.total_s
        return self.energy_j / total if total > 0 else 0.0


def voltage_v(gpu: GpuProfile, sm_clock_mhz: float | np.ndarray) -> np.ndarray:
    """Core voltage: flat floor up to the knee, then linear to V_max at the top clock."""
    f = np.asarray(sm_clock_mhz, dtype=float)
    span = max(1.0, gpu.max_sm_clock_mhz - gpu.voltage_knee_mhz)
    rise = np.clip((f - gpu.voltage_knee_mhz) / span, 0.0, 1.0)
    return gpu.voltage_min_v + (gpu.voltage_max_v - gpu.voltage_min_v) * rise


def dynamic_scale(gpu: GpuProfile, sm_clock_mhz: float | np.ndarray) -> np.ndarray:
    """f V(f)^2 relative to the top clock: how switching power scales with the clock."""
    f = np.asarray(sm_clock_mhz, dtype=float)
    v = voltage_v(gpu, f)
    return (f / gpu.max_sm_clock_mhz) * (v / gpu.voltage_max_v) ** 2


def bandwidth_bytes_s(gpu: GpuProfile, sm_clock_mhz: float | np.ndarray) -> np.ndarray:
    """Achievable HBM bandwidth at an SM clock: saturates above the knee, falls below it.

    A smooth minimum of the memory system's limit and an SM-issue limit proportional to f,
    normalised so the top clock reaches the profile's achievable fraction of peak.
    """
    f = np.asarray(sm_clock_mhz, dtype=float)
    peak = gpu.hbm_bandwidth_gb_s * 1e9 * gpu.hbm_efficiency

    def shape(x: np.ndarray | float) -> np.ndarray:
        return (1.0 + (gpu.bandwidth_knee_mhz / np.maximum(x, 1.0)) ** 4) ** -0.25

    return peak * shape(f) / shape(float(gpu.max_sm_clock_mhz))


@functools.lru_cache(maxsize=4096)
def _clock_factors(gpu: GpuProfile, sm_clock_mhz: float) -> tuple[float, float]:
    """Bandwidth and dynamic-power scale at a clock: a few clocks recur in every timing."""
    return (
        float(bandwidth_bytes_s(gpu, sm_clock_mhz)),
        float(dynamic_scale(gpu, sm_clock_mhz)),
    )


def time_passes(gpu: GpuProfile, passes: Passes, sm_clock_mhz: float) -> PassTiming:
    """Duration and average power of each pass when the SMs run at `sm_clock_mhz`."""
    f = float(sm_clock_mhz)
    bandwidth, scale = _clock_factors(gpu, f)
    compute_s = passes.flops / gpu.peak_flops(f)
    memory_s = passes.bytes / bandwidth
    p = ROOFLINE_BLEND
    roofline_s = (compute_s**p + memory_s**p) ** (1.0 / p)
    kernel_s = passes.layers * gpu.kernel_cycles_per_layer / (f * 1e6)
    comm_s = passes.comm_bytes / (gpu.nvlink_gb_s * 1e9) + passes.comm_calls * ALLREDUCE_LATENCY_S
    busy_s = roofline_s + kernel_s + comm_s
    duration_s = busy_s + gpu.host_overhead_s
    tensor_util = compute_s / duration_s
    memory_util = (passes.bytes / duration_s) / (gpu.hbm_bandwidth_gb_s * 1e9)
    busy = busy_s / duration_s
    power_w = (
        gpu.idle_power_w
        + busy * gpu.sm_active_power_w * scale
        + tensor_util * gpu.tensor_power_w * scale
        + memory_util * gpu.memory_power_w
    )
    return PassTiming(f, duration_s, power_w, tensor_util, memory_util)


def idle_power_w(gpu: GpuProfile) -> float:
    return gpu.idle_power_w


def temperature_c(gpu: GpuProfile, power_w: float) -> float:
    """Steady-state die temperature at a power draw (no thermal lag: history-free by design)."""
    return gpu.ambient_c + gpu.thermal_c_per_w * power_w


@dataclass(frozen=True)
class OperatingPoint:
    """The clock a workload actually runs at, and whether the power limit pulled it down."""

    sm_clock_mhz: int
    power_capped: bool
    timing: PassTiming


def mean_power_w(gpu: GpuProfile, passes: Passes, sm_clocks_mhz: np.ndarray) -> np.ndarray:
    """Average power of `passes` at each of several clocks at once (as `time_passes` would
    give, to rounding): only the roofline needs a (clocks x passes) array, the rest sums."""
    f = np.asarray(sm_clocks_mhz, dtype=float)
    p = ROOFLINE_BLEND
    peak_flops = np.array([gpu.peak_flops(c) for c in f.tolist()])
    compute_s = passes.flops / peak_flops[:, None]
    memory_s = passes.bytes / bandwidth_bytes_s(gpu, f)[:, None]
    roofline_s = ((compute_s**p + memory_s**p) ** (1.0 / p)).sum(axis=1)
    kernel_s = float(passes.layers.sum()) * gpu.kernel_cycles_per_layer / (f * 1e6)
    comm_s = float(
        (
            passes.comm_bytes / (gpu.nvlink_gb_s * 1e9) + passes.comm_calls * ALLREDUCE_LATENCY_S
        ).sum()
    )
    busy_s = roofline_s + kernel_s + comm_s
    total_s = busy_s + len(passes) * gpu.host_overhead_s
    scale = dynamic_scale(gpu, f)
    # Energy of pass i is duration_i x power_i; the utilisations' durations cancel.
    energy_j = (
        gpu.idle_power_w * total_s
        + busy_s * gpu.sm_active_power_w * scale
        + compute_s.sum(axis=1) * gpu.tensor_power_w * scale
        + float(passes.bytes.sum()) / (gpu.hbm_bandwidth_gb_s * 1e9) * gpu.memory_power_w
    )
    return np.where(total_s > 0, energy_j / np.where(total_s > 0, total_s, 1.0), 0.0)


#: Elements of the (clocks x passes) array one step of the power-cap search may evaluate.
SEARCH_BUDGET = 8192

#: Per pass sequence, per (GPU, power limit): the highest requested clock searched so far and
#: the clock the search settled on. A sweep plans a round once and runs it at every clock
#: under the same limit; the answer for any lower request above that clock is the same.
_CAPPED: weakref.WeakKeyDictionary[Passes, dict[tuple[GpuProfile, float], tuple[int, int]]] = (
    weakref.WeakKeyDictionary()
)


def operating_point(
    gpu: GpuProfile,
    passes: Passes,
    requested_mhz: int,
    power_limit_w: float,
    timing: PassTiming | None = None,
) -> OperatingPoint:
    """Highest supported clock <= `requested_mhz` whose average power fits the limit (the
    lowest supported clock when none does); `timing`: the passes' at `requested_mhz` when the
    caller has it (`time_passes` is elementwise: a slice of a longer timing is the same).

    Real GPUs enforce the limit over short windows; the twin enforces it over the workload's
    average, which is what the energy counter sees. Average power rises with the clock, so
    the search evaluates as many candidate clocks at once as the budget allows, then
    confirms the answer with `time_passes` (and the next clock up on a near tie). A search
    is remembered per pass sequence: the highest clock that fits at or below a request R is
    also the one for any request between it and R (and such a request does not fit).
    """
    known = _CAPPED.get(passes, {}).get((gpu, power_limit_w))
    if known is not None and known[1] < requested_mhz <= known[0]:
        return OperatingPoint(known[1], True, time_passes(gpu, passes, known[1]))
    if timing is None:
        timing = time_passes(gpu, passes, requested_mhz)
    if len(passes) == 0 or timing.mean_power_w <= power_limit_w:
        return OperatingPoint(int(requested_mhz), False, timing)
    clocks = np.array(sorted(c for c in gpu.supported_sm_clocks_mhz() if c <= requested_mhz))
    if len(clocks) == 0:
        raise ValueError(f"no supported SM clock at or below {requested_mhz} MHz")
    per_step = max(2, SEARCH_BUDGET // len(passes))
    lo, hi, best = 0, len(clocks) - 1, -1  # clocks below lo fit; clocks above hi do not
    above_w = math.inf  # the batched power at clock hi + 1
    while lo <= hi:
        if hi - lo + 1 <= per_step:
            probe = np.arange(lo, hi + 1)
        else:
            probe = np.unique(np.linspace(lo, hi, per_step + 2)[1:-1].round().astype(int))
        powers = mean_power_w(gpu, passes, clocks[probe])
        fits = powers <= power_limit_w
        n_fit = int(np.argmin(fits)) if not fits.all() else len(fits)
        if n_fit:
            best = int(probe[n_fit - 1])
            lo = best + 1
        if n_fit < len(probe):
            hi = int(probe[n_fit]) - 1
            above_w = float(powers[n_fit])
    # The batched powers agree with `time_passes` to rounding: settle a near tie exactly.
    timings: dict[int, PassTiming] = {int(requested_mhz): timing}

    def exact(i: int) -> PassTiming:
        clock = int(clocks[i])
        if clock not in timings:
            timings[clock] = time_passes(gpu, passes, clock)
        return timings[clock]

    near_tie = above_w <= power_limit_w * (1.0 + 1e-9)
    while near_tie and best + 1 < len(clocks) and exact(best + 1).mean_power_w <= power_limit_w:
        best += 1
    while best >= 0 and exact(best).mean_power_w > power_limit_w:
        best -= 1
    best = max(best, 0)
    _CAPPED.setdefault(passes, {})[(gpu, power_limit_w)] = (int(requested_mhz), int(clocks[best]))
    return OperatingPoint(int(clocks[best]), True, exact(best))


@functools.lru_cache(maxsize=256)
def _joined(phases: tuple[Passes, ...]) -> Passes:
    """Phases end to end, remembered by identity: a sweep runs each planned round (the same
    `Passes` objects) at every knob setting."""
    return Passes.concat(list(phases))


def schedule(
    gpu: GpuProfile,
    phases: tuple[Passes, ...],
    requested_mhz: int,
    power_limit_w: float,
) -> Schedule:
    """The phases, each at its `operating_point`. Every phase is timed at the requested clock
    in one array (one `time_passes` for the lot, elementwise the same numbers), and only those
    over the limit are searched; when none is, that array is the schedule's timing."""
    whole = time_passes(gpu, phases[0] if len(phases) == 1 else _joined(phases), requested_mhz)
    points = []
    start = 0
    for phase in phases:
        timing = whole.slice(start, start + len(phase))
        start += len(phase)
        if timing.mean_power_w <= power_limit_w:
            points.append(OperatingPoint(int(requested_mhz), False, timing))
        else:
            points.append(operating_point(gpu, phase, requested_mhz, power_limit_w, timing))
    if any(p.power_capped for p in points):
        return Schedule(tuple(points))
    joined = PassTiming(
        int(requested_mhz), whole.duration_s, whole.power_w, whole.tensor_util, whole.memory_util
    )
    return Schedule(tuple(points), joined)


@dataclass(frozen=True)
class Schedule:
    """Phases of work (prefill, full-batch decode, drain), each at its own operating point.

    GPUs enforce a power limit over short windows, so each phase settles at its own clock: a
    compute-heavy prefill cannot borrow power from the decode tail, nor the other way round.
    """

    points: tuple[OperatingPoint, ...]
    #: The timing of all passes when it was computed as one (see `timing`).
    joined: PassTiming | None = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def timing(self) -> PassTiming:
        """All passes in order (sm_clock_mhz: the clock of the longest phase); computed once,
        as the engine and every device of the node read it."""
        if self.joined is not None:
            return self.joined
        main = max(self.points, key=lambda p: p.timing.total_s)
        parts = [p.timing for p in self.points]
        return PassTiming(
            main.sm_clock_mhz,
            np.concatenate([t.duration_s for t in parts]),
            np.concatenate([t.power_w for t in parts]),
            np.concatenate([t.tensor_util for t in parts]),
            np.concatenate([t.memory_util for t in parts]),
        )

    @functools.cached_property
    def ends_ns(self) -> np.ndarray:
        """When each pass ends, in whole ns after the schedule starts (read-only; computed
        once, as the engine and every device of the node read it)."""
        ends = np.cumsum(np.round(self.timing.duration_s * 1e9)).astype(np.int64)
        ends.flags.writeable = False
        return ends

    def per_pass(self, values: list[int] | list[bool], dtype: type) -> np.ndarray:
        """One value per phase, repeated over the phase's passes."""
        lengths = [len(p.timing.duration_s) for p in self.points]
        return np.repeat(np.array(values, dtype=dtype), lengths)

    @property
    def pass_clock_mhz(self) -> np.ndarray:
        return self.per_pass([p.sm_clock_mhz for p in self.points], np.int64)

    @property
    def pass_capped(self) -> np.ndarray:
        return self.per_pass([p.power_capped for p in self.points], bool)

    @property
    def sm_clock_mhz(self) -> int:
        return max(self.points, key=lambda p: p.timing.total_s).sm_clock_mhz

    @property
    def power_capped(self) -> bool:
        return any(p.power_capped for p in self.points)
