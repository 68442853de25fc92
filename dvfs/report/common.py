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
_isfinite = math.isfinite


def json_safe(value: Any) -> Any:
    """`value` as strict JSON can hold it: NaN and infinities become null (a missing
    measurement, not a number), tuples lists, numpy scalars Python numbers, keys strings.
    The one NaN->null rule for every document, journal line and --json output."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is float:
        return value if _isfinite(value) else None
    if kind is dict:
        # a journal line's records are mostly dicts of floats and plain values: those
        # without a call each (as the comprehension below, for dict's subclasses)
        safe = {}
        for k, v in value.items():
            key = k if type(k) is str else str(k)
            of = type(v)
            if of is float:
                safe[key] = v if _isfinite(v) else None
            elif of in _PLAIN:
                safe[key] = v
            else:
                safe[key] = json_safe(v)
        return safe
    if kind is list or kind is tuple or isinstance(value, list | tuple):
        # a measurement's quantiles and timeline are lists of floats: those without a call each
        return [(v if _isfinite(v) else None) if type(v) is float else json_safe(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
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


def fmt_ms(value: float | None, missing: str = "-") -> str:
    """Milliseconds as a person reads them: three significant digits, whole numbers from
    100 ms up (1000, not 1e+03)."""
    if value is None:
        return missing
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def group_dims(ds: xr.Dataset) -> list[str]:
    return [d for d in ("gpu", "batch", "drafter", "corpus") if d in ds.dims]


def reference_setting(attrs: dict[Any, Any]) -> dict[str, Any]:
    """The reference setting: stock, or the top of the grid where the grid lacks stock
    (`is_stock` false; `stock_*` give the stock values, `description` says it in words). A
    merged cube also has `per_gpu`, each GPU's own; where they differ the single values are
    null, since no one setting is every GPU's stock."""
    per_gpu = json.loads(attrs["reference_per_gpu"]) if "reference_per_gpu" in attrs else None
    all_stock = all(v["is_stock"] for v in per_gpu.values()) if per_gpu else True
    ref: dict[str, Any] = {
        "sm_clock_mhz": as_int(attrs.get("reference_sm_clock_mhz")),
        "power_limit_w": as_float(attrs.get("reference_power_limit_w")),
        "is_stock": bool(attrs.get("reference_is_stock", all_stock)),
        "stock_sm_clock_mhz": as_int(attrs.get("stock_sm_clock_mhz")),
        "stock_power_limit_w": as_float(attrs.get("stock_power_limit_w")),
    }
    if per_gpu:
        ref["per_gpu"] = per_gpu
    ref["description"] = reference_text(ref)
    return ref


def _describe(ref: dict[str, Any]) -> str:
    from dvfs.analysis.headroom import describe_reference

    return describe_reference(
        ref["sm_clock_mhz"],
        ref["power_limit_w"],
        bool(ref["is_stock"]),
        ref.get("stock_sm_clock_mhz"),
        ref.get("stock_power_limit_w"),
    )


def reference_text(ref: dict[str, Any]) -> str:
    """The reference in the words every command uses: "stock (1980 MHz / 700 W)", "top of the
    grid (1800 MHz / 700 W; stock 1980 MHz not swept)", or each GPU's own where a merged
    cube's GPUs differ: in their setting, or in whether it is their stock (one GPU's stock
    setting is the top of the grid, another's stock is not on it)."""
    per_gpu = ref.get("per_gpu") or {}
    alike = len({json.dumps(r, sort_keys=True) for r in per_gpu.values()}) <= 1
    if ref["sm_clock_mhz"] is not None and ref["power_limit_w"] is not None and alike:
        return _describe(ref)
    return "each GPU's own: " + ", ".join(
        f"{short_label(g)} {_describe(r)}" for g, r in per_gpu.items()
    )


def reference_label(ref: dict[str, Any]) -> str:
    """A column's short name for the reference: "stock", or "ref." where it is not stock."""
    per_gpu = ref.get("per_gpu") or {}
    stock = ref["is_stock"] and all(r.get("is_stock", True) for r in per_gpu.values())
    return "stock" if stock else "ref."


