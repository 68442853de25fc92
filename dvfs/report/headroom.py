"""`dvfs headroom` as a document (schema dvfs.headroom/1, the input of `dvfs cap plan`), its
table rows and its Markdown."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.report.common import (
    as_float,
    as_int,
    fmt,
    group_dims,
    markdown_table,
    reference_setting,
    reference_text,
)

if TYPE_CHECKING:
    import xarray as xr

HEADROOM_SCHEMA = "dvfs.headroom/1"


def headroom_document(result: xr.Dataset, cube: xr.Dataset) -> dict[str, Any]:
    """The headroom result as a JSON-ready document (schema dvfs.headroom/1)."""
    rows = []
    dims = group_dims(result)
    for idx in np.ndindex(*(result.sizes[d] for d in dims)):
        at = {d: result[d].values[i] for d, i in zip(dims, idx, strict=True)}
        r = result.isel({d: i for d, i in zip(dims, idx, strict=True)})
        row: dict[str, Any] = {d: (int(v) if d == "batch" else str(v)) for d, v in at.items()}
        row.update(
            feasible=bool(r["feasible"]),
            feasible_settings=int(r["feasible_settings"]),
            chosen={
                "sm_clock_mhz": as_int(r["chosen_sm_clock"]),
                "power_limit_w": as_float(r["chosen_power_limit"]),
            },
            lowest_feasible={
                "sm_clock_mhz": as_int(r["lowest_feasible_sm_clock"]),
                "power_limit_w": as_float(r["lowest_feasible_power_limit"]),
            },
            headroom_mhz=as_int(r["headroom_mhz"]),
            headroom_w=as_float(r["headroom_w"]),
            chosen_headroom_mhz=as_int(r["chosen_headroom_mhz"]),
            chosen_headroom_w=as_float(r["chosen_headroom_w"]),
            energy_per_token_j=as_float(r["chosen_energy_per_token_j"]),
            stock_energy_per_token_j=as_float(r["stock_energy_per_token_j"]),
            saving=as_float(r["saving"]),
            baseline_energy_per_token_j=as_float(r["baseline_energy_per_token_j"]),
            saving_vs_baseline=as_float(r["saving_vs_baseline"]),
            latency_ms=as_float(r["chosen_latency_ms"]),
            reference_latency_ms=as_float(r["reference_latency_ms"]),
            target_ms=as_float(r["target_ms"]),
            latency_bound=as_float(r["latency_bound"]),
            repeats=as_int(r["repeats"]),
        )
        rows.append(row)
    a = result.attrs
    return {
        "schema": HEADROOM_SCHEMA,
        "campaign": cube.attrs.get("campaign_name"),
        "campaign_hash": cube.attrs.get("campaign_hash"),
        "gpu": {
            "name": cube.attrs.get("gpu_name"),
            "uuids": [u for u in str(cube.attrs.get("gpu_uuids", "")).split(",") if u],
            "backend": cube.attrs.get("gpu_backend"),
        },
        "model": cube.attrs.get("model"),
        "target": {
            "mode": a["target_mode"],
            "metric": a["metric"],
            "quantile": a["quantile"],
            "slack": a["slack"],
            "threshold": a["threshold"],
            "strict": bool(a.get("strict", 0)),
            "baseline": a["baseline"],
            "description": a["target"],
        },
        "knob": a["knob"],
        "confidence": a["confidence"],
        "bound": a["bound"],
        "reference": reference_setting(a),
        "rows": rows,
    }


def headroom_table_rows(
    doc: dict[str, Any], *, omit: tuple[str, ...] = ()
) -> tuple[list[str], list[list[str]]]:
    """Column names and text cells shared by the terminal and Markdown renderings.

    `omit` drops grouping columns (batch, drafter, corpus) a caller states elsewhere.
    """
    has_gpu = any("gpu" in r for r in doc["rows"])
    header = [
        *(["gpu"] if has_gpu else []),
        "batch",
        "drafter",
        "corpus",
        "chosen MHz/W",
        "headroom MHz/W",
        "J/tok stock",
        "J/tok chosen",
        "saving",
        "latency ms",
        "target ms",
    ]
    rows = []
    for r in doc["rows"]:
        lead = [r["gpu"][:12]] if has_gpu else []
        if not r["feasible"]:
            cells = [
                # No target at all when the reference (stock) cell itself is missing.
                "none feasible" if r["target_ms"] is not None else "no stock cell",
                "-",
                fmt(r["stock_energy_per_token_j"], ".4g"),
                "-",
                "-",
                "-",
                fmt(r["target_ms"], ".3g"),
            ]
        else:
            chosen = f"{r['chosen']['sm_clock_mhz']}/{r['chosen']['power_limit_w']:g}"
            headroom = f"{r['headroom_mhz']}/{r['headroom_w']:g}"
            saving = None if r["saving"] is None else r["saving"] * 100
            cells = [
                chosen,
                headroom,
                fmt(r["stock_energy_per_token_j"], ".4g"),
                fmt(r["energy_per_token_j"], ".4g"),
                fmt(saving, ".1f") + "%",
                fmt(r["latency_ms"], ".3g"),
                fmt(r["target_ms"], ".3g"),
            ]
        rows.append([*lead, str(r["batch"]), r["drafter"], r["corpus"], *cells])
    keep = [i for i, name in enumerate(header) if name not in omit]
    return [header[i] for i in keep], [[row[i] for i in keep] for row in rows]


def headroom_markdown(doc: dict[str, Any]) -> str:
    header, rows = headroom_table_rows(doc)
    ref = doc["reference"]
    lines = [
        f"## DVFS headroom: {doc['campaign']} ({doc['gpu']['name']})",
        "",
        f"- Target: {doc['target']['description']}",
        f"- Knob: {doc['knob']}; reference {reference_text(ref)}"
        + (
            ""
            if ref["is_stock"]
            else " (the stock setting is not in the cube: top clock and limit)"
        ),
        f"- Feasibility: {doc['bound']}",
        "- Headroom: stock minus the lowest feasible setting; chosen: the feasible setting with "
        "the least energy per token (saving against the drafter's own stock energy)",
        "",
        markdown_table(header, rows),
    ]
    return "\n".join(lines) + "\n"
