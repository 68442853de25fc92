"""The twin's physics: roofline step times and a voltage-frequency power model.

Everything is vectorised over a sequence of forward passes so a whole measurement cell
(hundreds of passes) costs a few numpy operations.

step time  = host time + kernel cycles / f + soft-max(compute, memory) + comm
host time  = host overhead x launches + a speculative step's bookkeeping (per step, request, token)
compute    = FLOPs / (tensor peak at f x GEMM efficiency at the pass's token count)
memory     = bytes / achievable bandwidth at f (falls off below the bandwidth knee), a verify
             pass's KV-cache reads at the custom-mask attention's lower efficiency
power      = idle + busy x (SM power + tensor power x tensor util) x s(f) + memory power x bw util
s(f)       = (f / f_max) x (V(f) / V_max)^2   (dynamic CMOS power)
"""

from __future__ import annotations

import collections
import functools
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np

from dvfs.twin.profiles import GpuProfile
from dvfs.twin.scalars import zero_d

#: Exponent of the soft maximum that blends compute and memory time: kernels overlap the two
#: imperfectly near the ridge point, so the transition is smooth rather than a sharp corner.
ROOFLINE_BLEND = 4.0

#: Latency of one all-reduce over NVLink (s), INF.
ALLREDUCE_LATENCY_S = 8e-6


@dataclass(frozen=True, eq=False)
class Passes:
    """A sequence of forward passes as seen by ONE GPU (tensor-parallel shares already applied).

    Compared and hashed by identity (arrays have no single truth value), so that what was
    learnt about one sequence (`operating_point`'s capped clocks, `time_passes`'s clock-free
    terms) can be remembered with it: its arrays are not to be changed once it is made.
    """

    flops: np.ndarray
    bytes: np.ndarray
    layers: np.ndarray
    comm_bytes: np.ndarray
    comm_calls: np.ndarray
    #: Host overheads each pass pays (`GpuProfile.host_overhead_s`: the scheduler's step and
    #: a CUDA-graph replay): 1 for a pass the scheduler launches, less for a draft pass that
    #: runs inside the scheduler's decode step; None: 1 for every pass.
    launches: np.ndarray = None  # type: ignore[assignment]
    #: Tokens each pass multiplies through its weights (the GEMMs' M, `gemm_efficiency`);
    #: 0 (or None): unknown, the profile's large-M efficiency applies.
    tokens: np.ndarray = None  # type: ignore[assignment]
    #: KV-cache bytes (of `bytes`) a verify pass's custom-mask attention reads, at
    #: `GpuProfile.verify_attention_efficiency` of the bandwidth; None: none.
    verify_kv_bytes: np.ndarray = None  # type: ignore[assignment]
    #: Requests, and their tokens, whose speculative step (scheduling, sampling, tree and
    #: KV-slot bookkeeping) the host does on this pass, outside any overlap with the GPU
    #: (`GpuProfile.spec_host_per_request_s`, `spec_host_per_token_s`); None: none.
    spec_requests: np.ndarray = None  # type: ignore[assignment]
    spec_tokens: np.ndarray = None  # type: ignore[assignment]
    #: FLOPs (of `flops`) of the attention's scores and values: not the weight GEMMs, whose
    #: tile and wave quantisation at `tokens` rows (`gemm_efficiency`) does not stretch them;
    #: None: none (every FLOP a weight GEMM's).
    attention_flops: np.ndarray = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        n = len(self.flops)
        if self.launches is None:
            object.__setattr__(self, "launches", np.ones(n))
        for name in (
            "tokens",
            "verify_kv_bytes",
            "spec_requests",
            "spec_tokens",
            "attention_flops",
        ):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.zeros(n))
        for name in Passes.__dataclass_fields__:
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

    def take(self, indices: np.ndarray) -> Passes:
        """The passes at `indices`, in that order (with the clock-free terms `time_passes`
        already derived from these passes, taken alike: they are elementwise)."""
        taken = Passes(*(getattr(self, f)[indices] for f in Passes.__dataclass_fields__))
        known = self.__dict__.get(_CONSTANTS)
        if known is not None:
            taken.__dict__[_CONSTANTS] = (known[0], known[1].take(indices))
        return taken


@dataclass(frozen=True)
class PassTiming:
    """Durations and power of each pass at one SM clock."""

    sm_clock_mhz: float
    duration_s: np.ndarray
    power_w: np.ndarray
    tensor_util: np.ndarray
    memory_util: np.ndarray
    #: Each pass's clock where they differ (the power limit throttled some passes); None:
    #: every pass ran at `sm_clock_mhz`.
    clocks_mhz: np.ndarray | None = None

    def slice(self, start: int, stop: int) -> PassTiming:
        return PassTiming(
            self.sm_clock_mhz,
            self.duration_s[start:stop],
            self.power_w[start:stop],
            self.tensor_util[start:stop],
            self.memory_util[start:stop],
            None if self.clocks_mhz is None else self.clocks_mhz[start:stop],
        )

    @property
    def pass_clocks_mhz(self) -> np.ndarray:
        """The clock of each pass."""
        if self.clocks_mhz is not None:
            return self.clocks_mhz
        return np.full(len(self.duration_s), self.sm_clock_mhz)

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


