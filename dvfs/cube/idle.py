"""A cube's idle power and what it counts: the GPU's power at rest that above-idle energy
subtracts (each GPU's own in a merged cube), the other tenants' processes seen around its
measurement, and whether it fell back to the mean of the instant power readings.

`dvfs cube info` and the report say it in these words (`idle_power_text`).
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from dvfs.cube.attrs import merged_sources

if TYPE_CHECKING:
    import xarray as xr


def idle_foreign_processes(ds: xr.Dataset) -> list[dict[str, Any]]:
    """The other tenants' processes seen around the sessions' opening idle measurements
    (GPU, pid, name, start or end), whose work the cube's idle_power_w counts; empty: none
    seen, or an older cube."""
    try:
        seen = json.loads(str(ds.attrs.get("idle_foreign_processes") or "[]"))
    except ValueError:
        return []
    return [p for p in seen if isinstance(p, dict)] if isinstance(seen, list) else []


def idle_caveat(seen: list[dict[str, Any]]) -> str:
    """What follows the idle power where other tenants' processes were seen around its
    measurement (`idle_foreign_processes`); "" where none was."""
    if not seen:
        return ""
    named = ", ".join(
        dict.fromkeys(
            f"process {p.get('pid')}"
            + (f" ({p['name']})" if p.get("name") else "")
            + f" on GPU {p.get('gpu')}"
            for p in seen
        )
    )
    return f" (not idle: another tenant's {named} ran during it)"


def idle_power_per_gpu(ds: xr.Dataset) -> dict[str, float]:
    """A merged cube's idle power per GPU (W, NaN where a source recorded none), by the GPUs'
    label: the GPUs idle at their own power, so the merged cube keeps each source's in
    `merged_from` and no `idle_power_w` of its own. Empty for one GPU's cube."""
    shown: dict[str, float] = {}
    for label, source in merged_sources(ds).items():
        try:
            shown[label] = float(source.get("idle_power_w", math.nan))
        except (TypeError, ValueError):  # "None": a source that recorded none
            shown[label] = math.nan
    return shown


def idle_foreign_per_gpu(ds: xr.Dataset) -> dict[str, list[dict[str, Any]]]:
    """A merged cube's other tenants seen around each GPU's opening idle measurement, by the
    GPUs' label (its sources' `idle_foreign_processes`, whose GPU indices are each source's
    own); empty for one GPU's cube, or where no source recorded them (an older merge)."""
    seen: dict[str, list[dict[str, Any]]] = {}
    for label, source in merged_sources(ds).items():
        try:
            listed = json.loads(str(source.get("idle_foreign_processes")))
        except ValueError:  # "None": not recorded
            continue
        if isinstance(listed, list):
            seen[label] = [p for p in listed if isinstance(p, dict)]
    return seen


def idle_readings_per_gpu(ds: xr.Dataset) -> dict[str, bool]:
    """A merged cube's GPUs whose opening idle measurement is the mean of the instant power
    readings (their sources' `idle_from_power_readings`), by label: True or False where the
    source records it; empty for one GPU's cube, or where no source recorded it."""
    said: dict[str, bool] = {}
    for label, source in merged_sources(ds).items():
        value = source.get("idle_from_power_readings")
        if value not in (None, "None", ""):
            try:
                said[label] = bool(int(float(str(value))))
            except ValueError:
                continue
    return said


def readings_caveat(from_readings: bool) -> str:
    """What follows the idle power where its measurement fell back to the instant power
    readings (`idle_from_power_readings`); "" where it did not."""
    if not from_readings:
        return ""
    return (
        " (the mean of the instant power readings: an energy counter updated less than twice "
        "while it was measured, or measurement.idle_s = 0 read the power once; less exact)"
    )


def idle_power_text(info: dict[str, Any], fmt: str = ".1f") -> str:
    """The idle power as `dvfs cube info` and the report say it: the cube's, or each GPU's of
    a merged cube ("GPU-47dfcd23 75.0 W, ..."); "" where none is recorded. Other tenants'
    processes seen around its measurement follow (`idle_caveat`)."""
    idle = float(info["idle_power_w"])
    per_gpu = info.get("idle_power_per_gpu") or {}
    tenants = info.get("idle_foreign_per_gpu") or {}
    readings = info.get("idle_readings_per_gpu") or {}
    top = readings_caveat(bool(info.get("idle_from_power_readings")))
    if idle == idle:
        text = f"{idle:{fmt}} W"
    elif any(w == w for w in per_gpu.values()):
        text = ", ".join(
            f"{','.join(u[:12] for u in label.split(','))} "
            + (f"{w:{fmt}} W" if w == w else "not recorded")
            # each GPU's own tenants, where its source says (their GPU index is its own)
            + idle_caveat(tenants.get(label, []))
            + readings_caveat(readings.get(label, False))
            for label, w in per_gpu.items()
        )
        if readings:
            top = ""
        if tenants:
            return text + top
    else:
        return ""
    return text + idle_caveat(info["idle_foreign_processes"]) + top
