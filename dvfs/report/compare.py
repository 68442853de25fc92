"""`dvfs compare` as a document (schema dvfs.compare/4), its tables and its Markdown."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dvfs.report.common import (
    as_float,
    as_int,
    fmt,
    gpu_names,
    markdown_table,
    named_rows,
    reference_setting,
    reference_text,
    short_gpus,
    short_label,
    unmeasured_cells,
)

if TYPE_CHECKING:
    import xarray as xr

COMPARE_SCHEMA = "dvfs.compare/4"
#: The two ratios of a row, as named in its JSON keys.
WHATS = ("at_stock", "equal_latency")
#: The verdict of a row whose drafter met the baseline's latency at no setting
#: (`dvfs.analysis.compare.NOT_WITHIN`: this module sits below the analyses, which it cannot
#: import).
NOT_WITHIN = "not within target"
#: The verdict of a row with nothing valid to compare (`dvfs.analysis.compare.NO_DATA`).
NO_DATA = "no data"
#: The verdict of a row whose settings were left unjudged for want of usable repeats
#: (`dvfs.analysis.compare.TOO_FEW`).
TOO_FEW = "too few repeats"
#: Verdicts judged on a ratio (`dvfs.analysis.compare`): where one stands beside a null
#: ratio, the ratio is infinite (the baseline at zero energy per token), not missing.
JUDGED_ON_A_RATIO = ("costs", "within noise", "one paired repeat")
#: A row not within target whose fastest setting's mean latency met the target (its bound at
#: the confidence asked did not): not "too slow".
MEAN_WITHIN = "equal_latency_mean_within_target"
#: Each arm of a ratio at equal latency, and its flag for a setting at the grid's lowest clock
#: or power limit.
EDGES = {
    "drafter": "equal_latency_drafter_at_grid_edge",
    "baseline": "equal_latency_baseline_at_grid_edge",
}
#: Each knob, and its flag for a setting at equal latency (either arm's) at the grid's lowest
#: value of it, above the GPU's lowest: the knob the grid-edge note says to extend.
KNOB_EDGES = {
    "knobs.sm_clock": "equal_latency_sm_clock_at_grid_edge",
    "knobs.power_limit": "equal_latency_power_limit_at_grid_edge",
}


def compare_document(
    cmp: xr.Dataset,
    roof: xr.Dataset | Sequence[xr.Dataset] | None,
    cube: xr.Dataset,
    *,
    roofline_left_out: Sequence[str] = (),
) -> dict[str, Any]:
    """Speculation analysis as JSON (schema dvfs.compare/4); rows carry `gpu` for merged cubes.
    `roof`: the roofline, or one per GPU model of a merged cube (`rooflines`): the first is
    `roofline`, and with several, `roofline_per_gpu_model` holds each. `roofline_left_out`:
    a merged cube's GPU models the twin has no roofline of (`rooflines`' `left_out`), named
    so that its `roofline` (another model's) is not read as theirs."""
    from dvfs.analysis.headroom import coverage
    from dvfs.cube.cells_left import models_left, shards_of, unfit_left

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
                "energy_ratio_at_stock": as_float(cmp["energy_ratio_at_stock"].sel(at)),
                "energy_ratio_equal_latency": as_float(cmp["energy_ratio_equal_latency"].sel(at)),
                "energy_per_token_at_stock_j": as_float(cmp["energy_per_token_at_stock_j"].sel(at)),
                **_paired(cmp, at, "at_stock"),
                **_paired(cmp, at, "equal_latency"),
                **{
                    name: bool(cmp[name].sel(at).fillna(0))  # NaN: a merged cube's gap
                    for name in (*EDGES.values(), *KNOB_EDGES.values())
                    if name in cmp  # absent from an older result
                },
                **(
                    {MEAN_WITHIN: bool(cmp[MEAN_WITHIN].sel(at).fillna(0))}
                    if MEAN_WITHIN in cmp  # absent from an older result
                    else {}
                ),
                "measured_on": _gpus(cmp, at),
                "baseline_measured_on": _gpus(cmp, {**at, "drafter": baseline}),
                "different_gpus": bool(cmp["different_gpus"].sel(at))
                if "different_gpus" in cmp
                else False,
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
                "equal_clock": as_int(cmp["break_even_batch_equal_clock"].sel(at)),
                "equal_latency": as_int(cmp["break_even_batch_equal_latency"].sel(at)),
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
                value = as_float(accept.sel(drafter=drafter, corpus=corpus))
                if value is not None:
                    acceptance.append(
                        {"drafter": str(drafter), "corpus": str(corpus), "accept_length": value}
                    )
    doc: dict[str, Any] = {
        "schema": COMPARE_SCHEMA,
        "campaign": cube.attrs.get("campaign_name"),
        # a merged cube's `gpu_name` is its first GPU's: every model it holds is named
        "gpu": ", ".join(dict.fromkeys(gpu_names(cube).values())) or cube.attrs.get("gpu_name"),
        "baseline": baseline,
        "latency": cmp.attrs["latency"],
        "reference": reference_setting(cmp.attrs),
        "confidence": as_float(cmp.attrs.get("confidence")),
        "interval": cmp.attrs.get("interval"),
        "rows": rows,
        "break_even_batch": break_even,
        "acceptance": acceptance,
        # speculative drafters with no valid cell: no accept length, named rather than left out
        "acceptance_no_valid_cell": _no_valid_cell(cmp, cube, baseline),
        # and those with valid cells but no accept length in the cells the table averages
        **_no_accept_length(cmp, cube, baseline, acceptance),
        "coverage": coverage(cube),
        **shards_of(cube),
        **models_left(cube),  # the GPU models a fleet's cells left are on, if some only
        **unfit_left(cube),  # the drafters whose failed cells a rerun fails again
    }
    roofs = [] if roof is None else [roof] if not isinstance(roof, Sequence) else list(roof)
    if roofs:
        doc["roofline"] = _roofline_document(roofs[0])
    if len(roofs) > 1:
        doc["roofline_per_gpu_model"] = [_roofline_document(r) for r in roofs]
    if roofs and roofline_left_out:
        doc["roofline_left_out"] = list(roofline_left_out)
    return doc


def _no_valid_cell(cmp: xr.Dataset, cube: xr.Dataset, baseline: str) -> list[str]:
    """The drafters besides the baseline that speculate (as far as the cube's campaign says)
    and have no valid cell at all, so no accept length: the accept-length table keeps their
    row, as the acceptance figure does, rather than leaving them (or the whole table, where
    one is the only speculative drafter) out unsaid. None for a cube without accept lengths."""
    from dvfs.analysis.headroom import valid_mask
    from dvfs.cube.attrs import plain_drafters

    if "accept_length" not in cmp:
        return []
    plain = plain_drafters(cube)
    valid = valid_mask(cube)
    measured = valid.any([d for d in valid.dims if d != "drafter"])
    return [
        str(d)
        for d in cmp["drafter"].values
        if str(d) != baseline and str(d) not in plain and not bool(measured.sel(drafter=d))
    ]


def _no_accept_length(
    cmp: xr.Dataset, cube: xr.Dataset, baseline: str, acceptance: list[dict[str, Any]]
) -> dict[str, list[str]]:
    """The drafters besides the baseline the campaign runs speculating that have valid cells
    but no accept length in any corpus, named rather than left out of the accept-length table
    unsaid (its figure keeps their row of "-"): `acceptance_none_usable`, those whose every
    setting measured has an invalid repeat (left out whole, as headroom leaves it), and
    `acceptance_not_recorded`, those whose usable cells record none (a server that reported no
    speculation counters, or rounds that cut requests off). Empty for a cube without accept
    lengths or a campaign."""
    from dvfs.analysis.headroom import ruled_out_settings, valid_mask
    from dvfs.cube.attrs import speculative_drafters

    if "accept_length" not in cmp:
        return {}
    valid = valid_mask(cube)
    usable = valid & ~ruled_out_settings(cube)
    others = [d for d in valid.dims if d != "drafter"]
    has_valid, has_usable = valid.any(others), usable.any(others)
    with_value = {a["drafter"] for a in acceptance}
    lacking = [
        str(d)
        for d in cmp["drafter"].values
        if str(d) != baseline
        and str(d) in speculative_drafters(cube)
        and str(d) not in with_value
        and bool(has_valid.sel(drafter=d))
    ]
    return {
        "acceptance_none_usable": [d for d in lacking if not bool(has_usable.sel(drafter=d))],
        "acceptance_not_recorded": [d for d in lacking if bool(has_usable.sel(drafter=d))],
    }


def _roofline_document(roof: xr.Dataset) -> dict[str, Any]:
    """One roofline as JSON: its model and GPU profile, the ridge point per clock and where
    each (batch, drafter)'s verify pass turns compute-bound."""
    return {
        "model": roof.attrs["model"],
        "gpu_profile": roof.attrs["gpu_profile"],
        # Where the ridge came from: the twin's physics of gpu_profile, or a measured file.
        "ridge": roof.attrs.get("ridge"),
        "context_tokens": roof.attrs["context_tokens"],
        "ridge_point": {
            str(int(c)): as_float(v)
            for c, v in zip(roof["sm_clock"].values, roof["ridge_point"].values, strict=True)
        },
        "verify": [
            {
                "batch": int(b),
                "drafter": str(d),
                "verify_tokens": as_int(roof["verify_tokens"].sel(batch=b, drafter=d)),
                "arithmetic_intensity": as_float(
                    roof["arithmetic_intensity"].sel(batch=b, drafter=d)
                ),
                "compute_bound_below_mhz": _compute_bound_below(roof, b, d),
                # The ridge this pass is held against at each clock: the full GEMM's
                # `ridge_point` lowered for a pass of few tokens (tiles and waves part-filled),
                # raised for a verify pass's KV-cache reads at the tree attention's bandwidth.
                "verify_ridge_point": _verify_ridge(roof, b, d),
            }
            for b in roof["batch"].values
            for d in roof["drafter"].values
        ],
    }


def _paired(cmp: xr.Dataset, at: dict[str, Any], what: str) -> dict[str, Any]:
    """A ratio's interval ([low, high], null with fewer than two paired repeats), its verdict
    and the repeats behind it and left out of it by pairing (absent from an older result)."""
    if f"verdict_{what}" not in cmp:
        return {}
    low = float(cmp[f"energy_ratio_{what}_low"].sel(at))
    high = float(cmp[f"energy_ratio_{what}_high"].sel(at))
    # NaN ends: fewer than two paired repeats, no interval. An infinite end (a baseline at
    # zero energy per token in some paired repeat) is unbounded: null in its place.
    none = math.isnan(low) or math.isnan(high)
    return {
        f"energy_ratio_{what}_interval": None if none else [as_float(low), as_float(high)],
        f"verdict_{what}": _text(cmp, f"verdict_{what}", at),
        f"paired_repeats_{what}": as_int(cmp[f"paired_repeats_{what}"].sel(at)),
        f"dropped_repeats_{what}": as_int(cmp[f"dropped_repeats_{what}"].sel(at)),
    }


def _gpus(ds: xr.Dataset, at: dict[str, Any]) -> list[str]:
    if "measured_on" not in ds:
        return []
    value = ds["measured_on"].sel(at).item()
    return [g for g in value.split(",") if g] if isinstance(value, str) else []


def compare_notes(doc: dict[str, Any]) -> list[str]:
    """The lines under the tables: the reference (what "equal clock" and the break-even batch
    are at), how saves / costs were judged, a partial cube's cells not measured yet, rows that
    lost repeats to pairing, and rows whose two arms were measured on different GPUs."""
    notes = [f"equal clock: both at the reference, {reference_text(doc['reference'])}"]
    if doc.get("interval"):
        notes.append(f"saves / costs: {doc['interval']}")
    cov = doc.get("coverage") or {}
    waiting = int(cov.get("missing", 0)) + int(cov.get("failed", 0))
    # a shard's cube: the other shards' cells are theirs, not "not measured yet"
    where = "here" if doc.get("shard") else "yet"
    if waiting:
        from dvfs.cube.cells_left import resume_note

        then = resume_note(doc)
        notes.append(
            f"partial cube: {unmeasured_cells(cov, where)}: a ratio, a "
            'verdict ("not within target", "too slow" included) or a break-even batch '
            f"resting on settings not measured may change; {then}"
        )
    # rows whose "-" and "no data" are otherwise unexplained: nothing valid to compare. Said
    # of the repeats, not the cells: each arm may hold valid cells there whose repeats differ
    # (the "paired by repeat" note below counts them), and of a partial cube's cells by the
    # note above, whose advice fits the cube (a shard's: the other shards and the merge).
    empty = [
        r
        for r in doc["rows"]
        if r.get("verdict_at_stock") == NO_DATA and r.get("verdict_equal_latency") == NO_DATA
    ]
    if empty:
        why = (
            f"its cells are not measured {where} (the partial cube note above says what "
            "measures them) or flagged invalid (`dvfs cube info` names the flags and what to "
            "change in the campaign)"
            if waiting
            else "flagged invalid: `dvfs cube info` names the flags and what to change in the "
            "campaign"
        )
        notes.append(
            f"no data: in {len(empty)} of {len(doc['rows'])} rows no repeat at the reference "
            f"is valid in both the drafter and {doc['baseline']!r}, so nothing compares "
            f"({named_rows(empty, None)}): {why}"
        )
    unmeasured = doc.get("acceptance_no_valid_cell") or []
    if unmeasured:
        one = len(unmeasured) == 1
        # in a partial cube its cells may be not measured yet: the note above says what
        # measures them (`dvfs cube info` would only name flags), as the "no data:" note says
        why = (
            f"{'its' if one else 'their'} cells are not measured {where} (the partial cube note "
            "above says what measures them) or flagged invalid (`dvfs cube info` names the "
            "flags and what to change in the campaign)"
            if waiting
            else "`dvfs cube info` names the flags (or the cells not measured)"
        )
        notes.append(
            f"accept length: {', '.join(repr(d) for d in unmeasured)} "
            f"{'has' if one else 'have'} no valid cell{' ' + where if waiting else ''}, so no "
            f"accept length (- in {'its row' if one else 'their rows'}): {why}"
        )
    for key, why in (
        (
            "acceptance_none_usable",
            "valid cells, but every setting it was measured at has an invalid repeat, which "
            "leaves it out whole as headroom does: `dvfs cube info` names the flags",
        ),
        (
            "acceptance_not_recorded",
            "valid cells, but none records an accept length (the server reported no "
            "speculation counters, or rounds cut requests off)",
        ),
    ):
        lacking = doc.get(key) or []
        if lacking:
            one = len(lacking) == 1
            notes.append(
                f"accept length: {', '.join(repr(d) for d in lacking)} "
                f"{'has' if one else 'have'} {why}, so no accept length "
                f"(- in {'its row' if one else 'their rows'})"
            )
    dropped = [
        r
        for r in doc["rows"]
        if r.get("dropped_repeats_at_stock") or r.get("dropped_repeats_equal_latency")
    ]
    if dropped:
        notes.append(
            f"paired by repeat: in {len(dropped)} of {len(doc['rows'])} rows a repeat valid in "
            f"one arm only was left out of both ({named_rows(dropped, _dropped_text)}); each "
            "repeat sends its own prompts, so only repeats valid in both arms compare like "
            "with like"
        )
    edge = [r for r in doc["rows"] if edge_arms(r)]
    if edge:
        # the knobs the edge rows are at the edge of (either, from a result without them)
        knobs = [k for k, name in KNOB_EDGES.items() if any(r.get(name, True) for r in edge)]
        notes.append(
            f"grid edge: in {len(edge)} of {len(doc['rows'])} rows a setting at equal latency "
            "is the lowest clock or power limit swept "
            f"({named_rows(edge, lambda r: ', '.join(edge_arms(r)))}); a setting below the "
            "grid might spend less, so the drafter's ratio may be lower (the baseline's: "
            f"higher): extend {' or '.join(knobs)} downward to find it"
        )
    mixed = [r for r in doc["rows"] if r.get("different_gpus")]
    if mixed:
        named = named_rows(
            mixed,
            lambda r: f"{short_gpus(r['measured_on'])} vs {short_gpus(r['baseline_measured_on'])}",
        )
        notes.append(
            f"different GPUs: in {len(mixed)} of {len(doc['rows'])} rows the drafter and "
            f"{doc['baseline']!r} were measured on different GPUs ({named}); GPU-to-GPU spread "
            "is part of those ratios and of where each drafter saves: measure both arms on "
            "one GPU to remove it"
        )
    return notes


def edge_arms(r: dict[str, Any]) -> list[str]:
    """The arms ("drafter", "baseline") of a `compare_document` row whose setting at equal
    latency is at the grid's edge: what the ratio cell, the notes and the findings each say."""
    return [arm for arm, name in EDGES.items() if r.get(name)]


def _dropped_text(r: dict[str, Any]) -> str:
    parts = []
    for what, label in (("at_stock", "at stock"), ("equal_latency", "at equal latency")):
        if r.get(f"dropped_repeats_{what}"):
            parts.append(
                f"{r[f'paired_repeats_{what}']} paired, {r[f'dropped_repeats_{what}']} "
                f"dropped {label}"
            )
    return ", ".join(parts)


def ratio_cell(r: dict[str, Any], what: str, missing: str = "-") -> str:
    """A row's ratio with its interval where it has one, and the repeats pairing left out."""
    # A null ratio with a verdict judged on it is infinite (the baseline at zero energy).
    infinite = r.get(f"verdict_{what}") in JUDGED_ON_A_RATIO
    if r[f"energy_ratio_{what}"] is None and not infinite:
        return ratio_text(None, missing)
    text = ratio_text(r[f"energy_ratio_{what}"], "inf")
    span = r.get(f"energy_ratio_{what}_interval")
    if span is not None and span != [None, None]:  # [inf, inf]: the point said already
        text += f" [{ratio_text(span[0], 'inf')}, {ratio_text(span[1], 'inf')}]"
    if what == "equal_latency" and edge_arms(r):
        text += " (grid edge)"
    if r.get(f"dropped_repeats_{what}"):
        paired = r[f"paired_repeats_{what}"]
        text += (
            f" ({paired} repeat{'s' if paired != 1 else ''} paired, "
            f"{r[f'dropped_repeats_{what}']} dropped)"
        )
    elif r.get(f"verdict_{what}") == "one paired repeat":
        text += " (one paired repeat)"
    return text


def _text(ds: xr.Dataset, name: str, at: dict[str, Any]) -> str:
    """A text variable's value at a point; "no data" where it is absent (merged cubes)."""
    if name not in ds:
        return "no data"
    value = ds[name].sel(at).item()
    return value if isinstance(value, str) else "no data"


def _verify_ridge(roof: xr.Dataset, batch: Any, drafter: Any) -> dict[str, float | None]:
    """The ridge point one verify pass is compared with, per clock (MHz, as text): the one
    `compute_bound_below_mhz` rests on (None where the pass's width is unknown)."""
    ridge = roof["verify_ridge_point"].sel(batch=batch, drafter=drafter)
    return {
        str(int(c)): as_float(v) for c, v in zip(roof["sm_clock"].values, ridge.values, strict=True)
    }


def _ridge_span(ridge: dict[str, float | None]) -> str:
    """A pass's ridge over the clocks, "117-250" ("no data" where none is known)."""
    known = [v for v in ridge.values() if v]
    if not known:
        return "no data"
    low, high = f"{min(known):.0f}", f"{max(known):.0f}"
    return low if low == high else f"{low}-{high}"


def _compute_bound_below(roof: xr.Dataset, batch: Any, drafter: Any) -> int | None:
    """The highest clock at which the verify pass is compute-bound (None: never, in this grid,
    or unknown where the pass's width is)."""
    bound = roof["compute_bound"].sel(batch=batch, drafter=drafter)
    clocks = roof["sm_clock"].values[bound.values]
    return int(clocks.max()) if len(clocks) else None


def ratio_text(value: float | None, missing: str = "-") -> str:
    """An energy ratio to two decimals, or as many more (up to four) as keep a ratio that is
    not 1 from reading "1.00": 0.997 saves, and the summary next to it says so."""
    if value is None:
        return missing
    for digits in (2, 3, 4):
        text = format(value, f".{digits}f")
        if value == 1 or float(text) != 1:
            return text
    return text


def too_slow(row: dict[str, Any]) -> bool:
    """Whether a row has no ratio at equal latency because no setting of the drafter met the
    baseline's latency at the reference ("not within target"), rather than for want of valid
    cells to compare (the baseline's reference cell not measured yet, failed or invalid:
    there is no latency to meet). A document without verdicts (older) goes by whether the
    drafter was measured at the reference."""
    if row["energy_ratio_equal_latency"] is not None:
        return False
    if "verdict_equal_latency" in row:
        return bool(row["verdict_equal_latency"] == NOT_WITHIN)
    return row["energy_per_token_at_stock_j"] is not None


def _no_ratio_text(row: dict[str, Any]) -> str:
    """The equal-latency cell of a row without a ratio: "too slow" (no setting's mean latency
    met the target), "not within target" (one's mean did, its bound at the confidence asked
    did not, as the verdict says), "too few repeats" (valid cells, too few usable repeats to
    judge a setting), else "-" (nothing valid to compare)."""
    if too_slow(row):
        return NOT_WITHIN if row.get(MEAN_WITHIN) else "too slow"
    return TOO_FEW if row.get("verdict_equal_latency") == TOO_FEW else "-"


def _full_ridge(ridges: dict[str, float | None]) -> str:
    """The full GEMM's ridge for the roofline table's title: a range over the clocks, or one
    figure where they share it (a cube of one SM clock)."""
    span = _ridge_span(ridges)
    if span == "no data":
        return "unknown"
    if "-" in span:
        return f"{span} FLOP/B over the clocks"
    clocks = sum(1 for v in ridges.values() if v)
    return f"{span} FLOP/B {'at its one clock' if clocks == 1 else 'at every clock'}"


def _ridge_source(roof: dict[str, Any]) -> str:
    """The roofline table's source: "llama-3.1-8b on h100-sxm" (the twin's physics of that
    GPU), or "llama-3.1-8b, ridge measured (NVIDIA H200)" for a `--roofline` file, whose ridge
    is not the twin profile's."""
    ridge = roof.get("ridge")
    if isinstance(ridge, str) and ridge.startswith("measured"):
        return f"{roof['model']}, ridge {ridge}"
    return f"{roof['model']} on {roof['gpu_profile']}"


def compare_tables(doc: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) triples for the terminal and Markdown renderings."""
    base = doc["baseline"]
    # A merged cube's rows carry their GPU: keep it as a column, or rows would look repeated.
    has_gpu = any("gpu" in r for r in doc["rows"] + doc["break_even_batch"])
    gpu_col = ["gpu"] if has_gpu else []

    def gpu(r: dict[str, Any]) -> list[str]:
        return [short_label(r.get("gpu", ""))] if has_gpu else []

    from dvfs.analysis.bounds import level_text

    energy = (
        f"Energy per token relative to {base!r} (below 1 saves energy)"
        + (
            (
                " [the cells' interval]"  # one repeat: each arm's own, over its rounds
                if str(doc.get("interval", "")).startswith("one repeat")
                else f" [{level_text(doc['confidence'])} interval]"
            )
            if any(r.get(f"energy_ratio_{w}_interval") for r in doc["rows"] for w in WHATS)
            else ""
        ),
        [
            *gpu_col,
            "batch",
            "drafter",
            "corpus",
            "at stock clock" if doc["reference"]["is_stock"] else "at reference clock",
            f"at equal latency ({doc['latency']})",
        ],
        [
            [
                *gpu(r),
                str(r["batch"]),
                r["drafter"],
                r["corpus"],
                ratio_cell(r, "at_stock"),
                ratio_cell(r, "equal_latency", missing=_no_ratio_text(r)),
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
    unmeasured = [
        *(doc.get("acceptance_no_valid_cell") or []),
        *(doc.get("acceptance_none_usable") or []),
        *(doc.get("acceptance_not_recorded") or []),
    ]
    if doc["acceptance"] or unmeasured:
        # the cube's order; the rows' where no drafter has an accept length
        corpora = list(dict.fromkeys(a["corpus"] for a in doc["acceptance"] or doc["rows"]))
        drafters = [
            *dict.fromkeys(a["drafter"] for a in doc["acceptance"]),
            *(d for d in unmeasured if d not in {a["drafter"] for a in doc["acceptance"]}),
        ]
        lookup = {(a["drafter"], a["corpus"]): a["accept_length"] for a in doc["acceptance"]}
        tables.append(
            (
                "Mean accept length (tokens per verify pass)",
                ["drafter", *corpora],
                [[d, *(fmt(lookup.get((d, c)), ".2f") for c in corpora)] for d in drafters],
            )
        )
    for roof in doc.get("roofline_per_gpu_model") or [doc[k] for k in ("roofline",) if k in doc]:
        tables.append(
            (
                f"Verify pass vs ridge point ({_ridge_source(roof)}; ridge "
                f"{_full_ridge(roof['ridge_point'])} for a full GEMM; each pass's own in its row: "
                "lower for few tokens, higher for a verify pass's slower KV-cache reads)",
                [
                    "batch",
                    "drafter",
                    "tokens/pass",
                    "FLOP/B",
                    "its ridge FLOP/B",
                    "compute-bound at or below",
                ],
                [
                    [str(v["batch"]), v["drafter"], *["no data"] * 4]
                    if v["verify_tokens"] is None
                    else [
                        str(v["batch"]),
                        v["drafter"],
                        str(v["verify_tokens"]),
                        fmt(v["arithmetic_intensity"], ".0f"),
                        _ridge_span(v["verify_ridge_point"]),
                        "never"
                        if v["compute_bound_below_mhz"] is None
                        else f"{v['compute_bound_below_mhz']} MHz",
                    ]
                    for v in roof["verify"]
                ],
            )
        )
    return tables


def compare_markdown(doc: dict[str, Any], said: Sequence[str] = ()) -> str:
    """The document in Markdown; `said`: the notes the command printed on stderr (a GPU model
    the sweep folder's cube leaves out; no roofline, a merged cube's GPU model left out of
    it), which a file of the Markdown would otherwise not hold."""
    parts = [
        f"## Speculative decoding vs {doc['baseline']!r}: {doc['campaign']} ({doc['gpu']})",
        "",
    ]
    for title, header, rows in compare_tables(doc):
        parts += [f"### {title}", "", markdown_table(header, rows), ""]
    parts += [*(f"- {n}" for n in (*compare_notes(doc), *said)), ""]
    return "\n".join(parts)
