"""What a cube says of the GPU knobs: which its campaign set (`swept_knobs`), whether dvfs
changed none (`observe_only`), and where a knob was never set, the stock its cells ran at in
words: the stock power limit and where it came from (as found at start, the GPU's default with
a cap dvfs applied lifted, or the limit NVML enforces), the unlocked or as-found SM clock.

`dvfs cube info`, the report, the plots and a merge say the stock setting in these words.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.cube.attrs import gpu_uuids, merged_sources
from dvfs.cube.schema import STATUS_OK
from dvfs.records import knobs_set

if TYPE_CHECKING:
    import xarray as xr


def swept_knobs(ds: xr.Dataset) -> tuple[bool, bool]:
    """Whether the cube's campaign set (SM clock, power limit) or left each at stock
    (`knobs_set`)."""
    return knobs_set(ds.attrs.get("campaign"))


def stock_text(ds: xr.Dataset) -> str:
    """The reference setting in the words every analysis uses (`Reference.describe`), and
    whether the campaign left the SM clock unlocked; each GPU's own in a merged cube."""
    from dvfs.analysis.headroom import reference_setting, single_gpu

    how = "" if swept_knobs(ds)[0] else "; SM clock left unlocked"
    if "gpu" in ds.dims:
        if observe_only(ds):  # not unlocked: each GPU as found, a lock set outside dvfs kept
            how = "; observe-only: dvfs changed no knob, so stock is each GPU as found"
        per_gpu = [
            f"{','.join(u[:12] for u in str(g).split(','))} "
            f"{reference_setting(single_gpu(ds, g)).describe()}"
            for g in ds["gpu"].values
        ]
        return "each GPU's own: " + ", ".join(per_gpu) + how
    ref = reference_setting(ds)
    if observe_only(ds):
        enforced = enforced_stock_text(ds)
        said = f"; stock power limit {enforced}" if enforced else ""
        return ref.describe() + _observed_at(ds, ref.sm_clock, ref.power_limit) + said
    return ref.describe() + how + "; " + stock_limit_text(ds)


def lifted_caps_w(ds: xr.Dataset) -> list[float]:
    """The power limits the sweep found at start that were caps dvfs applied (`dvfs cap
    apply`), lifted while it measured the GPU's own stock (its default limit) and put back at
    its end (`power_limit_found_w`); empty where the limit found was the stock, or the cube's
    dvfs did not record it."""
    value = ds.attrs.get("power_limit_found_w")
    if value is None:
        return []
    try:
        return [float(w) for w in np.atleast_1d(value)]
    except (TypeError, ValueError):
        return []


def lifted_caps_by_gpu(ds: xr.Dataset) -> dict[str, list[float]]:
    """`lifted_caps_w` by the UUID of the GPU each was found on (`power_limit_found_gpus`);
    empty where none was lifted, or the cube's dvfs did not record the GPUs (one number for
    all)."""
    try:
        value = json.loads(str(ds.attrs.get("power_limit_found_gpus") or "{}"))
        return {str(u): [float(w) for w in caps] for u, caps in value.items()}
    except (TypeError, ValueError, AttributeError):
        return {}


def stock_limit_text(ds: xr.Dataset) -> str:
    """Where the stock power limit came from: the limit found at start, or, where that was a
    cap dvfs applied, the GPU's default, the cap lifted while measuring (`lifted_caps_w`)."""
    lifted = lifted_caps_text(ds)
    enforced = enforced_stock_text(ds)
    if enforced:
        return f"stock power limit {enforced}"
    if not lifted:
        return "stock power limit as found at start"
    return (
        f"stock power limit {defaults_text(len(gpu_uuids(ds)))}, not {lifted}, lifted while "
        "measuring and put back after"
    )


def enforced_stock_text(ds: xr.Dataset) -> str | None:
    """Where the stock power limit is the one NVML said was enforced, on GPUs whose power
    limit NVML does not support (`stock_power_limit_enforced`), in words; None where every
    GPU's is its configured limit."""
    uuids = [u for u in str(ds.attrs.get("stock_power_limit_enforced") or "").split(",") if u]
    if not uuids:
        return None
    named = ", ".join(u[:12] for u in uuids)
    return (
        f"as enforced at start: NVML does not support the power limit of {named}, so the "
        "limit in force (nvmlDeviceGetEnforcedPowerLimit) is recorded, never set"
    )


def defaults_text(gpus: int) -> str:
    """Whose default power limit the stock cells ran at: the GPU's, or the GPUs' of a cube of
    several (a fleet's, a merge's)."""
    return "the GPU's default" if gpus < 2 else "the GPUs' defaults"


