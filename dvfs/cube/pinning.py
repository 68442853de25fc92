"""Whether each drafter's server ran on the GPUs dvfs metered (`gpu_pinning`, as the sweep
checked it: by PID, "verified: ...", or where NVML listed none of its PIDs by where it took its
memory, "verified by memory: ...", else "unverified: why"), and the one line every command says
where a check was unverified or by memory only: those cells were not checked for other
tenants' processes, whose energy the GPU's counter counts.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from dvfs.cube.attrs import merged_sources

#: What a server's pinning outcome says where its memory, not its PIDs, verified it
#: (`dvfs.engines.server_memory.memory_outcome`).
BY_MEMORY = "verified by memory: "

if TYPE_CHECKING:
    import xarray as xr


def _pinning(text: object) -> dict[str, str]:
    """A `gpu_pinning` attribute's drafters and outcomes; empty when it says none."""
    try:
        recorded = json.loads(str(text or "{}"))
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in recorded.items()} if isinstance(recorded, dict) else {}


def gpu_pinning(ds: xr.Dataset) -> dict[str, str]:
    """Each drafter's server pinning ("verified: GPU ...", "verified by memory: GPU ..." or
    "unverified: why"), as the sweep
    recorded it; empty where nothing was checked (simulated GPUs, an older cube). A merged
    cube's sources each keep their own (`merged_from`), so there each drafter is named with
    its GPU ("eagle3 on NVIDIA H100"; the GPUs' label where two sources share a model)."""
    sources = merged_sources(ds)
    if not sources:
        return _pinning(ds.attrs.get("gpu_pinning"))
    names = [str(s.get("gpu_name") or label) for label, s in sources.items()]
    shown: dict[str, str] = {}
    for (label, source), name in zip(sources.items(), names, strict=True):
        gpu = name if names.count(name) == 1 else f"{name} ({label})"
        for drafter, outcome in _pinning(source.get("gpu_pinning")).items():
            shown[f"{drafter} on {gpu}"] = outcome
    return shown or _pinning(ds.attrs.get("gpu_pinning"))


def _by_pid(outcome: str) -> bool:
    """Whether a drafter's outcomes (each server's distinct one, joined by "; ") hold one
    verified by PID ("verified: ...")."""
    return outcome.startswith("verified: ") or "; verified: " in outcome


def pinning_note(ds: xr.Dataset) -> str | None:
    """One line when a drafter's server pinning was unverified, or verified by memory alone
    (None: every one verified by PID, or nothing to check): its cells were not checked for
    other tenants' processes, whose energy the per-GPU counter would have counted into theirs
    (only the server's own PIDs tell a tenant's from the server's)."""
    pinning = gpu_pinning(ds)
    unverified = {d: o for d, o in pinning.items() if "unverified" in o}
    by_memory = [d for d, o in pinning.items() if d not in unverified and BY_MEMORY in o]
    # A merged or resumed cube's drafter whose servers were verified by PID in one shard or
    # session and by memory in another: only the latter's cells went unchecked.
    partly = [d for d in by_memory if _by_pid(pinning[d])]
    by_memory = [d for d in by_memory if d not in partly]
    if not unverified and not by_memory and not partly:
        return None
    servers = "drafter server(s)" if merged_sources(ds) else "drafter(s)"
    said = []
    if unverified:
        why = "; ".join(f"{d}: {o.split('unverified: ', 1)[-1]}" for d, o in unverified.items())
        said.append(f"unverified for {len(unverified)} {servers} ({why})")
    if by_memory:
        said.append(
            f"verified by memory only (NVML's process lists could not tell) for "
            f"{len(by_memory)} {servers} ({', '.join(by_memory)})"
        )
    if partly:
        said.append(
            f"verified by memory only (NVML's process lists could not tell) for some "
            f"servers of {len(partly)} {servers} ({', '.join(partly)}; the others by PID)"
        )
    whose = "their cells" if unverified or by_memory else "those servers' cells"
    return (
        f"GPU pinning {'; '.join(said)}: {whose} were not checked for other tenants' "
        "processes on the metered GPUs (foreign_process)"
    )
