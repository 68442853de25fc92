"""Merging cubes of one campaign measured on different GPUs along a new `gpu` dimension."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.cube.schema import COORD_ATTRS, MERGE_MAY_DIFFER, STATUS_MISSING
from dvfs.errors import CubeError
from dvfs.records import now_iso
from dvfs.version import __version__

if TYPE_CHECKING:
    import xarray as xr


def _campaign_attr(ds: xr.Dataset, name: str) -> dict[str, Any]:
    try:
        campaign = json.loads(ds.attrs.get("campaign", ""))
    except ValueError:
        campaign = None
    if not isinstance(campaign, dict) or not campaign:
        raise CubeError(
            f"cannot merge: {name} does not record its campaign, so its workload cannot be "
            "checked; rebuild it with `dvfs cube build`"
        )
    return campaign


def _check_same_workload(first: xr.Dataset, ds: xr.Dataset, first_name: str, name: str) -> None:
    """Refuse cubes of different campaigns (output tokens, clock grid, batches, drafters...):
    their union would be a half-empty cube whose arms measured different things."""
    from dvfs.campaign import measured_differences

    changes = measured_differences(
        _campaign_attr(first, first_name), _campaign_attr(ds, name), ignore=MERGE_MAY_DIFFER
    )
    if changes:
        more = f" (and {len(changes) - 3} more)" if len(changes) > 3 else ""
        raise CubeError(
            f"cannot merge: the campaign differs ({first_name} -> {name}: "
            f"{'; '.join(changes[:3])}{more}); only cubes of one campaign measured on "
            "different GPUs merge"
        )


def merge_cubes(cubes: list[xr.Dataset], names: list[str] | None = None) -> xr.Dataset:
    """Cubes from different GPUs as one, along a new `gpu` dimension (its GPU UUIDs).

    Refused when a provenance key that must match differs (model, engine, method, schema...)
    or when two cubes come from the same GPU. Grids may differ: missing cells are NaN.
    """
    import xarray as xr

    from dvfs.provenance import CHECKED

    if len(cubes) < 2:
        raise CubeError("merging needs at least two cubes")
    names = names or [f"cube {i + 1}" for i in range(len(cubes))]
    first = cubes[0]
    for label, ds in zip(names, cubes, strict=True):
        if "gpu" in ds.dims:
            raise CubeError(f"{label} is already a merged cube; merge the single-GPU cubes")
    for label, ds in zip(names[1:], cubes[1:], strict=True):
        for key in CHECKED:
            if str(ds.attrs.get(key)) != str(first.attrs.get(key)):
                raise CubeError(
                    f"cannot merge: {key} differs ({names[0]}: {first.attrs.get(key)!r}, "
                    f"{label}: {ds.attrs.get(key)!r}); cubes must measure the same thing"
                )
        _check_same_workload(first, ds, names[0], label)
    labels = [str(ds.attrs.get("gpu_uuids", f"gpu-{i}")) for i, ds in enumerate(cubes)]
    if len(set(labels)) != len(labels):
        raise CubeError("two of the cubes come from the same GPU(s); merge different GPUs")
    stripped = [ds.drop_attrs(deep=False) for ds in cubes]
    merged = xr.concat(
        stripped,
        dim="gpu",
        join="outer",
        combine_attrs="drop",
        data_vars="all",
        coords="minimal",
        compat="override",
    )
    merged = merged.assign_coords(gpu=labels)
    for name in merged.data_vars:
        merged[name].attrs = dict(first[name].attrs)
    for name in merged.coords:
        if name in first.coords:
            merged[name].attrs = dict(first[name].attrs)
    merged["gpu"].attrs.update(units=COORD_ATTRS["gpu"][0], long_name=COORD_ATTRS["gpu"][1])
    attrs = {k: first.attrs[k] for k in (*CHECKED, "Conventions") if k in first.attrs}
    attrs.update(
        title="dvfs merged cube",
        dvfs_version=__version__,
        gpu_names=json.dumps([str(ds.attrs.get("gpu_name")) for ds in cubes]),
        gpu_name=str(first.attrs.get("gpu_name")),
        merged_from=json.dumps(
            {
                label: {
                    k: str(ds.attrs.get(k))
                    for k in (
                        "campaign_name",
                        "campaign_hash",
                        "gpu_name",
                        "driver_version",
                        "engine_version",
                        "created",
                        "stock_sm_clock_mhz",
                        "stock_power_limit_w",
                    )
                }
                for label, ds in zip(labels, cubes, strict=True)
            }
        ),
        stock_sm_clock_mhz=max(int(ds.attrs.get("stock_sm_clock_mhz", 0)) for ds in cubes),
        stock_power_limit_w=max(float(ds.attrs.get("stock_power_limit_w", 0)) for ds in cubes),
        campaign=first.attrs.get("campaign", "{}"),
        **{
            key: ", ".join(sorted({str(ds.attrs.get(key, "")) for ds in cubes}))
            for key in ("gpu_backend", "driver_version", "engine_version", "campaign_name")
        },
        server_args=first.attrs.get("server_args", "{}"),
        history=f"{now_iso()} merged {len(cubes)} cubes by dvfs {__version__}",
        created=now_iso(),
    )
    merged.attrs = attrs
    # Cells absent from one GPU's grid: cell_status 0 (missing), integer flags NaN.
    merged["cell_status"] = merged["cell_status"].fillna(STATUS_MISSING).astype(np.int8)
    return merged
