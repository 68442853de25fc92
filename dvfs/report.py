"""Analyses as documents: stable JSON (for scripts and `dvfs cap plan`) and Markdown tables.

JSON schemas are versioned by their "schema" key: "dvfs.headroom/1" and "dvfs.compare/1".
"""

from __future__ import annotations

import itertools
import json
import math
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import xarray as xr

HEADROOM_SCHEMA = "dvfs.headroom/1"
COMPARE_SCHEMA = "dvfs.compare/1"


def json_safe(value: Any) -> Any:
    """`value` as strict JSON can hold it: NaN and infinities become null (a missing
    measurement, not a number), tuples lists, numpy scalars Python numbers, keys strings.
    The one NaN->null rule for every document, journal line and --json output."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars and 0-d arrays
        return json_safe(value.item())
    return value


def _f(value: Any) -> float | None:
    """A finite float, or None (JSON null) for NaN."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return json_safe(v)


def _i(value: Any) -> int | None:
    v = _f(value)
    return None if v is None else int(round(v))


def _group_dims(ds: xr.Dataset) -> list[str]:
    return [d for d in ("gpu", "batch", "drafter", "corpus") if d in ds.dims]


def headroom_document(result: xr.Dataset, cube: xr.Dataset) -> dict[str, Any]:
    """The headroom result as a JSON-ready document (schema dvfs.headroom/1)."""
    rows = []
    dims = _group_dims(result)
    for idx in np.ndindex(*(result.sizes[d] for d in dims)):
        at = {d: result[d].values[i] for d, i in zip(dims, idx, strict=True)}
        r = result.isel({d: i for d, i in zip(dims, idx, strict=True)})
        row: dict[str, Any] = {d: (int(v) if d == "batch" else str(v)) for d, v in at.items()}
        row.update(
            feasible=bool(r["feasible"]),
            feasible_settings=int(r["feasible_settings"]),
            chosen={
                "sm_clock_mhz": _i(r["chosen_sm_clock"]),
                "power_limit_w": _f(r["chosen_power_limit"]),
            },
            lowest_feasible={
                "sm_clock_mhz": _i(r["lowest_feasible_sm_clock"]),
                "power_limit_w": _f(r["lowest_feasible_power_limit"]),
            },
            headroom_mhz=_i(r["headroom_mhz"]),
            headroom_w=_f(r["headroom_w"]),
            chosen_headroom_mhz=_i(r["chosen_headroom_mhz"]),
            chosen_headroom_w=_f(r["chosen_headroom_w"]),
            energy_per_token_j=_f(r["chosen_energy_per_token_j"]),
            stock_energy_per_token_j=_f(r["stock_energy_per_token_j"]),
            saving=_f(r["saving"]),
            baseline_energy_per_token_j=_f(r["baseline_energy_per_token_j"]),
            saving_vs_baseline=_f(r["saving_vs_baseline"]),
            latency_ms=_f(r["chosen_latency_ms"]),
            reference_latency_ms=_f(r["reference_latency_ms"]),
            target_ms=_f(r["target_ms"]),
            latency_bound=_f(r["latency_bound"]),
            repeats=_i(r["repeats"]),
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
        "reference": _reference(a),
        "rows": rows,
    }


def _reference(attrs: dict[Any, Any]) -> dict[str, Any]:
    """The reference (stock) setting. A merged cube also has `per_gpu`, each GPU's own; where
    they differ the single values are null, since no one setting is every GPU's stock."""
    per_gpu = json.loads(attrs["reference_per_gpu"]) if "reference_per_gpu" in attrs else None
    all_stock = all(v["is_stock"] for v in per_gpu.values()) if per_gpu else True
    ref: dict[str, Any] = {
        "sm_clock_mhz": _i(attrs.get("reference_sm_clock_mhz")),
        "power_limit_w": _f(attrs.get("reference_power_limit_w")),
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


def _fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


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
                _fmt(r["stock_energy_per_token_j"], ".4g"),
                "-",
                "-",
                "-",
                _fmt(r["target_ms"], ".3g"),
            ]
        else:
            chosen = f"{r['chosen']['sm_clock_mhz']}/{r['chosen']['power_limit_w']:g}"
            headroom = f"{r['headroom_mhz']}/{r['headroom_w']:g}"
            saving = None if r["saving"] is None else r["saving"] * 100
            cells = [
                chosen,
                headroom,
                _fmt(r["stock_energy_per_token_j"], ".4g"),
                _fmt(r["energy_per_token_j"], ".4g"),
                _fmt(saving, ".1f") + "%",
                _fmt(r["latency_ms"], ".3g"),
                _fmt(r["target_ms"], ".3g"),
            ]
        rows.append([*lead, str(r["batch"]), r["drafter"], r["corpus"], *cells])
    keep = [i for i, name in enumerate(header) if name not in omit]
    return [header[i] for i in keep], [[row[i] for i in keep] for row in rows]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


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


