"""Running the roofline at stock and at each locked SM clock, through the sweep's safety layer.

The knobs go through the same `KnobController` a sweep uses (snapshot, restore on exit and on
SIGINT/SIGTERM/SIGHUP), and on real GPUs under the same per-GPU lock and state file
(`dvfs.gpu.safety`), so a killed run is undone by `dvfs gpu reset`. Power comes from the NVML
energy counter over a window that starts and ends on counter updates while the kernel keeps
the GPU busy, so the counter's update period does not bias it. The GPU that takes the knobs
and the torch device that runs the kernels are chosen apart: `--device cpu --gpu 0` steps a
(fake) GPU's clocks around CPU kernels, which is how the safety path is tested without CUDA.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from dvfs.errors import CampaignError, GpuError
from dvfs.gpu.base import Gpu, unsupported_clock
from dvfs.gpu.knobs import KnobController, KnobSetting, power_limit_or_none
from dvfs.gpu.visible import Visible
from dvfs.roofline.kernels import (
    BenchSpec,
    Kernel,
    check_device,
    device_name,
    import_torch,
    plan_kernels,
    prepare,
    time_per_call,
)

#: Longest wait for the energy counter to tick (its update period is tens of ms).
TICK_TIMEOUT_S = 0.5

STOCK = "stock"


@dataclass(frozen=True)
class RooflineRequest:
    """One `dvfs gpu roofline` run."""

    spec: BenchSpec
    clocks_mhz: tuple[int, ...] = ()
    gpu: int | str | None = None
    observe_only: bool = False
    energy_window_s: float = 1.0
    settle_s: float = 0.5
    state_dir: Path | None = None
    #: CUDA_VISIBLE_DEVICES the metered GPU is held to (`dvfs.gpu.visible`); None: not held.
    visible: Visible | None = None

    def estimated_s(self) -> float:
        """Roughly how long the measurement takes: each kernel's timing, plus its energy
        window (and the counter's ticks) where energy is read, at every setting."""
        kernels = len(plan_kernels(self.spec))
        energy = self.gpu is not None and self.spec.on_cuda
        per_kernel = self.spec.min_time_s + (self.energy_window_s + 0.2 if energy else 0.0)
        return kernels * (1 + len(self.clocks_mhz)) * per_kernel

    def unrestored(self) -> tuple[list[str], Path]:
        """GPUs this process changed and did not restore (their state files), and where."""
        from dvfs.gpu.safety import StateStore

        store = StateStore(self.state_dir) if self.state_dir else StateStore()
        return store.left_by_this_process(), store.directory


@dataclass(frozen=True)
class KernelResult:
    """One kernel at one setting; the SM clock seen while it ran (a power cap can pull it
    below the lock) and the die's temperature then (its power holds the leakage of that
    temperature), NaN where no GPU was read."""

    kernel: Kernel
    seconds: float
    power_w: float
    sm_clock_mhz: float = math.nan
    temperature_c: float = math.nan


@dataclass(frozen=True)
class Point:
    """The kernels measured at one setting (stock or a locked SM clock)."""

    setting: str
    locked: bool
    sm_clock_mhz: float
    power_limit_w: float
    results: tuple[KernelResult, ...]


@dataclass(frozen=True)
class RooflineRun:
    points: tuple[Point, ...]
    attrs: dict[str, Any]
    notes: tuple[str, ...]


@dataclass(frozen=True)
class Window:
    """What the energy counter saw over one window: joules, seconds, and the SM clock and
    die temperature read in it."""

    joules: float
    seconds: float
    sm_clock_mhz: float
    temperature_c: float = math.nan

    @property
    def power_w(self) -> float:
        return self.joules / self.seconds if self.seconds > 0 else math.nan


def energy_window(
    gpu: Gpu,
    launch: Callable[[], None],
    sync: Callable[[], None],
    window_s: float,
    *,
    sync_every: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> Window:
    """The energy between two counter updates at least `window_s` apart, while `launch` keeps
    the GPU busy throughout; `sync_every` launches the queue is drained, so the host never runs
    seconds ahead of the GPU. The SM clock and the temperature are read mid-window, under load
    (the temperature NaN where the GPU cannot report it)."""
    launches = 0

    def step() -> None:
        nonlocal launches
        launch()
        launches += 1
        if sync_every and launches % sync_every == 0:
            sync()

    def next_tick() -> tuple[int, float]:
        first = gpu.energy_mj()
        deadline = clock() + TICK_TIMEOUT_S
        while True:
            step()
            reading, now = gpu.energy_mj(), clock()
            if reading != first or now > deadline:
                return reading, now

    e0, t0 = next_tick()
    sm_clock = temperature = math.nan
    while clock() - t0 < window_s:
        step()
        if math.isnan(sm_clock) and clock() - t0 >= window_s / 2:
            sm_clock, temperature = float(gpu.sm_clock_mhz()), _temperature(gpu)
    e1, t1 = next_tick()
    sync()
    if math.isnan(sm_clock):
        sm_clock, temperature = float(gpu.sm_clock_mhz()), _temperature(gpu)
    # NaN for a counter that never moved, or went backwards (reset by a driver reload or a
    # GPU reset: the difference is not the energy spent)
    joules = (e1 - e0) / 1000.0 if e1 > e0 else math.nan
    return Window(joules, t1 - t0, sm_clock, temperature)


def _temperature(gpu: Gpu) -> float:
    """The die's temperature in degC, NaN where the GPU cannot report it."""
    from dvfs.errors import GpuNotSupportedError

    try:
        return float(gpu.temperature_c())
    except GpuNotSupportedError:
        return math.nan


def check_clocks(gpu: Gpu, clocks: Sequence[int]) -> None:
    """Refuse clocks the GPU cannot lock, before anything is changed."""
    supported = set(gpu.supported_sm_clocks_mhz())
    for mhz in clocks:
        problem = unsupported_clock(mhz, supported, of=f" of GPU {gpu.identity.index}")
        if problem:
            raise CampaignError(f"--clocks: {problem}")


@contextlib.contextmanager
def guarded(gpu: Gpu, request: RooflineRequest) -> Iterator[KnobController]:
    """The sweep's guard for one GPU: its lock, refusal of unrestored state, a state file
    before the first change, and a controller that restores on exit."""
    from dvfs.caps import AppliedCaps
    from dvfs.gpu.safety import GpuLocks, StateStore, default_state_dir, refuse_root_held

    directory = request.state_dir or default_state_dir()
    store = StateStore(directory, command="gpu roofline")
    with GpuLocks(directory).hold([gpu]):
        refuse_root_held([gpu], directory)  # a user's (observe-only): root's dvfs holds it
        store.refuse_if_pending([gpu])
        check_clocks(gpu, request.clocks_mhz)
        actuation = not request.observe_only
        controller = AppliedCaps(directory).measuring(
            [gpu], actuation=actuation, change_log=store if actuation else None
        )
        with controller as knobs:
            yield knobs


def _measure(
    prepared: Sequence[Any],
    request: RooflineRequest,
    torch: Any,
    gpu: Gpu | None,
    note: Callable[[str], None],
) -> tuple[list[KernelResult], float]:
    """Every kernel at the current setting; the SM clock seen while they ran (NaN unknown)."""
    results = []
    for p in prepared:
        seconds = time_per_call(p, request.spec, torch)
        power = sm_clock = temperature = math.nan
        if gpu is not None and request.spec.on_cuda:
            # Drain the queue every ~50 ms of work: the window then ends with the work.
            every = max(1, int(0.05 / max(seconds * p.calls_per_launch, 1e-9)))
            window = energy_window(gpu, p.launch, p.sync, request.energy_window_s, sync_every=every)
            power, sm_clock = window.power_w, window.sm_clock_mhz
            temperature = window.temperature_c
        elif gpu is not None:
            sm_clock = float(gpu.sm_clock_mhz())
        results.append(KernelResult(p.kernel, seconds, power, sm_clock, temperature))
        watts = "" if math.isnan(power) else f", {power:.0f} W"
        clock = "" if math.isnan(sm_clock) else f" at {sm_clock:.0f} MHz"
        note(f"  {p.kernel.name}: {seconds * 1e6:.1f} us per call{watts}{clock}")
    seen = [r.sm_clock_mhz for r in results if not math.isnan(r.sm_clock_mhz)]
    return results, (max(seen) if seen else math.nan)


def run_roofline(
    request: RooflineRequest,
    *,
    nvml: ModuleType | None = None,
    note: Callable[[str], None] = lambda _: None,
) -> RooflineRun:
    """Measure every kernel at stock, then at each clock of the request (restored after)."""
    torch = import_torch()
    spec = request.spec
    check_device(spec, torch)
    if request.clocks_mhz and request.gpu is None:
        raise CampaignError("--clocks needs a GPU to lock (--gpu INDEX)")
    if request.clocks_mhz and request.observe_only:
        raise CampaignError("--observe-only runs at the stock setting only: drop --clocks")
    notes = []
    if request.gpu is None or not spec.on_cuda:
        notes.append(
            "energy: not measured (NaN): the kernels ran on the CPU, which no NVML energy "
            "counter sees"
            if not spec.on_cuda
            else "energy: not measured (NaN): no NVML GPU to read"
        )
    if request.observe_only:
        notes.append("observe-only: no GPU setting was changed; measured at the stock setting")
    attrs: dict[str, Any] = {
        "device": spec.device,
        "dtype": spec.dtype,
        "hidden": spec.hidden,
        "intermediate": spec.intermediate,
        "torch_version": str(torch.__version__),
        "observe_only": int(request.observe_only),
        "energy_window_s": request.energy_window_s,
    }
    points = []
    with contextlib.ExitStack() as stack:
        gpu: Gpu | None = None
        knobs: KnobController | None = None
        if request.gpu is not None:  # refuse a busy GPU or a bad clock before any warm-up
            from dvfs.gpu.nvml import open_nvml_gpus

            (gpu,) = stack.enter_context(
                open_nvml_gpus([request.gpu], nvml=nvml, visible=request.visible)
            )
            ident = gpu.identity
            attrs.update(gpu_name=ident.name, gpu_uuid=ident.uuid, gpu_index=ident.index)
            attrs.update(driver=ident.driver_version)
            knobs = stack.enter_context(guarded(gpu, request))
        if gpu is not None and spec.on_cuda:
            # Before the kernels are built: their warm-up raises the SM clock, and a GPU
            # stays clocked up for seconds after work (an H200 read 130 W at 1980 MHz there
            # against 80 W at its 345 MHz idle clock). The twin's idle power is the latter.
            idle = _idle(gpu, request.energy_window_s)
            attrs.update(idle_power_w=idle.power_w, idle_sm_clock_mhz=idle.sm_clock_mhz)
            attrs.update(idle_temperature_c=idle.temperature_c)
        weights: dict[tuple[int, int], Any] = {}
        prepared = [prepare(k, spec, torch, weights) for k in plan_kernels(spec)]
        attrs["device_name"] = device_name(spec, torch)
        for mhz in (None, *request.clocks_mhz):
            if knobs is not None:
                knobs.apply(KnobSetting(mhz, None))
            setting = STOCK if mhz is None else str(mhz)
            note(f"setting {setting}")
            if gpu is not None:
                time.sleep(request.settle_s)
            results, seen = _measure(prepared, request, torch, gpu, note)
            if mhz is None and gpu is not None and spec.on_cuda:
                # Right after the stock kernels the clock is still up: the idle power there,
                # against the idle clock's, is what an idle GPU held at a high clock draws.
                raised = _idle(gpu, request.energy_window_s)
                attrs.update(
                    raised_idle_power_w=raised.power_w,
                    raised_idle_sm_clock_mhz=raised.sm_clock_mhz,
                    raised_idle_temperature_c=raised.temperature_c,
                )
            # NaN: no GPU, or one whose power limit NVML does not support (clocks still lock)
            limit_mw = None if gpu is None else power_limit_or_none(gpu)
            limit = math.nan if limit_mw is None else limit_mw / 1000.0
            clock = float(mhz) if mhz is not None else float(seen)
            points.append(Point(setting, mhz is not None, clock, limit, tuple(results)))
    return RooflineRun(tuple(points), attrs, tuple(notes))


def _idle(gpu: Gpu, window_s: float) -> Window:
    """Board power with nothing running, and the SM clock it idled at."""
    try:
        return energy_window(gpu, lambda: time.sleep(0.002), lambda: None, window_s)
    except GpuError as exc:
        raise GpuError(f"the energy counter cannot be read: {exc}") from exc
