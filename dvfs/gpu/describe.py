"""GPUs as plain data for `dvfs gpu list` and `dvfs gpu info` (and their --json): NVML's
units converted once here (mW to W), so the CLI only renders."""

from __future__ import annotations

from typing import Any

from dvfs.gpu.base import Gpu, describe_events
from dvfs.gpu.knobs import power_limit_or_none


def gpu_summary(g: Gpu) -> dict[str, Any]:
    """`dvfs gpu list`: one GPU's identity (ECC mode and VBIOS too), power limit (W), SM clock
    and MIG mode."""
    ident = g.identity
    mig = g.mig_enabled()
    return {
        "index": ident.index,
        "uuid": ident.uuid,
        "name": ident.name,
        "driver": ident.driver_version,
        # as `gpu_details`: None where not read (the twin; NVML could not say)
        "ecc_mode": ident.ecc_mode or None,
        "vbios_version": ident.vbios_version or None,
        # None: NVML does not support this GPU's power limit
        "power_limit_w": None if (limit := power_limit_or_none(g)) is None else limit / 1000,
        "sm_clock_mhz": g.sm_clock_mhz(),
        "mig": mig,
    }


def gpu_details(g: Gpu) -> dict[str, Any]:
    """`dvfs gpu info`: a `DeviceInfo` as plain data, powers in watts, event reasons named."""
    info = g.info()
    limits = info.power_limits
    return {
        "index": info.identity.index,
        "uuid": info.identity.uuid,
        "name": info.identity.name,
        "driver": info.identity.driver_version,
        # The GPU invariants a resume compares besides these (`dvfs.records.GPU_INVARIANTS`):
        # None where not read (the twin; NVML could not say).
        "ecc_mode": info.identity.ecc_mode or None,
        "vbios_version": info.identity.vbios_version or None,
        "architecture": info.architecture,
        "memory_clock_mhz": info.identity.memory_clock_mhz,
        "supported_sm_clocks_mhz": {
            "max": max(info.supported_sm_clocks_mhz),
            "min": min(info.supported_sm_clocks_mhz),
            "count": len(info.supported_sm_clocks_mhz),
            "values": list(info.supported_sm_clocks_mhz),
        },
        # min, max, default and current None: NVML does not support this GPU's power limit
        "power_limit_w": {
            "min": None if limits is None else limits.min_mw / 1000,
            "max": None if limits is None else limits.max_mw / 1000,
            "default": None if limits is None else limits.default_mw / 1000,
            "current": None if info.power_limit_mw is None else info.power_limit_mw / 1000,
            "enforced": info.enforced_power_limit_mw / 1000,
        },
        "persistence_mode": info.persistence_mode,
        "energy_counter": info.energy_counter,
        "sm_clock_mhz": info.sm_clock_mhz,
        "power_w": None if info.power_mw is None else info.power_mw / 1000,
        "temperature_c": info.temperature_c,
        # None where NVML cannot read them: not "none" (no reason set), which it never said.
        "event_reasons": None
        if info.event_reasons is None
        else describe_events(info.event_reasons),
        "mig": info.mig,
        "memory_total_gib": None
        if info.memory_total_bytes is None
        else round(info.memory_total_bytes / 2**30, 1),
    }
