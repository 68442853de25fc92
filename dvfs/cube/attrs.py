"""Readers of what a cube's attributes record beyond one plain value: a JSON attribute, a
merged cube's sources (`merged_from`), the UUIDs of its GPUs, the drafters its campaign runs
without speculation.

Every module that says something of a cube (its summary, the advice on its cells left, its
idle power, its GPU pinning, its stock setting, a merge) reads these alike, and forgives a
hand-edited or older cube the same way: here, so that none reads one of them its own way.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xarray as xr


def gpu_uuids(ds: xr.Dataset) -> list[str]:
    """The UUIDs of the GPUs the cube's cells ran on: its `gpu_uuids`, or a cube merged across
    GPUs' `gpu` labels (each source's)."""
    if "gpu" in ds.coords:
        labels = ",".join(str(g) for g in ds["gpu"].values)
    else:
        labels = str(ds.attrs.get("gpu_uuids", ""))
    return [u for u in labels.split(",") if u]


def json_attr(ds: xr.Dataset, key: str) -> Any:
    """A JSON attribute's value; None where the cube has none, "" or not JSON."""
    try:
        return json.loads(str(ds.attrs.get(key) or "null"))
    except ValueError:
        return None


def merged_sources(ds: xr.Dataset) -> dict[str, dict[str, Any]]:
    """A merged cube's sources (`merged_from`, by their GPUs' label); empty for one GPU's."""
    if "gpu" not in ds.dims:
        return {}
    try:
        sources = json.loads(str(ds.attrs.get("merged_from") or "{}"))
    except ValueError:
        return {}
    if not isinstance(sources, dict):
        return {}
    return {str(k): v for k, v in sources.items() if isinstance(v, dict)}


def speculative_drafters(cube: xr.Dataset) -> set[str]:
    """The drafters the cube's campaign runs with a speculative algorithm: each should have an
    accept length. None known where the cube does not record its campaign."""
    try:
        campaign = json.loads(str(cube.attrs.get("campaign", "")) or "{}")
        drafters = campaign.get("drafters") or []
        return {
            str(d["name"]) for d in drafters if str(d.get("algorithm") or "none").lower() != "none"
        }
    except (ValueError, AttributeError, KeyError, TypeError):
        return set()


def plain_drafters(cube: xr.Dataset) -> set[str]:
    """The drafters the cube's campaign (its "campaign" attribute) runs without speculation
    (no algorithm, or "none"): they have no accept length to show, measured or not. None
    known where the cube does not record its campaign."""
    try:
        campaign = json.loads(str(cube.attrs.get("campaign", "")) or "{}")
        drafters = campaign.get("drafters") or []
        return {
            str(d["name"]) for d in drafters if str(d.get("algorithm") or "none").lower() == "none"
        }
    except (ValueError, AttributeError, KeyError, TypeError):
        return set()