def gemm_efficiency(gpu: GpuProfile, tokens: float | np.ndarray) -> np.ndarray:
    """Tensor FLOP/s a pass's GEMMs reach over the datasheet peak, at `tokens` rows (M).

    The profile's `gemm_efficiency` is the large-M figure (MAMF). A GEMM is cut into output
    tiles of `gemm_tile_tokens` rows, each computed whole: M tokens pay for ceil(M / tile)
    tiles' rows (tile quantisation). The tiles (`gemm_n_tiles` across the output columns per
    row of tiles) run in waves over the SMs, and the last wave leaves SMs idle (wave
    quantisation). Both are 1 for a profile that sets 0; M <= 0 means unknown: the large-M
    figure. The twin's pass timing and the roofline analysis both call this (through
    `compute_stretch`, for the weight GEMMs' share of a pass's FLOPs), so their ridge points
    agree.
    """
    m = np.asarray(tokens, dtype=float)
    eff = np.full(m.shape, float(gpu.gemm_efficiency))
    known = m > 0
    if not np.any(known) or gpu.gemm_tile_tokens <= 0:
        return eff
    tile = float(gpu.gemm_tile_tokens)
    row_tiles = np.ceil(np.where(known, m, tile) / tile)
    quantised = np.where(known, m, tile) / (row_tiles * tile)
    if gpu.gemm_n_tiles > 0:
        waves = row_tiles * gpu.gemm_n_tiles / gpu.sm_count
        quantised = quantised * waves / np.ceil(waves)
    return np.where(known, eff * quantised, eff)


def compute_stretch(
    gpu: GpuProfile, tokens: np.ndarray, flops: np.ndarray, attention_flops: np.ndarray
) -> np.ndarray:
    """A pass's compute time over its FLOPs' at the large-M GEMM efficiency, elementwise: the
    weight GEMMs' tile and wave quantisation at M = `tokens` rows (`gemm_efficiency`) stretches
    their share of `flops`, not the `attention_flops` (of `flops`), which are the attention's
    own whatever the pass's M. The twin's pass timing (`time_passes`) and the roofline
    analysis's verify ridge both take it from here, so they agree."""
    stretch = gpu.gemm_efficiency / gemm_efficiency(gpu, tokens)
    attention = np.asarray(attention_flops, dtype=float)
    if np.any(attention > 0):
        # Only the weight GEMMs' FLOPs are padded to whole tiles and waves of M = tokens rows.
        # (Stretching the attention's too weighed a prompt's attention by the M of the chunk
        # it ended in: a prompt one token longer, whose last chunk's M rose from 6 to 13,
        # prefilled 34% faster.)
        gemm = flops - attention
        stretch = np.where(
            attention > 0, (gemm * stretch + attention) / np.maximum(flops, 1e-300), stretch
        )
    return stretch


def compute_time_s(
    gpu: GpuProfile, flops: np.ndarray, tokens: np.ndarray, sm_clock_mhz: float | np.ndarray
) -> np.ndarray:
    """Tensor time of `flops` (weight GEMMs' all: no attention, `compute_stretch`) at the GEMM
    efficiency of `tokens` rows, at a clock."""
    peak = gpu.sm_count * gpu.flop_per_clk_per_sm * np.asarray(sm_clock_mhz, dtype=float) * 1e6
    return np.asarray(flops, dtype=float) / (peak * gemm_efficiency(gpu, tokens))


@functools.lru_cache(maxsize=4096)
def _clock_factors(
    gpu: GpuProfile, sm_clock_mhz: float
) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """At a clock (a few recur in every timing): the tensor peak (`GpuProfile.peak_flops`),
    bandwidth, dynamic-power scale and the clock in Hz, and `_profile_factors`, as 0-d
    arrays (`dvfs.twin.scalars`)."""
    at_clock = zero_d(
        gpu.peak_flops(sm_clock_mhz),
        float(bandwidth_bytes_s(gpu, sm_clock_mhz)),
        float(dynamic_scale(gpu, sm_clock_mhz)),
        sm_clock_mhz * 1e6,
    )
    return at_clock, _profile_factors(gpu)


@functools.lru_cache(maxsize=64)
def _profile_factors(gpu: GpuProfile) -> tuple[np.ndarray, ...]:
    """The roofline blend's power and root, the HBM peak (B/s) and the SM, idle, tensor and
    memory powers of `gpu` as 0-d arrays (`dvfs.twin.scalars`)."""
    return zero_d(
        float(ROOFLINE_BLEND),
        1.0 / ROOFLINE_BLEND,
        gpu.hbm_bandwidth_gb_s * 1e9,
        gpu.sm_active_power_w,
        gpu.idle_power_w,
        gpu.tensor_power_w,
        gpu.memory_power_w,
    )


