"""The roofline the digital twin would measure (`dvfs gpu roofline --twin h100-sxm`).

Each kernel becomes one pass of the twin's physics (`dvfs.twin.physics`) with its FLOPs and
bytes, at the highest clock whose power fits the limit, as a power-capped GPU runs it. No
torch, no GPU: it shows what the command prints on a GPU of that profile, and gives
`dvfs twin fit` a file whose answer is known. Per-pass host overhead and per-layer kernel
cycles are left out, as CUDA graphs and a single kernel leave them out of the measurement.
The die's thermal history is left out too: every kernel runs at the idle steady temperature,
recorded as such, so its power holds no leakage above the idle's (`dvfs twin fit` takes off
only the leakage a recorded temperature rise drew).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from dvfs.roofline.kernels import BenchSpec, plan_kernels
from dvfs.roofline.run import STOCK, KernelResult, Point, RooflineRun
from dvfs.twin import physics, traps
from dvfs.twin.physics import Passes
from dvfs.twin.profiles import GpuProfile
from dvfs.twin.timeline import thermal_of


def simulate(
    profile: GpuProfile,
    spec: BenchSpec,
    clocks_mhz: Sequence[int] = (),
    *,
    power_limit_w: float | None = None,
) -> RooflineRun:
    """Every kernel of `spec` at stock (the top clock) and at each clock, on the twin."""
    gpu = dataclasses.replace(profile, host_overhead_s=0.0, kernel_cycles_per_layer=0.0)
    limit = power_limit_w if power_limit_w is not None else profile.power_limit_default_w
    idle_c = thermal_of(profile).reference_c  # the idle steady state's, where leakage is reckoned
    points = []
    for mhz in (None, *clocks_mhz):
        requested = profile.max_sm_clock_mhz if mhz is None else mhz
        results = []
        for kernel in plan_kernels(spec):
            one = np.ones(1)
            # A GEMM's M is its token count: the twin's GEMM efficiency by tokens applies.
            m = kernel.m * one if kernel.kind == "gemm" else 0 * one
            passes = Passes(
                kernel.flops * one, kernel.bytes * one, 0 * one, 0 * one, 0 * one, tokens=m
            )
            point = physics.operating_point(gpu, passes, requested, limit)
            timing = point.timing
            results.append(
                KernelResult(
                    kernel,
                    float(timing.duration_s[0]),
                    float(timing.power_w[0]),
                    float(point.sm_clock_mhz),
                    idle_c,
                )
            )
        seen = max(r.sm_clock_mhz for r in results)
        clock = float(mhz) if mhz is not None else seen
        setting = STOCK if mhz is None else str(mhz)
        points.append(Point(setting, mhz is not None, clock, float(limit), tuple(results)))
    attrs = {
        "device": "twin",
        "device_name": f"{profile.nvml_name} (twin)",
        "gpu_name": f"{profile.nvml_name} (twin)",
        "twin_profile": profile.key,
        "dtype": spec.dtype,
        "hidden": spec.hidden,
        "intermediate": spec.intermediate,
        "observe_only": 0,
        "idle_power_w": profile.idle_power_w,
        "idle_sm_clock_mhz": float(profile.idle_sm_clock_mhz),
        "idle_temperature_c": idle_c,
        # as a GPU reads right after its stock kernels, still at its top clock
        "raised_idle_power_w": traps.idle_power_w(profile, float(profile.max_sm_clock_mhz)),
        "raised_idle_sm_clock_mhz": float(profile.max_sm_clock_mhz),
        "raised_idle_temperature_c": idle_c,
        "energy_window_s": math.nan,
    }
    note = (
        f"simulated by the digital twin's physics (profile {profile.key}), not measured: "
        "run it on a GPU for the real roofline"
    )
    return RooflineRun(tuple(points), attrs, (note,))