def compare_document(cmp: xr.Dataset, roof: xr.Dataset | None, cube: xr.Dataset) -> dict[str, Any]:
    """Speculation analysis as JSON (schema dvfs.compare/1); rows carry `gpu` for merged cubes."""
    baseline = cmp.attrs["baseline"]
    gpus: list[str | None] = [str(g) for g in cmp["gpu"].values] if "gpu" in cmp.dims else [None]

    def point(gpu: str | None, **at: Any) -> dict[str, Any]:
        return {**at, "gpu": gpu} if gpu is not None else at

    def lead(gpu: str | None) -> dict[str, Any]:
        return {"gpu": gpu} if gpu is not None else {}

    rows = []
    for gpu, batch, drafter, corpus in itertools.product(
        gpus, cmp["batch"].values, cmp["drafter"].values, cmp["corpus"].values
    ):
        if str(drafter) == baseline:
            continue
        at = point(gpu, batch=batch, drafter=drafter, corpus=corpus)
        rows.append(
            {
                **lead(gpu),
                "batch": int(batch),
                "drafter": str(drafter),
                "corpus": str(corpus),
                "energy_ratio_at_stock": _f(cmp["energy_ratio_at_stock"].sel(at)),
                "energy_ratio_equal_latency": _f(cmp["energy_ratio_equal_latency"].sel(at)),
                "energy_per_token_at_stock_j": _f(cmp["energy_per_token_at_stock_j"].sel(at)),
            }
        )
    break_even = []
    for gpu, drafter, corpus in itertools.product(
        gpus, cmp["drafter"].values, cmp["corpus"].values
    ):
        if str(drafter) == baseline:
            continue
        at = point(gpu, drafter=drafter, corpus=corpus)
        break_even.append(
            {
                **lead(gpu),
                "drafter": str(drafter),
                "corpus": str(corpus),
                "equal_clock": _i(cmp["break_even_batch_equal_clock"].sel(at)),
                "equal_latency": _i(cmp["break_even_batch_equal_latency"].sel(at)),
                "equal_clock_summary": _text(cmp, "break_even_equal_clock", at),
                "equal_latency_summary": _text(cmp, "break_even_equal_latency", at),
            }
        )
    acceptance = []
    if "accept_length" in cmp:
        accept = cmp["accept_length"]
        if "gpu" in accept.dims:
            accept = accept.mean("gpu")  # acceptance does not depend on the GPU
        for drafter in cmp["drafter"].values:
            for corpus in cmp["corpus"].values:
                value = _f(accept.sel(drafter=drafter, corpus=corpus))
                if value is not None:
                    acceptance.append(
                        {"drafter": str(drafter), "corpus": str(corpus), "accept_length": value}
                    )
    doc: dict[str, Any] = {
        "schema": COMPARE_SCHEMA,
        "campaign": cube.attrs.get("campaign_name"),
        "gpu": cube.attrs.get("gpu_name"),
        "baseline": baseline,
        "latency": cmp.attrs["latency"],
        "reference": _reference(cmp.attrs),
        "rows": rows,
        "break_even_batch": break_even,
        "acceptance": acceptance,
    }
    if roof is not None:
        doc["roofline"] = {
            "model": roof.attrs["model"],
            "gpu_profile": roof.attrs["gpu_profile"],
            "context_tokens": roof.attrs["context_tokens"],
            "ridge_point": {
                str(int(c)): _f(v)
                for c, v in zip(roof["sm_clock"].values, roof["ridge_point"].values, strict=True)
            },
            "verify": [
                {
                    "batch": int(b),
                    "drafter": str(d),
                    "verify_tokens": _i(roof["verify_tokens"].sel(batch=b, drafter=d)),
                    "arithmetic_intensity": _f(
                        roof["arithmetic_intensity"].sel(batch=b, drafter=d)
                    ),
                    "compute_bound_below_mhz": _compute_bound_below(roof, b, d),
                }
                for b in roof["batch"].values
                for d in roof["drafter"].values
            ],
        }
    return doc