def lifted_caps_text(ds: xr.Dataset) -> str | None:
    """`lifted_caps_w` in words ("the 450 W found at start: a cap dvfs applied"), each GPU's
    named where the cube has several and records which found which ("the caps found at start
    (450 W on GPU-181a77a6, 500 W on GPU-e3afe299): caps dvfs applied"); None where no cap
    was lifted."""
    caps = lifted_caps_w(ds)
    if not caps:
        return None
    by_gpu = lifted_caps_by_gpu(ds)
    if len(gpu_uuids(ds)) < 2 or not by_gpu:
        return f"the {_watts(caps)} found at start: a cap dvfs applied"
    named = {w for values in by_gpu.values() for w in values}
    unnamed = [w for w in caps if w not in named]  # an earlier dvfs's source's, GPU unsaid
    if len(by_gpu) == 1 and not unnamed:
        [(uuid, values)] = by_gpu.items()
        return f"the {_watts(values)} found at start on {uuid[:12]}: a cap dvfs applied"
    parts = [f"{_watts(values)} on {uuid[:12]}" for uuid, values in by_gpu.items()]
    parts += [_watts([w]) for w in unnamed]
    return f"the caps found at start ({', '.join(parts)}): caps dvfs applied"


def _watts(values: list[float]) -> str:
    return ", ".join(f"{w:g}" for w in values) + " W"


def observe_only(ds: xr.Dataset) -> bool:
    """Whether the cube was measured observe-only (`actuation` 0: dvfs changed no knob); a
    merged cube (a fleet mixing GPU models), which has no `actuation` of its own, where each
    of its sources was (`merged_from`)."""
    if "actuation" not in ds.attrs:
        sources = merged_sources(ds).values()
        return bool(sources) and all(_no_actuation(s.get("actuation")) for s in sources)
    return _no_actuation(ds.attrs["actuation"])


def _no_actuation(value: Any) -> bool:
    try:
        return int(value) == 0
    except (TypeError, ValueError):
        return False


def unset_knob_text(
    dim: str,
    values: str,
    found: bool,
    lifted: str | None = None,
    gpus: int = 1,
    enforced: str | None = None,
) -> str:
    """A knob the campaign never set (`swept_knobs`) in words, beside `values`, the stock value
    its coordinate holds (the unlocked SM clock's maximum, the power limit as found), which
    dvfs never applied. `found`: measured observe-only, where a clock lock set outside dvfs
    stays (not "unlocked"). `lifted`: the power limits found at start where they were caps dvfs
    applied, lifted while the stock cells ran at the GPU's default, in words
    (`lifted_caps_text`); `gpus`: how many GPUs the cube holds (their defaults, several);
    `enforced`: where the stock limit is the one enforced (`enforced_stock_text`)."""
    if dim == "power_limit" and enforced:
        return f"not set: {enforced} ({values})"
    if dim == "power_limit" and lifted:
        return (
            f"not set: {defaults_text(gpus)} ({values}), not {lifted}, lifted while measuring "
            "and put back after"
        )
    if dim == "power_limit":
        return f"not set: as found at start ({values})"
    kept = "as found (observe-only)" if found else "left unlocked"
    return f"not set: {kept}; the cube files its cells under {values}, which is no lock"


def knobs_not_set(ds: xr.Dataset) -> dict[str, str]:
    """Each knob axis the cube's campaign never set, with `unset_knob_text` (a power-limit-only
    cube's SM clock, a clock-only cube's power limit); empty where both were swept, or no
    campaign is recorded."""
    clock_set, limit_set = swept_knobs(ds)
    lifted = lifted_caps_text(ds)
    said = {}
    for dim, unit, swept in (("sm_clock", " MHz", clock_set), ("power_limit", " W", limit_set)):
        if swept or dim not in ds.coords or not ds.sizes.get(dim):
            continue
        values = ", ".join(str(v).removesuffix(".0") for v in ds[dim].values.tolist())
        gpus = len(gpu_uuids(ds))
        said[dim] = unset_knob_text(
            dim, values + unit, observe_only(ds), lifted, gpus, enforced_stock_text(ds)
        )
    return said


def _observed_at(ds: xr.Dataset, clock: int, limit: float) -> str:
    """An observe-only cube's stock in words: the GPU as dvfs found it, filed at the maximum
    clock, with the SM clock its measured cells ran at there (a lock set outside dvfs shows)."""
    said = (
        "; observe-only: dvfs changed no knob, so stock is the GPU as found (a clock lock or "
        "power limit set outside dvfs included)"
    )
    if "sm_clock_observed_mhz" not in ds:
        return said
    at = {"sm_clock": clock, "power_limit": limit}
    ran = ds["sm_clock_observed_mhz"].sel(at).where(ds["cell_status"].sel(at) == STATUS_OK)
    seen = ran.values[np.isfinite(ran.values)]
    if not seen.size:
        return said
    lo, hi = round(float(seen.min())), round(float(seen.max()))
    return said + f"; its SM clock ran at {lo}" + (f"-{hi}" if hi > lo else "") + " MHz"
