"""What both analysis documents share: the NaN->null JSON rule, number formatting, the
reference setting, and Markdown tables."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xarray as xr


#: Types JSON holds as they are (checked first: a journal line is mostly these).
_PLAIN = frozenset({str, int, bool, type(None)})


def json_safe(value: Any) -> Any:
    """`value` as strict JSON can hold it: NaN and infinities become null (a missing
    measurement, not a number), tuples lists, numpy scalars Python numbers, keys strings.
    The one NaN->null rule for every document, journal line and --json output."""
    if type(value) in _PLAIN:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        # a measurement's quantiles and timeline are lists of floats: those without a call each
        return [
            (v if math.isfinite(v) else None) if type(v) is float else json_safe(v) for v in value
        ]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars and 0-d arrays
        return json_safe(value.item())
    return value


def as_float(value: Any) -> float | None:
    """A finite float, or None (JSON null) for NaN."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return json_safe(v)


def as_int(value: Any) -> int | None:
    v = as_float(value)
    return None if v is None else int(round(v))


def fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def group_dims(ds: xr.Dataset) -> list[str]:
    return [d for d in ("gpu", "batch", "drafter", "corpus") if d in ds.dims]


def reference_setting(attrs: dict[Any, Any]) -> dict[str, Any]:
    """The reference (stock) setting. A merged cube also has `per_gpu`, each GPU's own; where
    they differ the single values are null, since no one setting is every GPU's stock."""
    per_gpu = json.loads(attrs["reference_per_gpu"]) if "reference_per_gpu" in attrs else None
    all_stock = all(v["is_stock"] for v in per_gpu.values()) if per_gpu else True
    ref: dict[str, Any] = {
        "sm_clock_mhz": as_int(attrs.get("reference_sm_clock_mhz")),
        "power_limit_w": as_float(attrs.get("reference_power_limit_w")),
        "is_stock": bool(attrs.get("reference_is_stock", all_stock)),
    }
    if per_gpu:
        ref["per_gpu"] = per_gpu
    return ref


def reference_text(ref: dict[str, Any]) -> str:
    """ "1980 MHz / 700 W", or each GPU's own where a merged cube's GPUs differ."""

    def one(r: dict[str, Any]) -> str:
        return f"{r['sm_clock_mhz']} MHz / {r['power_limit_w']:g} W"

    if ref["sm_clock_mhz"] is not None and ref["power_limit_w"] is not None:
        return one(ref)
    per_gpu = ref.get("per_gpu") or {}
    return "each GPU's own: " + ", ".join(f"{g[:12]} {one(r)}" for g, r in per_gpu.items())
