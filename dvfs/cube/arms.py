"""What a cube's drafters' servers differ in beyond their drafters: read by `cube info`, by
every analysis opening a cube (which refuses such a cube) and by `cube merge`, so it sits
apart from all three."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from dvfs.records import arm_changes

if TYPE_CHECKING:
    import xarray as xr


def _attr_json(ds: xr.Dataset, key: str, empty: Any) -> Any:
    try:
        return json.loads(str(ds.attrs.get(key, "")) or "null") or empty
    except ValueError:
        return empty


def drafter_servers(ds: xr.Dataset) -> dict[str, dict[str, Any]]:
    """Each drafter's server as the cube keeps it (`server_args`, with its `attention_backend`
    variable), in the shape of a journal's server record, for `arm_changes`."""
    servers = _attr_json(ds, "server_args", {})
    backends: dict[str, str] = {}
    if "attention_backend" in ds and ds["attention_backend"].dims == ("drafter",):
        values = ds["attention_backend"].values
        backends = {str(d): str(b) for d, b in zip(ds["drafter"].values, values, strict=True)}
    return {
        str(drafter): {**record, "attention_backend": backends.get(str(drafter)) or None}
        for drafter, record in (servers.items() if isinstance(servers, dict) else ())
        if isinstance(record, dict)
    }


def arm_differences(ds: xr.Dataset) -> list[str]:
    """What the cube's drafters' servers differ in beyond their drafters (`arm_changes`
    against the first drafter's, at the cube's batch sizes), each entry naming the two
    drafters: empty for every cube `dvfs cube build` makes now, which refuses such a journal;
    a cube an earlier dvfs built (or one edited) may hold them."""
    servers = list(drafter_servers(ds).items())
    if len(servers) < 2:
        return []
    pinned = set(str(ds.attrs.get("arms_pinned", "")).split(",")) - {""}
    batches = [int(b) for b in ds["batch"].values] if "batch" in ds.coords else []
    first, mine = servers[0]
    return [
        f"{first!r} and {drafter!r}: {c}"
        for drafter, theirs in servers[1:]
        for c in arm_changes(mine, theirs, batches, pinned)
    ]