def _text(ds: xr.Dataset, name: str, at: dict[str, Any]) -> str:
    """A text variable's value at a point; "no data" where it is absent (merged cubes)."""
    if name not in ds:
        return "no data"
    value = ds[name].sel(at).item()
    return value if isinstance(value, str) else "no data"


def _compute_bound_below(roof: xr.Dataset, batch: Any, drafter: Any) -> int | None:
    """The highest clock at which the verify pass is compute-bound (None: never, in this grid)."""
    bound = roof["compute_bound"].sel(batch=batch, drafter=drafter)
    clocks = roof["sm_clock"].values[bound.values]
    return int(clocks.max()) if len(clocks) else None


def compare_tables(doc: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) triples for the terminal and Markdown renderings."""
    base = doc["baseline"]
    # A merged cube's rows carry their GPU: keep it as a column, or rows would look repeated.
    has_gpu = any("gpu" in r for r in doc["rows"] + doc["break_even_batch"])
    gpu_col = ["gpu"] if has_gpu else []

    def gpu(r: dict[str, Any]) -> list[str]:
        return [str(r.get("gpu", ""))[:12]] if has_gpu else []

    energy = (
        f"Energy per token relative to {base!r} (below 1 saves energy)",
        [
            *gpu_col,
            "batch",
            "drafter",
            "corpus",
            "at stock clock",
            f"at equal latency ({doc['latency']})",
        ],
        [
            [
                *gpu(r),
                str(r["batch"]),
                r["drafter"],
                r["corpus"],
                _fmt(r["energy_ratio_at_stock"], ".2f"),
                _fmt(
                    r["energy_ratio_equal_latency"],
                    ".2f",
                    # No ratio: too slow if the drafter was measured, else nothing to compare.
                    missing="-" if r["energy_per_token_at_stock_j"] is None else "too slow",
                ),
            ]
            for r in doc["rows"]
        ],
    )
    even = (
        f"Where each drafter saves energy against {base!r} (energy per token below its own)",
        [*gpu_col, "drafter", "corpus", "equal clock", "equal latency"],
        [
            [
                *gpu(r),
                r["drafter"],
                r["corpus"],
                r["equal_clock_summary"],
                r["equal_latency_summary"],
            ]
            for r in doc["break_even_batch"]
        ],
    )
    tables = [energy, even]
    if doc["acceptance"]:
        corpora = sorted({a["corpus"] for a in doc["acceptance"]})
        drafters = list(dict.fromkeys(a["drafter"] for a in doc["acceptance"]))
        lookup = {(a["drafter"], a["corpus"]): a["accept_length"] for a in doc["acceptance"]}
        tables.append(
            (
                "Mean accept length (tokens per verify pass)",
                ["drafter", *corpora],
                [[d, *(_fmt(lookup.get((d, c)), ".2f") for c in corpora)] for d in drafters],
            )
        )
    if "roofline" in doc:
        roof = doc["roofline"]
        tables.append(
            (
                f"Verify pass vs ridge point ({roof['model']} on {roof['gpu_profile']}; ridge "
                f"{min(v for v in roof['ridge_point'].values() if v):.0f}-"
                f"{max(v for v in roof['ridge_point'].values() if v):.0f} FLOP/B over the clocks)",
                ["batch", "drafter", "tokens/pass", "FLOP/B", "compute-bound at or below"],
                [
                    [
                        str(v["batch"]),
                        v["drafter"],
                        str(v["verify_tokens"]),
                        _fmt(v["arithmetic_intensity"], ".0f"),
                        "never"
                        if v["compute_bound_below_mhz"] is None
                        else f"{v['compute_bound_below_mhz']} MHz",
                    ]
                    for v in roof["verify"]
                ],
            )
        )
    return tables


def compare_markdown(doc: dict[str, Any]) -> str:
    parts = [
        f"## Speculative decoding vs {doc['baseline']!r}: {doc['campaign']} ({doc['gpu']})",
        "",
    ]
    for title, header, rows in compare_tables(doc):
        parts += [f"### {title}", "", markdown_table(header, rows), ""]
    return "\n".join(parts)
