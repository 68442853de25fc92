"""The report's first section: what was measured, how, when, and how clean the data is.

Built from `dvfs cube info`'s summary and the cube's provenance attributes; an attribute the
cube lacks (an older or merged cube) reads "not recorded", never a guess.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from dvfs.report.common import campaign_hash, gpu_uuids
from dvfs.report.model import Code, Facts, Paragraph, Section, Table

if TYPE_CHECKING:
    import xarray as xr

MISSING = "not recorded"
#: Failed cells listed by name; more are counted.
MAX_FAILED_LISTED = 20


def _json_attr(attrs: dict[Any, Any], name: str) -> Any:
    try:
        return json.loads(str(attrs[name]))
    except (KeyError, ValueError):
        return None


def _text(value: Any) -> str:
    return MISSING if value is None or str(value) in ("", "None", "nan") else str(value)


def _values(info: dict[str, Any], dim: str, unit: str = "") -> str:
    values = info["coords"].get(dim, [])
    shown = [str(v).removesuffix(".0") for v in values]
    return ", ".join(shown) + unit if shown else MISSING


def _knob_values(
    info: dict[str, Any],
    dim: str,
    unit: str,
    swept: bool,
    found: bool,
    lifted: str | None = None,
    gpus: int = 1,
    enforced: str | None = None,
) -> str:
    """A knob's values (`_values`), or, where the campaign never set it, that it was not: its
    coordinate then holds the stock value the cube files the cells under (the unlocked SM
    clock's maximum, the power limit as found), which dvfs never applied. `found`: measured
    observe-only, where a clock lock set outside dvfs stays (not "unlocked"). `lifted`: the
    power limit found at start where it was a cap dvfs applied, which the stock cells ran
    without, at the GPU's default limit (`lifted_caps_w`); `gpus`: how many GPUs the cube
    holds; `enforced`: where the stock limit is the one NVML enforced, on a GPU whose power
    limit it does not support (`enforced_stock_text`)."""
    from dvfs.cube.knobs import unset_knob_text

    values = _values(info, dim, unit)
    if swept or values == MISSING:
        return values
    return unset_knob_text(dim, values, found, lifted, gpus, enforced)


def measured_section(cube: xr.Dataset) -> Section:
    """Campaign, hardware, software, grid, dates and data quality, as the cube records them."""
    from dvfs.cube.idle import idle_caveat, idle_power_text
    from dvfs.cube.info import info_text, mode_text
    from dvfs.cube.knobs import enforced_stock_text, lifted_caps_text, observe_only, swept_knobs

    info = info_text(cube)
    a = cube.attrs
    clock_set, limit_set = swept_knobs(cube)
    found = observe_only(cube)
    uuids = gpu_uuids(cube)
    lifted = lifted_caps_text(cube)
    tp = f" (tensor parallel {a['tp_size']})" if "tp_size" in a else ""
    memory = f"; memory clock {a['memory_clock_mhz']} MHz" if "memory_clock_mhz" in a else ""
    # `cube info`'s count: a cube merged across GPUs keeps each source's in `merged_from`
    count = info.get("sessions")
    sessions = f" from {count} measurement session(s)" if count is not None else ""
    pairs = [
        ("Campaign", f"{_text(info['campaign'])} (hash {_campaign_hash(a)})"),
        ("GPU", _text(info["gpu"])),
        ("GPU UUIDs", ", ".join(gpu_uuids(cube)) or MISSING),
        ("Driver", _text(info["driver"]) + memory),
        ("Engine", info["engine"] if a.get("engine_backend") else MISSING),
        ("Model", _text(info["model"]) + tp),
        ("SM clocks", _knob_values(info, "sm_clock", " MHz", clock_set, found)),
        (
            "Power limits",
            _knob_values(
                info,
                "power_limit",
                " W",
                limit_set,
                found,
                lifted,
                len(uuids),
                enforced_stock_text(cube),
            ),
        ),
        ("Batch sizes", _values(info, "batch")),
        ("Drafters", _values(info, "drafter")),
        ("Corpora", _values(info, "corpus")),
        ("Repeats", info["repeats"]),
        ("Reference", info["stock"]),
        (
            "Idle power",
            idle_power_text(info, "g") or MISSING + idle_caveat(info["idle_foreign_processes"]),
        ),
        ("Cube built", _text(info["created"]) + sessions),
        ("History", _text(a.get("history"))),
        ("dvfs version", _text(a.get("dvfs_version"))),
        ("Measurement method", _text(a.get("measurement_method"))),
        ("Measurement mode", _text(mode_text(info["measurement_mode"]))),
        ("Token counts", _text(a.get("token_count_method"))),
    ]
    # Where a server's GPUs were checked (real GPUs): verified, or unverified and why.
    pairs += [(f"GPU pinning ({d})", o) for d, o in info["gpu_pinning"].items()]
    blocks: list[Any] = [Facts(tuple(pairs))]
    blocks += _merged_from(a)
    blocks += _server_args(a)
    blocks += _corpora(a)
    blocks += _quality(info)
    from dvfs.cube.pinning import pinning_note

    unverified = pinning_note(cube)
    if unverified:
        blocks.append(Paragraph(unverified + ".", tone="warning"))
    if a.get("campaign_source"):
        blocks.append(Code("Campaign file", str(a["campaign_source"]).strip("\n"), folded=True))
    return Section("What was measured", "what-was-measured", tuple(blocks))


def _campaign_hash(attrs: dict[Any, Any]) -> str:
    """The cube's campaign hash (`campaign_hash`); "not recorded" where none is."""
    return campaign_hash(attrs) or MISSING


def _server_args(attrs: dict[Any, Any]) -> list[Table]:
    """The engine's resolved arguments per drafter (what each server really ran with)."""
    resolved = _json_attr(attrs, "server_args")
    if not isinstance(resolved, dict) or not resolved:
        return []
    rows = []
    for drafter, entry in resolved.items():
        entry = entry if isinstance(entry, dict) else {}
        given = entry.get("args")
        args: dict[str, Any] = given if isinstance(given, dict) else {}
        text = "; ".join(f"{k}={json.dumps(v)}" for k, v in sorted(args.items()))
        engine = f"{_text(entry.get('engine'))} {_text(entry.get('version'))}"
        rows.append((str(drafter), engine, text or MISSING))
    return [Table("Resolved server arguments", ("drafter", "engine", "arguments"), tuple(rows))]


def ecc_mode_warnings(attrs: dict[Any, Any]) -> list[str]:
    """A merged cube's warning for each GPU model whose GPUs ran with different ECC modes
    (where their cubes read them), as the report and `dvfs compare` say it: of two models, the
    boards differ anyway."""
    sources = _json_attr(attrs, "merged_from")
    if not isinstance(sources, dict):
        return []
    modes: dict[str, dict[str, list[str]]] = {}
    for label, s in sources.items():
        if isinstance(s, dict) and (mode := _ecc_mode(s.get("ecc_mode"))) is not None:
            of_model = modes.setdefault(_text(s.get("gpu_name")), {})
            of_model.setdefault(mode, []).append(str(label))
    warnings = []
    for model, by_mode in modes.items():
        if len(by_mode) < 2:
            continue
        said = "; ".join(f"ECC {mode}: {', '.join(gpus)}" for mode, gpus in sorted(by_mode.items()))
        warnings.append(
            f"The {model} GPUs ran with different ECC modes ({said}): ECC's check bits cost "
            "memory bandwidth and energy, so their cells differ in that as well; compare GPUs "
            "of one ECC mode."
        )
    return warnings


def _ecc_mode(value: Any) -> str | None:
    """A merged cube's source's ECC mode as NVML words it ("on", "off", "on (pending off)");
    None where it is not recorded, or is not such a name (a hand-edited cube: a list, a
    newline or a terminal's escape, a page of text), which tells no ECC mode apart."""
    from dvfs.cube.schema import MAX_NAME_CHARS

    if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS:
        return None
    return value if value.isprintable() and value not in ("None", "nan") else None


def _merged_from(attrs: dict[Any, Any]) -> list[Paragraph | Table]:
    """A merged cube's sources: each GPU's campaign, driver, ECC mode, engine and date; a
    warning first where the GPUs ran with other ECC modes (where their cubes read them)."""
    sources = _json_attr(attrs, "merged_from")
    if not isinstance(sources, dict) or not sources:
        return []
    sources = {label: s for label, s in sources.items() if isinstance(s, dict)}
    keys = (
        "gpu_name",
        "campaign_name",
        "campaign_hash",
        "driver_version",
        "ecc_mode",
        "engine_version",
    )
    rows = tuple(
        (
            str(label),
            *(_text(s.get(k)) if k != "ecc_mode" else _ecc_mode(s.get(k)) or MISSING for k in keys),
            _text(s.get("created")),
        )
        for label, s in sources.items()
    )
    header = ("GPU", "model", "campaign", "hash", "driver", "ECC", "engine", "measured")
    blocks: list[Paragraph | Table] = [Table("Merged from", header, rows)]
    for text in ecc_mode_warnings(attrs):
        blocks.insert(0, Paragraph(text, tone="warning"))
    return blocks


def _corpora(attrs: dict[Any, Any]) -> list[Table]:
    corpora = _json_attr(attrs, "corpora")
    if not isinstance(corpora, dict) or not corpora:
        return []
    rows = tuple(
        (
            str(name),
            _text(c.get("prompts")),
            _text(c.get("source")),
            _text(c.get("content_hash")),
        )
        for name, c in corpora.items()
        if isinstance(c, dict)
    )
    return [Table("Corpora", ("corpus", "prompts", "source", "content hash"), rows)]


def _quality(info: dict[str, Any]) -> list[Any]:
    """Counts of measured, failed, missing and invalid cells; flags; the failed cells. The
    adaptive repeats a cell did not need (it reached its precision first) are counted apart:
    neither missing nor bad. A shard's cube says so first (the other shards' cells are missing
    from it)."""
    not_needed = info["not_needed"]
    counts = [
        ("Cells", str(info["cells"])),
        ("Measured", str(info["measured"])),
        ("Failed", str(info["failed"])),
        ("Missing", str(info["missing"])),
        ("Invalid (flagged)", str(info["invalid"])),
    ]
    if not_needed:
        counts.append(("Adaptive repeats not needed", str(not_needed)))
    blocks: list[Any] = [Facts(tuple(counts))]
    bad = info["failed"] + info["missing"] + info["invalid"]
    asked = info["cells"] - not_needed
    if bad:
        blocks.insert(
            0,
            Paragraph(
                f"Data quality: {bad} of {asked} cells are failed, missing or flagged "
                "invalid; the analyses never choose a setting with such a cell.",
                tone="warning",
            ),
        )
    from dvfs.cube.cells_left import shard_note

    shard = shard_note(info.get("shard"), info)
    if shard:
        blocks.insert(0, Paragraph(shard[:1].upper() + shard[1:] + ".", tone="warning"))
    elif not bad:  # else the warning above says what is not
        extra = (
            f" ({not_needed} adaptive repeat(s) not needed: those cells reached the precision "
            "in fewer than max_repeats)"
            if not_needed
            else ""
        )
        blocks.insert(0, Paragraph(f"Data quality: every cell was measured and valid{extra}."))
    flags = info["quality_flags"]
    if flags:
        from dvfs.cube.quality import invalidates

        blocks.append(
            Table(
                "Quality flags raised (cells)",
                ("flag", "cells", "effect"),
                tuple(
                    (
                        name,
                        str(count),
                        "invalid: never chosen by an analysis"
                        if invalidates(name)
                        else "warning: the cell stays valid",
                    )
                    for name, count in flags.items()
                ),
            )
        )
        # what a warning means where it needs saying (as `dvfs cube info` says it)
        blocks += [
            Paragraph(f"{name}: {note}.", tone="note") for name, note in info["flag_notes"].items()
        ]
    failed = info["failed_cells"]
    if failed:
        from dvfs.cube.info import failed_cell_label

        # each as the sweep named it, with its error
        rows = tuple(
            (failed_cell_label(item["cell"], item.get("gpu")), str(item.get("error", "")))
            if isinstance(item, dict) and "cell" in item
            else (json.dumps(item, sort_keys=True) if not isinstance(item, str) else item, "")
            for item in failed[:MAX_FAILED_LISTED]
        )
        more = len(failed) - MAX_FAILED_LISTED
        title = "Failed cells" + (f" (first {MAX_FAILED_LISTED}; {more} more)" if more > 0 else "")
        blocks.append(Table(title, ("cell", "error"), rows))
    return blocks