@functools.lru_cache(maxsize=64)
def _clock_table(gpu: GpuProfile) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The supported clocks, ascending, and the bandwidth and dynamic-power scale at each, as
    `bandwidth_bytes_s` and `dynamic_scale` give them for an array of clocks (read-only)."""
    clocks = np.array(sorted(gpu.supported_sm_clocks_mhz()), dtype=float)
    table = clocks, bandwidth_bytes_s(gpu, clocks), dynamic_scale(gpu, clocks)
    for column in table:
        column.flags.writeable = False
    return table


def _clocks_factors(gpu: GpuProfile, clocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`bandwidth_bytes_s` and `dynamic_scale` at each of `clocks`: looked up in
    `_clock_table` when every clock is a supported one (the power limit's search only tries
    those), which is elementwise the same array arithmetic without its powers per pass."""
    bandwidth, scale, _ = _clocks_lookup(gpu, clocks)
    return bandwidth, scale


def _clocks_lookup(
    gpu: GpuProfile, clocks: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """`_clocks_factors`, and where each clock is in `_clock_table`'s clocks (None when one is
    not a supported clock)."""
    known, bandwidth, scale = _clock_table(gpu)
    if len(known):
        at = known.searchsorted(clocks)
        np.minimum(at, len(known) - 1, out=at)
        if np.array_equal(known[at], clocks):
            return bandwidth[at], scale[at], at
    return bandwidth_bytes_s(gpu, clocks), dynamic_scale(gpu, clocks), None


def host_time_s(gpu: GpuProfile, passes: Passes) -> np.ndarray:
    """Each pass's host time, not overlapped with the GPU: its launches' scheduling, and a
    speculative step's bookkeeping (per step, per request and per verified token)."""
    return (
        gpu.host_overhead_s * passes.launches
        + gpu.spec_host_per_step_s * (passes.spec_requests > 0)
        + gpu.spec_host_per_request_s * passes.spec_requests
        + gpu.spec_host_per_token_s * passes.spec_tokens
    )


@dataclass(frozen=True)
class _PassTerms:
    """What `time_passes` derives from a pass sequence whatever the clock, elementwise."""

    #: gemm_efficiency (large M) / gemm_efficiency at the passes' tokens: the tile and wave
    #: quantisation's stretch of the compute time (of its weight GEMMs' share: the attention's
    #: FLOPs are not stretched)
    stretch: np.ndarray
    #: the bytes, a verify pass's KV-cache reads counted at the custom-mask kernel's cost
    memory_bytes: np.ndarray
    #: layers x kernel cycles per layer
    kernel_cycles: np.ndarray
    comm_s: np.ndarray
    host_s: np.ndarray

    def take(self, indices: np.ndarray) -> _PassTerms:
        return _PassTerms(
            self.stretch[indices],
            self.memory_bytes[indices],
            self.kernel_cycles[indices],
            self.comm_s[indices],
            self.host_s[indices],
        )


#: Where `_pass_terms` keeps a sequence's terms: beside the frozen `Passes`'s fields, as
#: functools.cached_property stores (its equality, repr and fields are unchanged).
_CONSTANTS = "_time_passes_terms"


def _pass_terms(gpu: GpuProfile, passes: Passes) -> _PassTerms:
    """The clock-free terms of `time_passes` for `passes` on `gpu`, worked out once per pass
    sequence: a sweep times the same planned round at every clock. Each is the expression
    `time_passes` evaluated inline before, so the numbers are the same to the bit."""
    known = passes.__dict__.get(_CONSTANTS)
    if known is not None and known[0] is gpu:
        return known[1]
    terms = _PassTerms(
        stretch=compute_stretch(gpu, passes.tokens, passes.flops, passes.attention_flops),
        # A verify pass's attention reads the KV cache through a custom-mask (tree) kernel at
        # a fraction of the bandwidth plain decode attention reaches: its bytes take longer.
        memory_bytes=passes.bytes
        + passes.verify_kv_bytes * (1.0 / gpu.verify_attention_efficiency - 1.0),
        kernel_cycles=passes.layers * gpu.kernel_cycles_per_layer,
        comm_s=passes.comm_bytes / (gpu.nvlink_gb_s * 1e9)
        + passes.comm_calls * ALLREDUCE_LATENCY_S,
        host_s=host_time_s(gpu, passes),
    )
    passes.__dict__[_CONSTANTS] = (gpu, terms)
    return terms


def time_passes(gpu: GpuProfile, passes: Passes, sm_clock_mhz: float | np.ndarray) -> PassTiming:
    """Duration and average power of each pass when the SMs run at `sm_clock_mhz` (one clock
    for all passes, or one per pass)."""
    f, clocks, duration_s, power_w, tensor_util, memory_util, at = _timed(gpu, passes, sm_clock_mhz)
    if clocks is None:
        return PassTiming(f, duration_s, power_w, tensor_util, memory_util)
    main = _main_clock(clocks, duration_s) if at is None else _main_known(gpu, at, duration_s)
    return PassTiming(main, duration_s, power_w, tensor_util, memory_util, clocks)


def _timed(
    gpu: GpuProfile, passes: Passes, sm_clock_mhz: float | np.ndarray
) -> tuple[
    float, np.ndarray | None, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None
]:
    """`time_passes`'s numbers: the clock (one for all passes, else 0.0), the per-pass clocks
    (None for one clock), duration, power, tensor and memory utilisation, and where each
    per-pass clock is in `_clock_table` (None for one clock, or a clock not in it).

    The clock-free terms come from `_pass_terms`; the rest is computed in place where an
    intermediate is not needed again, in the same order of operations (the same bits)."""
    clocks: np.ndarray | None = None
    at: np.ndarray | None = None
    f: float | np.ndarray
    peak: float | np.ndarray
    bandwidth: float | np.ndarray
    scale: float | np.ndarray
    f_hz: float | np.ndarray
    if isinstance(sm_clock_mhz, int | float) or np.ndim(sm_clock_mhz) == 0:
        f = float(sm_clock_mhz)
        (peak, bandwidth, scale, f_hz), constants = _clock_factors(gpu, f)
    else:
        clocks = np.asarray(sm_clock_mhz, dtype=float)
        f = clocks
        bandwidth, scale, at = _clocks_lookup(gpu, clocks)
        peak, f_hz = gpu.peak_flops(f), f * 1e6  # type: ignore[arg-type]
        constants = _profile_factors(gpu)
    p, root, hbm_bytes_s, sm_w, idle_w, tensor_w_at_full, memory_w_at_full = constants
    terms = _pass_terms(gpu, passes)
    # The FLOPs at the large-M efficiency (what tensor power follows), then stretched by the
    # pass's tile and wave quantisation (`gemm_efficiency`; as `compute_time_s`).
    useful_s = passes.flops / peak
    compute_s = useful_s * terms.stretch
    memory_s = terms.memory_bytes / bandwidth
    # roofline = (compute^p + memory^p)^(1/p), then + kernel + comm: the busy time
    busy_s = np.power(compute_s, p, out=compute_s)
    busy_s += np.power(memory_s, p, out=memory_s)
    np.power(busy_s, root, out=busy_s)
    busy_s += terms.kernel_cycles / f_hz
    busy_s += terms.comm_s
    duration_s = busy_s + terms.host_s
    per_s = _per_pass_s(duration_s)
    # Tensor power follows the useful FLOPs: the padding of a GEMM's last tile multiplies
    # zeros, which switch little (the same matmul draws less power on zeros, G11), and the
    # SMs a last wave leaves idle draw none; so utilisation is at the large-M efficiency.
    tensor_util = np.divide(useful_s, per_s, out=useful_s)
    memory_util = passes.bytes / per_s
    memory_util /= hbm_bytes_s
    # power = idle + busy x SM power x s + tensor util x tensor power x s + memory util x
    # memory power, summed left to right
    power_w = np.divide(busy_s, per_s, out=busy_s)
    power_w *= sm_w
    power_w *= scale
    power_w += idle_w
    tensor_w = tensor_util * tensor_w_at_full
    tensor_w *= scale
    power_w += tensor_w
    memory_w = np.multiply(memory_util, memory_w_at_full, out=tensor_w)
    power_w += memory_w
    return (
        (0.0 if clocks is not None else float(f)),
        clocks,
        duration_s,
        power_w,
        tensor_util,
        memory_util,
        at,
    )


def _per_pass_s(duration_s: np.ndarray) -> np.ndarray:
    """What `_timed` divides a pass's work by to get its utilisation and power: its duration,
    or 1 s for a pass that takes none (no FLOPs, no bytes, no kernels and no host time: a
    model-free drafter's draft pass on a profile whose `host_overhead_s` is 0), whose work is
    0 too, so it draws idle power rather than 0/0 (NaN, which stalled the cell's energy
    counter). The same array, so the same bits, where every pass takes time."""
    # (np.logical_and.reduce to bool is what ndarray.all calls, without its dispatch)
    if np.logical_and.reduce(duration_s, None, bool):
        return duration_s
    return np.where(duration_s > 0, duration_s, 1.0)


def _utilisations(
    gpu: GpuProfile, passes: Passes, sm_clock_mhz: float, duration_s: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """`_timed`'s tensor and memory utilisation at one clock, from the passes' durations
    there: its steps from those on (the same bits)."""
    (peak, _, _, _), constants = _clock_factors(gpu, float(sm_clock_mhz))
    per_s = _per_pass_s(duration_s)
    tensor_util = passes.flops / peak
    np.divide(tensor_util, per_s, out=tensor_util)
    memory_util = passes.bytes / per_s
    memory_util /= constants[2]  # the HBM peak (B/s)
    return tensor_util, memory_util


def _main_clock(clocks: np.ndarray, duration_s: np.ndarray) -> float:
    """The clock passes spend the most time at (the highest on a tie)."""
    if len(clocks) == 0:
        return 0.0
    values, where = np.unique(clocks, return_inverse=True)
    time_at = np.bincount(where, weights=duration_s, minlength=len(values))
    return float(values[len(values) - 1 - int(np.argmax(time_at[::-1]))])


def _main_known(gpu: GpuProfile, at: np.ndarray, duration_s: np.ndarray) -> float:
    """`_main_clock` of passes at supported clocks, given where each is in `_clock_table`
    (`_clocks_lookup`): the table's clocks the passes use are `np.unique`'s values, in the
    same order, and each one's time is summed over its passes in the same order (the same
    sum), without sorting the passes."""
    if len(at) == 0:
        return 0.0
    known = _clock_table(gpu)[0]
    used = np.bincount(at, minlength=len(known)) > 0
    values = known[used]
    time_at = np.bincount(at, weights=duration_s, minlength=len(known))[used]
    return float(values[len(values) - 1 - int(np.argmax(time_at[::-1]))])


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


def operating_point(
    gpu: GpuProfile,
    passes: Passes,
    requested_mhz: int,
    power_limit_w: float,
    timing: PassTiming | None = None,
) -> OperatingPoint:
    """Each pass at the highest supported clock <= `requested_mhz` at which its own power fits
    the limit (the lowest supported clock when none does); `timing`: the passes' at
    `requested_mhz` when the caller has it (`time_passes` is elementwise: a slice of a longer
    timing is the same).

    A GPU's power controller acts within milliseconds, about one forward pass, so the limit
    holds for every pass, not only on average: a hot verify pass is throttled while the cheap
    draft passes around it keep the requested clock. A pass's power rises with the clock, so
    every pass over the limit is bisected over the supported clocks at once (`_capped_clocks`).
    `sm_clock_mhz`: the clock the passes spend the most time at.
    """
    if timing is None:
        timing = time_passes(gpu, passes, requested_mhz)
    over = np.flatnonzero(timing.power_w > power_limit_w)
    if len(over) == 0:
        return OperatingPoint(int(requested_mhz), False, timing)
    if len(passes) <= CAP_MEMO_MAX_PASSES:
        known = _remembered_cap(gpu, _SameContent(passes))
        return known.point(gpu, over, requested_mhz, power_limit_w)
    return _capped_point(gpu, passes, over, requested_mhz, power_limit_w)


def _capped_point(
    gpu: GpuProfile, passes: Passes, over: np.ndarray, requested_mhz: int, power_limit_w: float
) -> OperatingPoint:
    """`operating_point` of passes some of which (`over`) draw more than the limit."""
    capped = time_passes(gpu, passes, _pass_clocks(gpu, passes, over, requested_mhz, power_limit_w))
    return OperatingPoint(int(capped.sm_clock_mhz), True, capped)


def _pass_clocks(
    gpu: GpuProfile, passes: Passes, over: np.ndarray, requested_mhz: int, power_limit_w: float
) -> np.ndarray:
    """Each pass's clock under the limit (`_capped_point`'s): the requested one, or for those
    at `over` the highest supported one whose power fits (`_capped_clocks`)."""
    clocks = _clocks_up_to(gpu, int(requested_mhz))
    if len(clocks) == 0:
        raise ValueError(f"no supported SM clock at or below {requested_mhz} MHz")
    pass_clocks = np.full(len(passes), float(requested_mhz))
    pass_clocks[over] = _capped_clocks(gpu, passes, over, clocks, power_limit_w)
    return pass_clocks


#: `operating_point` remembers the capped points of phases of at most this many passes by
#: their content (`_remembered_cap`).
CAP_MEMO_MAX_PASSES = 16


class _SameContent:
    """A pass sequence compared and hashed by its content (`_content`): a key under which the
    same passes find what was worked out for another sequence equal to them."""

    __slots__ = ("passes", "key", "_hash")

    def __init__(self, passes: Passes) -> None:
        self.passes = passes
        self.key = _content(passes)
        self._hash = hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SameContent) and self.key == other.key

    def __hash__(self) -> int:
        return self._hash


#: The most capped points `_CappedPoints` keeps for one phase (the oldest dropped past it).
CAP_POINTS_KEPT = 64


class _CappedPoints:
    """The capped points of one short phase's content (`_remembered_cap`): its passes (the
    first sequence seen with that content, whose power table `_capped_clocks` keeps), and
    each point by the requested clock and the clocks the search gave its passes.

    The search's clocks are all a point depends on: the limit enters only through which
    clocks fit it, and the limit a warm die leaves (`TwinDevice.effective_power_limit_w`)
    differs a little at every run, so a point remembered by the limit was never found again.
    The same clocks give the same timing (the same arithmetic on the same numbers), kept
    with read-only arrays (shared)."""

    __slots__ = ("passes", "points", "lock")

    def __init__(self, passes: Passes) -> None:
        self.passes = passes
        self.points: dict[tuple[int, bytes], OperatingPoint] = {}
        self.lock = threading.Lock()  # a local fleet's workers schedule in threads

    def point(
        self, gpu: GpuProfile, over: np.ndarray, requested_mhz: int, power_limit_w: float
    ) -> OperatingPoint:
        """`operating_point` of the phase at the requested clock under the limit, where the
        passes at `over` draw more than it."""
        passes = self.passes
        with self.lock:  # (the power table kept with the passes is replaced as it goes)
            pass_clocks = _pass_clocks(gpu, passes, over, requested_mhz, power_limit_w)
        key = (int(requested_mhz), pass_clocks.tobytes())
        known = self.points.get(key)
        if known is not None:
            return known
        capped = time_passes(gpu, passes, pass_clocks)
        for values in (capped.duration_s, capped.power_w, capped.tensor_util, capped.memory_util):
            values.flags.writeable = False
        if capped.clocks_mhz is not None:
            capped.clocks_mhz.flags.writeable = False
        point = OperatingPoint(int(capped.sm_clock_mhz), True, capped)
        with self.lock:
            self.points[key] = point
            while len(self.points) > CAP_POINTS_KEPT:
                del self.points[next(iter(self.points))]  # the oldest
        return point


@functools.lru_cache(maxsize=1024)
def _remembered_cap(gpu: GpuProfile, phase: _SameContent) -> _CappedPoints:
    """The capped points of a short phase over the limit, remembered by the phase's content
    (`_CappedPoints`, for `gpu`): a sweep's rounds at one knob setting differ in their seeds,
    and so in their decode phases, but their prefill (and short drain) phases are the same
    passes, whose search over the clocks costs far more than their timing."""
    return _CappedPoints(phase.passes)


#: Where `_content` keeps a sequence's content beside its fields (as `_CONSTANTS`).
_CONTENT = "_content_key"


def _content(passes: Passes) -> tuple[tuple[str, bytes], ...]:
    """Every field of `passes` as (dtype, bytes): equal exactly when the passes are, so what
    the same passes give (the same arithmetic on the same numbers) can be looked up by it."""
    known = passes.__dict__.get(_CONTENT)
    if known is None:
        known = tuple(
            (a.dtype.str, a.tobytes())
            for a in (getattr(passes, f) for f in Passes.__dataclass_fields__)
        )
        passes.__dict__[_CONTENT] = known
    return known


#: The most (pass, clock) pairs `_capped_clocks` times in one table; past it, it times the hot
#: passes once per halving instead (a table costs more than the halvings it saves).
CAP_TABLE_MAX = 4096


@functools.lru_cache(maxsize=256)
def _clocks_up_to(gpu: GpuProfile, requested_mhz: int) -> np.ndarray:
    """The supported clocks at or below `requested_mhz`, ascending, as floats (read-only)."""
    clocks = np.array(
        sorted(c for c in gpu.supported_sm_clocks_mhz() if c <= requested_mhz), dtype=np.int64
    ).astype(float)
    clocks.flags.writeable = False
    return clocks


def _capped_clocks(
    gpu: GpuProfile, passes: Passes, over: np.ndarray, clocks: np.ndarray, power_limit_w: float
) -> np.ndarray:
    """The clock of each pass at `over` (the hot passes): the bisection over `clocks`
    (ascending) of the highest one whose power fits the limit, all passes halved together
    (`clocks[0]` when none fits).

    A pass's power at a clock is `time_passes`'s, elementwise the same whatever else is timed
    with it; with few enough (pass, clock) pairs every pair is timed in one call (the hot
    passes taken once per clock straight from `passes`) and the halvings read that table,
    otherwise each halving times the passes at their midpoints. The halvings, and so the
    clocks found, are the same either way."""
    n, m = len(over), len(clocks)
    rows = np.arange(n)
    if n * m <= CAP_TABLE_MAX:
        fit_table = _power_table(gpu, passes, over, clocks) <= power_limit_w
        fitting = fit_table.sum(axis=0)
        if np.array_equal(fit_table, np.arange(m)[:, None] < fitting):
            # Every pass fits up to a clock and not above (the usual shape): there the
            # halvings end, at the highest fitting clock (or at clocks[0] when none fits).
            return clocks[np.maximum(fitting - 1, 0)]

        def fits(mid: np.ndarray) -> np.ndarray:
            return fit_table[mid, rows]
    else:
        hot = passes.take(over)

        def fits(mid: np.ndarray) -> np.ndarray:
            return _timed(gpu, hot, clocks[mid])[3] <= power_limit_w

    lo = np.zeros(n, dtype=np.int64)  # clocks below lo fit
    hi = np.full(n, m - 1, dtype=np.int64)  # clocks above hi do not
    best = np.zeros(n, dtype=np.int64)
    while np.any(lo <= hi):
        searching = lo <= hi
        mid = np.where(searching, (lo + hi) // 2, best)
        ok = fits(mid)
        best = np.where(searching & ok, mid, best)
        lo = np.where(searching & ok, mid + 1, lo)
        hi = np.where(searching & ~ok, mid - 1, hi)
    return clocks[best]


#: Where `_power_table` keeps the last table it timed for a pass sequence (as `_CONSTANTS`).
_POWER_TABLE = "_cap_power_table"


def _power_table(
    gpu: GpuProfile, passes: Passes, over: np.ndarray, clocks: np.ndarray
) -> np.ndarray:
    """The power of each pass at `over` (ascending) at each of `clocks` (ascending, from the
    lowest supported clock up): `_timed`'s, one row per clock. Kept with `passes`: a sweep
    searches the same round at each clock in turn, down from the top, and the passes over
    the limit at a lower clock are mostly among those over it at a higher one, whose table
    then has their rows (a pass's power at a clock is the same whatever else is timed with
    it); another table is timed, and kept, when it has not."""
    n, m = len(over), len(clocks)
    known = passes.__dict__.get(_POWER_TABLE)
    if known is not None and known[0] is gpu:
        _, known_over, known_clocks, table = known
        if m <= len(known_clocks) and np.array_equal(known_clocks[:m], clocks):
            at = known_over.searchsorted(over)
            if at[-1] < len(known_over) and np.array_equal(known_over[at], over):
                return table[:m, at]
    table = _timed(gpu, passes.take(np.tile(over, m)), np.repeat(clocks, n))[3].reshape(m, n)
    table.flags.writeable = False
    passes.__dict__[_POWER_TABLE] = (gpu, over.copy(), clocks, table)
    return table


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
    with a pass over the limit are searched; when none has, that array is the schedule's
    timing.

    Remembered for the last few (phases, clock, limit): a Schedule is immutable, and a cell's
    thermal stabilisation runs the same planned round at the same knobs again and again. A
    limit no pass reaches at the requested clock changes nothing, so every such limit shares
    one schedule: the limit a warm die leaves (`TwinDevice.effective_power_limit_w`) differs
    a little at every run, and would otherwise make each a new schedule (and its thermal terms
    new on every device)."""
    if _peak_power_w(gpu, phases, requested_mhz) <= power_limit_w:
        power_limit_w = _UNREACHED_LIMIT_W
    return _remembered_schedule(gpu, phases, requested_mhz, power_limit_w)


#: The limit `schedule` remembers a schedule under when no pass reaches the one it was given.
_UNREACHED_LIMIT_W = float("inf")


@functools.lru_cache(maxsize=256)
def _peak_power_w(gpu: GpuProfile, phases: tuple[Passes, ...], requested_mhz: int) -> float:
    """The highest power of any of the phases' passes at the requested clock (-inf: none)."""
    whole = _requested_timing(
        gpu, phases[0] if len(phases) == 1 else _joined(phases), requested_mhz
    )
    return float(np.maximum.reduce(whole.power_w)) if len(whole.power_w) else -np.inf


#: Where `_requested_timing` keeps a pass sequence's durations and powers, beside its
#: fields (as `_CONSTANTS`): {(profile, clock): (duration_s, power_w)}.
_REQUESTED = "_requested_timings"
#: The timings kept, oldest first: (their passes, weakly; the key; their arrays' bytes), at
#: most `REQUESTED_TIMINGS_BYTES` in all (a timing goes with its passes, when they go first).
_KEPT: collections.deque[tuple[weakref.ref[Passes], tuple[GpuProfile, float], int]] = (
    collections.deque()
)
_KEPT_SIZE = [0]  # the bytes `_KEPT` counts
_KEPT_LOCK = threading.Lock()  # a local fleet's workers schedule in threads
REQUESTED_TIMINGS_BYTES = 8 << 20
#: The last timing `_requested_timing` worked out, whole: (passes, profile, clock, timing).
#: `schedule` asks for it twice (the peak power, then the schedule), and the second gets it
#: as it is rather than its utilisations worked out again (the same numbers).
_LAST_TIMING: list[tuple[Passes, GpuProfile, float, PassTiming] | None] = [None]


def _requested_timing(gpu: GpuProfile, passes: Passes, requested_mhz: float) -> PassTiming:
    """`time_passes` at a schedule's requested clock, its durations and powers remembered for
    the last few: a sweep runs each planned round at every clock under one power limit, then
    at every clock again under the next, each time from the same timing at the requested
    clock (the same inputs, the same numbers); the utilisations, a few steps from those, are
    worked out again (`_utilisations`: half the memory kept). Read-only arrays, shared by the
    schedules made from them."""
    last = _LAST_TIMING[0]
    if last is not None and last[0] is passes and last[1] is gpu and last[2] == requested_mhz:
        return last[3]
    key = (gpu, requested_mhz)
    kept = passes.__dict__.get(_REQUESTED)
    if kept is not None:
        known = kept.get(key)
        if known is not None:
            duration_s, power_w = known
            tensor_util, memory_util = _utilisations(gpu, passes, requested_mhz, duration_s)
            tensor_util.flags.writeable = memory_util.flags.writeable = False
            timing = PassTiming(float(requested_mhz), duration_s, power_w, tensor_util, memory_util)
            _LAST_TIMING[0] = (passes, gpu, requested_mhz, timing)
            return timing
    timing = time_passes(gpu, passes, requested_mhz)
    for a in (timing.duration_s, timing.power_w, timing.tensor_util, timing.memory_util):
        a.flags.writeable = False
    size = timing.duration_s.nbytes + timing.power_w.nbytes
    with _KEPT_LOCK:
        kept = passes.__dict__.setdefault(_REQUESTED, {})
        if key not in kept:  # (another thread may have kept the same meanwhile)
            kept[key] = (timing.duration_s, timing.power_w)
            _KEPT.append((weakref.ref(passes), key, size))
            _KEPT_SIZE[0] += size
        while _KEPT_SIZE[0] > REQUESTED_TIMINGS_BYTES and _KEPT:
            held, old, old_size = _KEPT.popleft()  # the oldest
            _KEPT_SIZE[0] -= old_size
            gone = held()
            if gone is not None:
                gone.__dict__[_REQUESTED].pop(old, None)
    _LAST_TIMING[0] = (passes, gpu, requested_mhz, timing)
    return timing


@functools.lru_cache(maxsize=64)
def _remembered_schedule(
    gpu: GpuProfile,
    phases: tuple[Passes, ...],
    requested_mhz: int,
    power_limit_w: float,
) -> Schedule:
    """`schedule`, computed."""
    whole = _requested_timing(
        gpu, phases[0] if len(phases) == 1 else _joined(phases), requested_mhz
    )
    # every pass fits the limit (the usual case): no phase needs looking at alone
    # (np.maximum.reduce is what ndarray.max calls, without its dispatch)
    fits = len(whole.power_w) == 0 or np.maximum.reduce(whole.power_w) <= power_limit_w
    points = []
    capped = False
    start = 0
    for phase in phases:
        n = len(phase.flops)  # (`len(phase)`, without its method call)
        timing = whole.slice(start, start + n)
        start += n
        if fits or not n or np.maximum.reduce(timing.power_w) <= power_limit_w:
            points.append(OperatingPoint(int(requested_mhz), False, timing))
        else:
            point = operating_point(gpu, phase, requested_mhz, power_limit_w, timing)
            capped = capped or point.power_capped
            points.append(point)
    if capped:
        return Schedule(tuple(points))
    joined = PassTiming(
        int(requested_mhz), whole.duration_s, whole.power_w, whole.tensor_util, whole.memory_util
    )
    return Schedule(tuple(points), joined)


@dataclass(frozen=True)
class Schedule:
    """Phases of work (prefill, full-batch decode, drain), each at its own operating point.

    GPUs enforce a power limit over short windows, so no pass borrows power from another
    (`operating_point`): a compute-heavy prefill runs slower than the decode tail after it.
    """

    points: tuple[OperatingPoint, ...]
    #: The timing of all passes when it was computed as one, every pass at the requested
    #: clock, no phase capped (see `timing`).
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
            np.concatenate([t.pass_clocks_mhz for t in parts]),
        )

    @functools.cached_property
    def ends_ns(self) -> np.ndarray:
        """When each pass ends, in whole ns after the schedule starts (read-only; computed
        once, as the engine and every device of the node read it)."""
        ends = self.timing.duration_s * 1e9
        # ndarray.round with no decimals is rint, and cumsum is np.add.accumulate: the ufuncs
        # called as they are, without the methods' dispatch
        np.rint(ends, out=ends)
        ends = np.add.accumulate(ends, out=ends).astype(np.int64)
        ends.flags.writeable = False
        return ends

    def per_pass(self, values: list[int] | list[bool], dtype: type) -> np.ndarray:
        """One value per phase, repeated over the phase's passes."""
        lengths = [len(p.timing.duration_s) for p in self.points]
        return np.repeat(np.array(values, dtype=dtype), lengths)

    @property
    def pass_clock_mhz(self) -> np.ndarray:
        if not self.points:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([p.timing.pass_clocks_mhz for p in self.points]).astype(np.int64)

    @property
    def pass_capped(self) -> np.ndarray:
        """Whether each pass belongs to a phase the power limit throttled."""
        return self.per_pass([p.power_capped for p in self.points], bool)

    @property
    def sm_clock_mhz(self) -> int:
        return max(self.points, key=lambda p: p.timing.total_s).sm_clock_mhz

    @property
    def power_capped(self) -> bool:
        return any(p.power_capped for p in self.points)