def gpu_names(cube: xr.Dataset) -> dict[str, str]:
    """A merged cube's GPUs, label (UUID, or a group's UUIDs comma-joined) -> model name, in
    the `gpu` axis's order; {} for a one-GPU cube. Its `gpu_name` attribute is only the first
    GPU's model."""
    if "gpu" not in cube.dims:
        return {}
    labels = [str(g) for g in cube["gpu"].values]
    try:
        names = [str(n) for n in json.loads(str(cube.attrs.get("gpu_names", "[]")))]
    except ValueError:
        names = []
    return dict(zip(labels, names if len(names) == len(labels) else labels, strict=True))


def gpu_uuids(cube: xr.Dataset) -> list[str]:
    """Every GPU UUID the cube records (cube.attrs.gpu_uuids), without a GPU whose UUID was
    never read ("?" or "unknown"): the report names GPUs, it does not count them."""
    from dvfs.cube.attrs import gpu_uuids as recorded  # dvfs.cube imports this module's json_safe

    return [u for u in recorded(cube) if u.startswith("GPU-")]


def gpus_of(r: xr.Dataset, name: str) -> list[str]:
    """A comma-joined GPU variable as a list (empty where absent or unknown)."""
    if name not in r:
        return []
    value = r[name].item()
    return [g for g in str(value).split(",") if g and g != "nan"] if isinstance(value, str) else []


def short_label(label: Any) -> str:
    """A merged cube's GPU label as `dvfs cube info` names it: each of its UUIDs cut short
    ("GPU-34d07aa5,GPU-9f1c0b2e" for shards of one model on two GPUs), not its first alone."""
    return ",".join(u[:12] for u in str(label).split(","))


def short_gpus(gpus: list[str]) -> str:
    """UUIDs cut to "GPU-34d07aa5" (the first 8 hex digits tell a node's GPUs apart)."""
    return ", ".join(g[:12] for g in gpus) or "unknown"


def gpu_words(name: str) -> str:
    """A GPU as a sentence names it: its UUID alone ("GPU-47dfcd23"), which already says GPU,
    or "GPU NAME" for an index or a model's name."""
    return name if name.startswith(("GPU-", "MIG-")) else f"GPU {name}"


#: Rows named in a note; more are counted.
MAX_NAMED_ROWS = 4


def named_rows(rows: list[dict[str, Any]], detail: Any) -> str:
    """ "batch 1 eagle3 on code: A vs B; ..." for the first few rows, the rest counted
    (`detail` None: the rows alone, "batch 1 eagle3 on code; ...")."""

    def where(r: dict[str, Any]) -> str:
        gpu = f"{gpu_words(short_label(r['gpu']))}, " if r.get("gpu") else ""
        return f"{gpu}batch {r['batch']} {r['drafter']} on {r['corpus']}"

    shown = [
        where(r) if detail is None else f"{where(r)}: {detail(r)}" for r in rows[:MAX_NAMED_ROWS]
    ]
    more = len(rows) - MAX_NAMED_ROWS
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")


def unmeasured_cells(cov: dict[str, Any], where: str = "yet") -> str:
    """A partial cube's cells left, as every analysis says them and `dvfs cube info` counts
    them: "48 of 120 cells not measured yet (48 failed)", the never run and the failed each
    said where there are any (`where`: "here" for a shard's cube)."""
    waiting = int(cov.get("missing", 0)) + int(cov.get("failed", 0))
    parts = [
        f"{cov[k]} {what}"
        for k, what in (("missing", "never run"), ("failed", "failed"))
        if cov.get(k)
    ]
    return f"{waiting} of {cov['cells']} cells not measured {where} ({', '.join(parts)})"


def campaign_hash(attrs: Any) -> str | None:
    """A cube's campaign hash; a merged cube's, from the cubes it was merged from (their
    distinct hashes, comma-joined; the report's "Merged from" table shows each); None where
    none is recorded."""
    if attrs.get("campaign_hash"):
        return str(attrs["campaign_hash"])
    try:
        sources = json.loads(str(attrs.get("merged_from") or "{}"))
    except ValueError:
        return None
    if not isinstance(sources, dict):
        return None
    hashes = {
        str(s["campaign_hash"])
        for s in sources.values()
        if isinstance(s, dict) and str(s.get("campaign_hash") or "") not in ("", "None", "nan")
    }
    return ", ".join(sorted(hashes)) or None
