"""`dvfs headroom` as a document (schema dvfs.headroom/1, the input of `dvfs cap plan`), its
table rows and its Markdown."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.records import knobs_set
from dvfs.report.common import (
    as_float,
    as_int,
    campaign_hash,
    fmt,
    fmt_ms,
    gpu_names,
    gpu_uuids,
    gpus_of,
    group_dims,
    markdown_table,
    named_rows,
    reference_label,
    reference_setting,
    reference_text,
    short_gpus,
    short_label,
    unmeasured_cells,
)
from dvfs.report.reasons import no_answer, no_answer_groups

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
            judged_settings=int(r["judged_settings"]) if "judged_settings" in r else None,
            short_settings=int(r["short_settings"]) if "short_settings" in r else None,
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
            # the reference's energy over the repeats the saving is over (measured at both)
            paired_stock_energy_per_token_j=(
                as_float(r["paired_stock_energy_per_token_j"])
                if "paired_stock_energy_per_token_j" in r
                else None
            ),
            saving_repeats=as_int(r["saving_repeats"]) if "saving_repeats" in r else None,
            saving=as_float(r["saving"]),
            baseline_energy_per_token_j=as_float(r["baseline_energy_per_token_j"]),
            saving_vs_baseline=as_float(r["saving_vs_baseline"]),
            latency_ms=as_float(r["chosen_latency_ms"]),
            reference_latency_ms=as_float(r["reference_latency_ms"]),
            target_ms=as_float(r["target_ms"]),
            latency_bound=as_float(r["latency_bound"]),
            repeats=as_int(r["repeats"]),
            headroom_mhz_is_lower_bound=_flag(r, "headroom_mhz_is_lower_bound"),
            headroom_w_is_lower_bound=_flag(r, "headroom_w_is_lower_bound"),
            chosen_at_grid_edge=_flag(r, "chosen_at_grid_edge"),
            headroom_mhz_unmeasured_below=_flag(r, "headroom_mhz_unmeasured_below"),
            headroom_w_unmeasured_below=_flag(r, "headroom_w_unmeasured_below"),
            chosen_unmeasured_below=_flag(r, "chosen_unmeasured_below"),
            headroom_mhz_invalid_below=_flag(r, "headroom_mhz_invalid_below"),
            headroom_w_invalid_below=_flag(r, "headroom_w_invalid_below"),
            chosen_invalid_below=_flag(r, "chosen_invalid_below"),
            cap_not_binding=_flag(r, "cap_not_binding"),
            saving_set_aside_within_noise=_flag(r, "saving_set_aside_within_noise"),
            saving_within_noise=_flag(r, "saving_within_noise"),
            within_noise=_within_noise(r),
            unmeasured_settings=(
                int(r["unmeasured_settings"]) if "unmeasured_settings" in r else None
            ),
            failed_settings=int(r["failed_settings"]) if "failed_settings" in r else None,
            invalid_settings=int(r["invalid_settings"]) if "invalid_settings" in r else None,
            invalid_flags=(
                str(r["invalid_flags"].values) or None if "invalid_flags" in r else None
            ),
            reference_problem=(
                str(r["reference_problem"].values) or None if "reference_problem" in r else None
            ),
            measured_on=gpus_of(r, "measured_on"),
            reference_measured_on=gpus_of(r, "reference_measured_on"),
            different_gpus=_flag(r, "different_gpus"),
        )
        row["at_grid_edge"] = row["headroom_mhz_is_lower_bound"] or row["headroom_w_is_lower_bound"]
        if (
            result.attrs["target_mode"] == "vs-baseline"
            and row.get("drafter") != result.attrs["baseline"]
        ):
            row["reference_drafter"] = result.attrs["baseline"]  # whose stock cell the target is
        rows.append(row)
    a = result.attrs
    _mark_precision_missed(rows, cube, reference_setting(a))
    from dvfs.analysis.headroom import coverage

    return {
        "schema": HEADROOM_SCHEMA,
        "campaign": cube.attrs.get("campaign_name"),
        "campaign_hash": campaign_hash(cube.attrs),  # a merged cube's: its sources'
        "gpu": _gpu(cube),
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
        # as the search saw it: one GPU of a merged cube holds only its own stock setting of a
        # knob its campaign left at stock, however many the merged axis holds
        "swept": {
            "sm_clock": bool(int(a.get("sm_clock_swept", cube.sizes.get("sm_clock", 1) > 1))),
            "power_limit": bool(
                int(a.get("power_limit_swept", cube.sizes.get("power_limit", 1) > 1))
            ),
        },
        # Whether the campaign set each knob: an unset SM clock was the GPU's own, so a row's
        # `chosen.sm_clock_mhz` is the stock clock the cube files it under, not a lock.
        "knobs_set": {
            "sm_clock": bool(int(a.get("sm_clock_locked", 1))),
            "power_limit": bool(knobs_set(cube.attrs.get("campaign"))[1]),
        },
        "coverage": coverage(cube),
        # the precision the sweep measured each cell to, at most max_rounds rounds (each row's
        # `precision_missed` names its cells that stopped short of it); None: not recorded
        "measurement": _asked(cube),
        # One shard's cube (`dvfs sweep --shard I/N`): the other shards' cells are not in it;
        # a cube merged from shards: each shard's folder, whose sweep measures its cells left;
        # a fleet's cube whose cells left are on some GPU models only: those models.
        **_cells_left_where(cube),
        "rows": rows,
    }


def _mark_precision_missed(
    rows: list[dict[str, Any]], cube: xr.Dataset, reference: dict[str, Any]
) -> None:
    """Each row's `precision_missed`: which cells its answer rests on ("chosen", the chosen
    setting's; "reference", its own reference's, which the saving divides by; "baseline
    reference", the baseline drafter's a vs-baseline target is) stopped at
    `measurement.max_rounds` with an interval wider than the precision, any repeat of them
    (`dvfs.cube.precision`): empty where none, None where the cube cannot say."""
    from dvfs.cube.precision import precision_missed

    values = precision_missed(cube)
    for row in rows:
        row["precision_missed"] = None if values is None else []
    if values is None:
        return
    flags = values.fillna(0).values == 1
    index = {str(d): cube.indexes[d] for d in values.dims if d in cube.indexes}

    def missed(row: dict[str, Any], setting: dict[str, Any], drafter: str) -> bool | None:
        at = {**row, "drafter": drafter, "sm_clock": setting.get("sm_clock_mhz")}
        at["power_limit"] = setting.get("power_limit_w")
        where: list[Any] = []
        for dim in map(str, values.dims):
            if dim == "repeat":
                where.append(slice(None))
                continue
            try:
                where.append(index[dim].get_loc(at[dim]))
            except (KeyError, TypeError):  # not a cell of the cube (no setting chosen)
                return None
        return bool(flags[tuple(where)].any())

    for row in rows:
        ref = reference.get("per_gpu", {}).get(str(row.get("gpu")), reference)
        chosen = row["chosen"]
        is_ref = (chosen["sm_clock_mhz"], chosen["power_limit_w"]) == (
            ref.get("sm_clock_mhz"),
            ref.get("power_limit_w"),
        )
        checks = [("reference", ref, row["drafter"])]
        if row.get("feasible") and not is_ref:
            checks.insert(0, ("chosen", chosen, row["drafter"]))
        if row.get("reference_drafter"):
            checks.append(("baseline reference", ref, row["reference_drafter"]))
        row["precision_missed"] = [what for what, at, d in checks if missed(row, at, d)]


def precision_note(doc: dict[str, Any]) -> str | None:
    """One line naming the rows whose answer rests on a cell that stopped at
    `measurement.max_rounds` short of the precision (`_mark_precision_missed`)."""
    rows = [r for r in doc["rows"] if r.get("precision_missed")]
    if not rows:
        return None
    asked = doc.get("measurement") or {}
    rounds, precision = asked.get("max_rounds"), asked.get("precision")
    cap = "measurement.max_rounds" + ("" if rounds is None else f" ({rounds})")
    wider = "the precision" + ("" if precision is None else f" (±{precision * 100:g}%)")
    return (
        f"precision missed: {len(rows)} of {len(doc['rows'])} row(s) rest on a cell that "
        f"stopped at {cap} with an interval wider than {wider} "
        f"({named_rows(rows, lambda r: ', '.join(r['precision_missed']))}): valid, but their "
        "energy and latency are less certain than asked (precision_missed in the cube; "
        "`dvfs cube info` counts such cells)"
    )


def _asked(cube: xr.Dataset) -> dict[str, Any] | None:
    from dvfs.cube.precision import asked

    wanted = asked(cube.attrs.get("campaign"))
    return None if wanted is None else {"precision": wanted[0], "max_rounds": wanted[1]}


def _cells_left_where(cube: xr.Dataset) -> dict[str, Any]:
    """What the resume advice needs: the cube's shards (`shards_of`), the GPU models its
    cells left are on where that is some of a fleet's models only (`models_left`), and the
    drafters whose failed cells a rerun fails again (`unfit_left`)."""
    from dvfs.cube.cells_left import models_left, shards_of, unfit_left  # not at import (dvfs.cube)

    return {**shards_of(cube), **models_left(cube), **unfit_left(cube)}


def _gpu(cube: xr.Dataset) -> dict[str, Any]:
    """The GPUs measured: `name` their models (a merged cube's distinct models, joined),
    `uuids` every UUID recorded, and in a merged cube `names`, each row's `gpu` label ->
    its model, which `dvfs cap plan` keys simulated caps by."""
    gpu: dict[str, Any] = {
        "name": cube.attrs.get("gpu_name"),
        "uuids": gpu_uuids(cube),
        "backend": cube.attrs.get("gpu_backend"),
    }
    names = gpu_names(cube)
    if names:
        gpu["name"] = ", ".join(dict.fromkeys(names.values()))
        gpu["names"] = names
    return gpu


def _flag(r: xr.Dataset, name: str) -> bool:
    return bool(r[name]) if name in r else False


def _within_noise(r: xr.Dataset) -> dict[str, Any] | None:
    """The setting whose saving lay within the noise (set aside, or kept where nothing else
    met the target): its knobs, saving, the saving's interval and the repeats paired."""
    if not (_flag(r, "saving_set_aside_within_noise") or _flag(r, "saving_within_noise")):
        return None
    return {
        "sm_clock_mhz": as_int(r["within_noise_sm_clock"]),
        "power_limit_w": as_float(r["within_noise_power_limit"]),
        "saving": as_float(r["within_noise_saving"]),
        "saving_interval": [
            as_float(r["within_noise_saving_low"]),
            as_float(r["within_noise_saving_high"]),
        ],
        "paired_repeats": as_int(r["within_noise_paired_repeats"]),
    }


#: The table's mark on a saving within the measurement noise.
NOISE_MARK = "≈"


def noise_note(doc: dict[str, Any]) -> list[str]:
    """Lines for savings within the noise: a least-energy setting set aside for it (the row
    keeps the reference, or a setting that saves beyond it), and a chosen setting kept with
    one (nothing else met the target), each with its numbers."""
    clock_locked = clock_was_locked(doc)

    def numbers(r: dict[str, Any]) -> str:
        n = r["within_noise"]
        clock = f"{n['sm_clock_mhz']} MHz / " if clock_locked else ""
        # an end null in the document is infinite (a zero energy beside others: the ratio's
        # interval is unbounded), a saving of minus infinity
        low, high = ("-inf%" if e is None else f"{e * 100:.1f}%" for e in n["saving_interval"])
        pairs = n["paired_repeats"] or 0
        basis = f"over {pairs} paired repeats" if pairs >= 2 else "by the cells' own intervals"
        return (
            f"{clock}{n['power_limit_w']:g} W saves {n['saving'] * 100:.1f}% "
            f"[{low}, {high}] ({basis})"
        )

    rows = [r for r in doc["rows"] if r.get("feasible") and r.get("within_noise")]
    aside = [r for r in rows if r.get("saving_set_aside_within_noise")]
    kept = [r for r in rows if r.get("saving_within_noise")]
    notes = []
    if aside:
        notes.append(
            f"no saving beyond noise: in {len(aside)} row(s) the least-energy setting's saving "
            "is not told apart from zero by its interval, so the row keeps the reference, or "
            f"a setting that saves beyond the noise ({named_rows(aside, numbers)})"
        )
    if kept:
        notes.append(
            f"{NOISE_MARK}: in {len(kept)} row(s) the saving is within the noise, yet no "
            "setting that saves beyond it (nor the reference) met the target; no saving is "
            f"shown to exist there ({named_rows(kept, numbers)})"
        )
    return notes


#: The table's marks on a headroom value: cut off by the grid, settings below not measured
#: yet, settings below measured but invalid.
LOWER_BOUND_MARK, UNMEASURED_MARK, INVALID_MARK = "≥", "?", "†"


#: The chosen clock of a campaign that never set the SM clock (power limit only).
UNLOCKED = "not set"


def clock_was_locked(doc: dict[str, Any]) -> bool:
    """Whether the campaign locked the SM clock (documents without `knobs_set`: yes)."""
    return bool(doc.get("knobs_set", {}).get("sm_clock", True))


#: The headroom of a knob `--knob` held at the reference (the search never moved it).
HELD = "held"


def _knob_cell(
    value: float | None,
    lower_bound: bool,
    spec: str,
    unmeasured: bool,
    invalid: bool,
    held: bool = False,
) -> str:
    if value is None:
        return HELD if held else "not swept"
    return (
        (LOWER_BOUND_MARK if lower_bound else "")
        + format(value, spec)
        + (UNMEASURED_MARK if unmeasured else "")
        + (INVALID_MARK if invalid else "")
    )


def _resume_note(doc: dict[str, Any]) -> str:
    from dvfs.cube.cells_left import resume_note

    return resume_note(doc)


def _resume_advice(what: str, doc: dict[str, Any]) -> str:
    from dvfs.cube.cells_left import resume_advice

    return resume_advice(what, doc)


def partial_note(doc: dict[str, Any]) -> str | None:
    """One line when the cube is partial (cells not measured yet): which answers may change,
    and that resuming the sweep, not a larger grid, measures them."""
    cov = doc.get("coverage") or {}
    waiting = int(cov.get("missing", 0)) + int(cov.get("failed", 0))
    if not waiting:
        return None
    if doc.get("shard"):
        from dvfs.cube.cells_left import shard_note

        return (
            f"partial cube: {unmeasured_cells(cov, 'here')}; answers marked ? and rows without "
            f"a measured reference may change: {shard_note(doc['shard'], doc)}"
        )
    return (
        f"partial cube: {unmeasured_cells(cov)}; answers marked ? and rows without a measured "
        f"reference may change: {_resume_note(doc)}"
    )


def holds_no_session(journal: object) -> str:
    """What a GPU model's journal left out of its fleet's cube is: one holding no session yet,
    or one missing from the model's folder (moved or deleted: nothing measured is left)."""
    import os

    return f"{journal} {'holds no session yet' if os.path.lexists(str(journal)) else 'is missing'}"


def left_out_note(journal: object) -> str:
    """The line saying a cube leaves out the GPU model whose `journal` holds no session yet
    (or is missing), and how to measure it: one wording for `dvfs cube info`, `dvfs headroom`
    and `dvfs report`."""
    return (
        f"left out: {holds_no_session(journal)} (nothing measured on that GPU model): the "
        "cube leaves that model out; run the `dvfs sweep` command again without --fresh, its "
        "--gpus naming GPUs of that model, to measure it"
    )


#: The document keys whose cube a plain "resume the sweep" does not finish: a shard's, one
#: merged from shards or sweeps, a fleet's whose cells left are on some GPU models only.
_RESUMED_ELSEWHERE = ("shard", "merged_shards", "merged_cubes", "models_left")


def headroom_notes(doc: dict[str, Any], *, no_answers: bool = True) -> list[str]:
    """The lines that qualify the table: an answer cut off by the grid, a knob never swept,
    a setting measured on another GPU than its reference. Empty when nothing needs saying.
    `no_answers` False: without the rows that have no answer and their advice (the report,
    whose findings give each such row its reason and advice in the same words)."""
    rows = [r for r in doc["rows"] if r["feasible"]]
    # a GPU model the sweep folder's cube leaves out (`left_out`, which the caller adds where
    # the cube is a sweep folder's), as `dvfs cube info` says it: else the answer reads whole
    notes = [left_out_note(journal) for journal in doc.get("left_out", ())]
    partial = partial_note(doc)
    if partial:
        notes.append(partial)
    # Rows without an answer: why, and what would give them one, as the report's findings
    # and caps and `dvfs cap plan` say it (those the partial-cube note tells to resume aside).
    unanswered = no_answer_groups(doc["rows"], doc["target"].get("mode"), doc) if no_answers else []
    for reason, advice, group in unanswered:
        if not (partial and "not measured yet" in reason):
            notes.append(f"no answer: {reason} ({named_rows(group, None)}): {advice}")
    clock_open = any(r.get("headroom_mhz_unmeasured_below") for r in rows)
    limit_open = any(r.get("headroom_w_unmeasured_below") for r in rows)
    if clock_open or limit_open:
        knobs = " and ".join(
            k for k, flag in (("clocks", clock_open), ("power limits", limit_open)) if flag
        )
        notes.append(
            f"?: {knobs} below this answer are in the grid but not measured yet, so the "
            "headroom may be larger and a lower setting might save more: "
            + (
                _resume_advice("them", doc)
                if any(doc.get(k) for k in _RESUMED_ELSEWHERE)
                else "resume the sweep to measure them"
            )
            + " (the grid does not need extending)"
        )
    spoilt = invalid_note(rows)
    if spoilt:
        notes.append(spoilt)
    clock_edge = any(r["headroom_mhz_is_lower_bound"] for r in rows)
    limit_edge = any(r["headroom_w_is_lower_bound"] for r in rows)
    if clock_edge or limit_edge:
        knobs = " and ".join(
            k
            for k, edge in (("knobs.sm_clock", clock_edge), ("knobs.power_limit", limit_edge))
            if edge
        )
        notes.append(
            "≥: the lowest setting swept still meets the target, so the headroom is at least "
            "this (the grid cuts it off) and a lower setting might save more than the chosen "
            f"one; extend {knobs} downward to find where it stops"
        )
    swept = doc.get("swept", {})
    unswept = [
        name
        for key, name in (("sm_clock", "SM clock"), ("power_limit", "power limit"))
        if swept.get(key) is False
    ]
    if unswept and rows:
        notes.append(
            f"not swept: the cube has one {' and one '.join(unswept)}, so that headroom is "
            "unknown, not 0"
        )
    if rows and not clock_was_locked(doc):
        notes.append(
            f"{UNLOCKED}: the campaign never set the SM clock, so the chosen setting names no "
            "clock: the GPU kept its own (unlocked, unless locked outside dvfs); the cube files "
            "those cells under its stock clock, which is no lock"
        )
    notes += noise_note(doc)
    imprecise = precision_note(doc)
    if imprecise:
        notes.append(imprecise)
    paired = paired_stock_note(rows, reference_label(doc["reference"]))
    if paired:
        notes.append(paired)
    mixed = [r for r in rows if r.get("different_gpus")]
    if mixed:
        named = named_rows(
            mixed,
            lambda r: f"{short_gpus(r['measured_on'])} vs {short_gpus(r['reference_measured_on'])}",
        )
        notes.append(
            f"different GPUs: {len(mixed)} of {len(rows)} rows were measured on another GPU "
            f"than their reference ({named}); GPU-to-GPU spread is part of those latency and "
            "energy ratios: measure both on one GPU to remove it"
        )
    return notes


def saving_stock_energy(row: dict[str, Any]) -> float | None:
    """The reference's energy per token a row's saving divides by: over the repeats measured
    at both the chosen setting and the reference (`paired_stock_energy_per_token_j`), so that
    it and the chosen energy give the saving shown beside them; a document of an earlier dvfs
    has only the reference's energy over all its usable repeats."""
    paired = row.get("paired_stock_energy_per_token_j")
    return row["stock_energy_per_token_j"] if paired is None else paired


def paired_stock_note(rows: list[dict[str, Any]], label: str) -> str | None:
    """Rows whose saving is over fewer repeats than the reference's energy over all its
    usable ones (adaptive repeats the chosen setting did not take, or a repeat flagged at
    one of the two): the J/tok column beside the saving is over the repeats measured at both,
    which the note says, with the reference's energy over all of them."""
    differ = [
        r
        for r in rows
        if r.get("paired_stock_energy_per_token_j") is not None
        and r.get("stock_energy_per_token_j") is not None
        and r["paired_stock_energy_per_token_j"] != r["stock_energy_per_token_j"]
    ]
    if not differ:
        return None
    named = named_rows(
        differ,
        lambda r: (
            f"{r['saving_repeats']} repeat(s), {r['stock_energy_per_token_j']:.4g} J over all"
        ),
    )
    return (
        f"J/tok {label} beside a saving is over the repeats measured at both the chosen setting "
        "and the reference (the same prompts), as the saving is; over all the reference's "
        f"usable repeats it differs ({named})"
    )


def invalid_note(rows: list[dict[str, Any]]) -> str | None:
    """The † note: settings below an answer were measured but are invalid, so the answer
    stops at the measurement, not at the GPU or the grid; which flags, and what to change."""
    from dvfs.report.reasons import flag_advice

    marked = [
        r
        for r in rows
        if r.get("headroom_mhz_invalid_below")
        or r.get("headroom_w_invalid_below")
        or r.get("chosen_invalid_below")
    ]
    if not marked:
        return None
    clock = any(r.get("headroom_mhz_invalid_below") for r in marked)
    limit = any(r.get("headroom_w_invalid_below") for r in marked)
    knobs = (
        " and ".join(k for k, flag in (("clocks", clock), ("power limits", limit)) if flag)
        or "settings"
    )
    flags = sorted({f for r in marked for f in (r.get("invalid_flags") or "").split(", ") if f})
    named = named_rows(marked, lambda r: r.get("invalid_flags") or "invalid")
    return (
        f"{INVALID_MARK}: {knobs} below the answer are in the grid but their cells are "
        f"invalid ({', '.join(flags) or 'see `dvfs cube info`'}), so the headroom may be "
        "larger and a lower setting might save more; the grid does not need extending: "
        f"{flag_advice(flags)} (rows: {named})"
    )


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
        f"J/tok {reference_label(doc['reference'])}",
        "J/tok chosen",
        "saving",
        "latency ms",
        "target ms",
    ]
    rows = []
    clock_locked = clock_was_locked(doc)
    for r in doc["rows"]:
        lead = [short_label(r["gpu"])] if has_gpu else []
        if not r["feasible"]:
            cells = [
                no_answer(r),
                "-",
                fmt(r["stock_energy_per_token_j"], ".4g"),
                "-",
                "-",
                "-",
                fmt_ms(r["target_ms"]),
            ]
        else:
            clock = r["chosen"]["sm_clock_mhz"] if clock_locked else UNLOCKED
            chosen = f"{clock}/{r['chosen']['power_limit_w']:g}"
            headroom = (
                _knob_cell(
                    r["headroom_mhz"],
                    r.get("headroom_mhz_is_lower_bound", False),
                    "d",
                    r.get("headroom_mhz_unmeasured_below", False),
                    r.get("headroom_mhz_invalid_below", False),
                    held=doc.get("knob") == "power_limit",
                )
                + "/"
                + _knob_cell(
                    r["headroom_w"],
                    r.get("headroom_w_is_lower_bound", False),
                    "g",
                    r.get("headroom_w_unmeasured_below", False),
                    r.get("headroom_w_invalid_below", False),
                    held=doc.get("knob") == "sm_clock",
                )
            )
            cells = [
                chosen,
                headroom,
                fmt(saving_stock_energy(r), ".4g"),
                fmt(r["energy_per_token_j"], ".4g"),
                # unknown (no valid energy at the reference, an SLO's answer): "-", not "-%"
                "-"
                if r["saving"] is None
                else (NOISE_MARK if r.get("saving_within_noise") else "")
                + f"{r['saving'] * 100:.1f}%",
                fmt_ms(r["latency_ms"]),
                fmt_ms(r["target_ms"]),
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
        f"- Knob: {doc['knob']}; reference: {reference_text(ref)}",
        f"- Feasibility: {doc['bound']}",
        "- Headroom: the reference minus the lowest feasible setting; chosen: the feasible "
        "setting with the least energy per token of those that save beyond the measurement "
        "noise, and the reference (saving against the drafter's own energy at the reference)",
        "",
        markdown_table(header, rows),
    ]
    notes = headroom_notes(doc)
    if notes:
        lines += ["", *(f"- {n}" for n in notes)]
    return "\n".join(lines) + "\n"
