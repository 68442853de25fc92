"""`dvfs report`: a cube, a target and the figures' bytes in, a `Document` out (pure).

The numbers come from the analyses the other commands print (`headroom`, `compare`, `cap
plan`), through their documents, so the report never disagrees with them.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dvfs.analysis.bounds import level_text
from dvfs.analysis.targets import Target
from dvfs.report.common import gpu_names, gpu_words, reference_label
from dvfs.report.facts import measured_section
from dvfs.report.findings import findings_section
from dvfs.report.model import Code, Document, Figure, Paragraph, Section, Table

if TYPE_CHECKING:
    import xarray as xr

#: Image types a figure may be, by file extension.
MIME_TYPES = {"png": "image/png", "svg": "image/svg+xml"}


@dataclass(frozen=True)
class ReportOptions:
    """What `dvfs headroom` would be asked: the target, the knobs, the confidence, filters."""

    target: Target
    knob: str = "both"
    confidence: float = 0.95
    batch: tuple[int, ...] = ()
    drafter: tuple[str, ...] = ()
    corpus: tuple[str, ...] = ()


def build_document(
    cube: xr.Dataset,
    options: ReportOptions,
    figures: Sequence[tuple[str, bytes]],
    *,
    generated: str,
    context_tokens: float | None = None,
    context_notes: Sequence[str] = (),
    split_parts: Mapping[str, Sequence[str]] | None = None,
    left_out: Sequence[str] = (),
) -> Document:
    """The whole report. `figures` are (name relative to the figure folder, file bytes) as
    `dvfs.plots.plot_all` wrote them; `generated` is when (and by what) it was made;
    `context_tokens` the roofline's context and `context_notes` what was said of it
    (`dvfs.cube.prompts.roofline_context`: None, the cube's record); `split_parts` the parts
    each energy-split figure draws, by its name less the extension (`dvfs.plots.split_parts`
    of the cube the figures were drawn from), which its caption names; `left_out` the GPU
    models' journals a sweep folder's cube leaves out (`dvfs.fleet.cubes.left_out_of`), each
    said in the headroom section."""
    from dvfs.analysis.headroom import headroom
    from dvfs.analysis.selection import select
    from dvfs.report.headroom import headroom_document

    result = headroom(cube, target=options.target, knob=options.knob, confidence=options.confidence)
    result = select(result, options.batch, options.drafter, options.corpus)
    room = headroom_document(result, cube)
    if left_out:
        room["left_out"] = list(left_out)
    stock = reference_label(room["reference"]) == "stock"
    comparison, compare_notes = _comparison(cube, options, context_tokens, context_notes)
    sections = (
        measured_section(cube),
        _headroom_section(room, options),
        _compare_section(comparison, compare_notes),
        findings_section(
            room,
            comparison,
            [
                _figure(
                    n,
                    d,
                    _stock_for(n, stock, cube, room),
                    (split_parts or {}).get(n.rsplit(".", 1)[0]),
                )
                for n, d in figures
            ],
        ),
        _caps_section(room, options, gpu_names(cube)),
    )
    gpu = ", ".join(gpu_names(cube).values()) or room["gpu"]["name"] or "unknown GPU"
    return Document(
        title=f"DVFS report: {room['campaign'] or 'campaign'} on {gpu}",
        subtitle=f"{room['model'] or 'unknown model'}; target {room['target']['description']}"
        f"{_selection(options)}; generated {generated}",
        sections=sections,
    )


def _selection(options: ReportOptions) -> str:
    """The part of the cube the report is about, where --batch, --drafter or --corpus chose
    one ("; only batch 4; drafter eagle3"): its tables, findings and figures hold no more."""
    chosen = [
        f"{name} {', '.join(str(v) for v in values)}"
        for name, values in (
            ("batch", options.batch),
            ("drafter", options.drafter),
            ("corpus", options.corpus),
        )
        if values
    ]
    return f"; only {'; '.join(chosen)}" if chosen else ""


def _stock_for(name: str, stock: bool, cube: xr.Dataset, room: dict[str, Any]) -> bool:
    """Whether the reference the figure `name` draws is stock: in a merged cube, the reference
    of the GPU whose folder the figure is in (one GPU's stock setting may be on the grid and
    another's not: its reference is then the top of the grid), else the document's."""
    per_gpu = room["reference"].get("per_gpu") or {}
    *folders, _ = name.split("/")
    if not per_gpu or not folders or "gpu" not in cube.dims:
        return stock
    folder = folders[-1]
    from dvfs.plots import folders_of

    for label, own in folders_of(cube).items():
        if own == folder and label in per_gpu:
            return bool(per_gpu[label].get("is_stock", True))
    return stock


def _figure(
    name: str, data: bytes, stock: bool = True, parts: Sequence[str] | None = None
) -> Figure:
    from dvfs.errors import AnalysisError

    ext = name.rsplit(".", 1)[-1].lower()
    if ext not in MIME_TYPES:
        raise AnalysisError(f"figure {name} is not PNG or SVG: a report cannot embed it")
    caption = figure_caption(name, stock, parts)
    return Figure(name=name, caption=caption, data=data, mime=MIME_TYPES[ext])


_CAPTIONS = {
    "energy_vs_clock": "Energy per token against the SM clock",
    "energy_vs_power_limit": "Energy per token against the power limit, at the grid's one SM "
    "clock, with {ref} and the chosen setting",
    "latency_vs_power_limit": "The target's latency against the power limit, at the grid's one "
    "SM clock, with {ref}, the chosen setting and each drafter's target",
    "pareto": "Energy against latency at every setting: Pareto fronts and the chosen settings",
    "headroom": "Energy saved at the chosen setting, per batch, drafter and corpus",
    "acceptance": "Mean accept length per drafter and corpus",
    "timelines": "Power and SM clock over a cell, at {ref} and at the chosen setting",
    "energy_vs_batch": "Energy per token against batch size at {ref}, per drafter",
    "energy_split": "Where the energy goes: {parts} per token",
}

#: Each part of the energy split in a caption (`dvfs.engines.base.SPLIT_PARTS`).
PART_WORDS = {
    "prefill": "prefill",
    "draft": "drafting",
    "verify": "verification",
    "overhead": "overhead",
}


#: The reference in a caption: stock, or the top of the grid where the grid lacks stock.
REFERENCE_WORDS = {True: "the stock setting", False: "the reference (top of the grid)"}


def figure_caption(name: str, stock: bool = True, parts: Sequence[str] | None = None) -> str:
    """A caption from the figure's file name: `gpu/pareto_code.png` -> "GPU gpu: ...,
    corpus code". `stock`: whether the reference setting the figures draw is stock; `parts`:
    those an energy-split figure draws (None: every part), as its key names them."""
    *folders, file = name.split("/")
    stem = file.rsplit(".", 1)[0]
    lead = f"{gpu_words(folders[-1])}: " if folders else ""
    words = [PART_WORDS[p] for p in (PART_WORDS if parts is None else parts)]
    listed = ", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1 else "".join(words)
    for prefix, caption in _CAPTIONS.items():
        text = caption.format(ref=REFERENCE_WORDS[stock], parts=listed or "energy")
        if stem == prefix:
            return lead + text
        if stem.startswith(prefix + "_"):
            return f"{lead}{text}, corpus {stem[len(prefix) + 1 :]}"
    return lead + stem.replace("_", " ")


def _comparison(
    cube: xr.Dataset,
    options: ReportOptions,
    context_tokens: float | None = None,
    context_notes: Sequence[str] = (),
) -> tuple[dict[str, Any] | None, list[str]]:
    """The `dvfs compare` document against the target's baseline at the report's confidence, or
    why there is none; its roofline at `context_tokens` (None: the cube's record),
    `context_notes` said of it."""
    from dvfs.analysis.compare import compare
    from dvfs.analysis.roofline import rooflines
    from dvfs.analysis.selection import select
    from dvfs.errors import AnalysisError
    from dvfs.report.compare import compare_document

    baseline = options.target.baseline
    drafters = [str(d) for d in cube["drafter"].values]
    if options.drafter:
        drafters = [d for d in drafters if d in options.drafter or d == baseline]
    if baseline not in drafters:
        return None, [
            f"The cube has no {baseline!r} drafter to compare speculation with "
            f"(drafters: {', '.join(drafters)}); choose one with --baseline."
        ]
    if len(drafters) < 2:
        if len(cube["drafter"]) > 1:  # the others were measured; --drafter left them out
            return None, [
                f"--drafter keeps only the baseline {baseline!r}: nothing to compare it with; "
                "name a speculative drafter too, or drop --drafter."
            ]
        return None, [f"Only the {baseline!r} drafter was measured: nothing to compare."]
    t = options.target
    result = compare(
        cube,
        baseline=baseline,
        metric=t.metric,
        quantile=t.quantile,
        confidence=options.confidence,  # `dvfs compare --confidence`: its intervals and bounds
    )
    result = select(result, options.batch, drafters, options.corpus)
    notes: list[str] = []
    left_out: list[str] = []
    models: list[str] = []  # the GPU models those notes leave out
    try:
        roof = [
            select(r, options.batch, drafters)
            for r in rooflines(cube, notes=left_out, left_out=models, context_tokens=context_tokens)
        ]
        left_out[:0] = context_notes  # said of the roofline's context: where there is one
    except AnalysisError as exc:
        roof = None
        notes.append(f"No roofline: {exc}")
    notes += [_capital(note) for note in left_out]
    return compare_document(result, roof, cube, roofline_left_out=models), notes


def confidence_statement(room: dict[str, Any]) -> Paragraph:
    """What "meets the target" promises, in words: none where the cube has one repeat (or
    every answer rests on one), as the bound says; a row without an answer (no setting meets
    the target) has no repeats of its own and takes nothing from the cube's."""
    from dvfs.analysis.headroom import ONE_REPEAT_BOUND

    counts = [r["repeats"] for r in room["rows"] if r["repeats"] is not None]
    if room["bound"] == ONE_REPEAT_BOUND or (counts and max(counts) < 2):
        bound = room["bound"]
        return Paragraph(
            f"Confidence: none. {bound[:1].upper() + bound[1:]}: a setting listed as meeting the "
            "target may miss it on a rerun. Measure with repeats >= 2 for a confidence bound.",
            tone="warning",
        )
    miss = level_text(1 - float(room["confidence"]))
    return Paragraph(
        f"Confidence: {level_text(room['confidence'])}, one-sided. It holds per setting: a "
        "setting is listed as meeting the target only when the upper confidence bound of its "
        f"latency does, so a setting whose latency misses the target is listed at most {miss} of "
        "the time. "
        "The answer is picked among all the settings listed, so where several sit just over the "
        "target one of them passing by chance is likelier than that (about 12% at 95% in a "
        "simulation of eight clocks 0.5% over it, three repeats, 1% noise); a slack they fall "
        f"within, or more repeats, brings it nearer {miss}. Bound: {room['bound']}. A setting "
        "with an invalid repeat is never chosen.",
        tone="note",
    )


def _headroom_section(room: dict[str, Any], options: ReportOptions) -> Section:
    from dvfs.report.common import reference_text
    from dvfs.report.headroom import headroom_notes, headroom_table_rows

    header, rows = headroom_table_rows(room)
    ref = room["reference"]
    return Section(
        "Headroom",
        "headroom",
        (
            Paragraph(
                f"Target: {room['target']['description']}. Knob: {room['knob']}. Reference: "
                f"{reference_text(ref)}. Headroom is the reference minus the lowest setting "
                "that meets the target; the chosen setting is the one that meets it with the "
                "least energy per token of those that save beyond the measurement noise, and "
                "the reference, and the saving is against the drafter's own energy at the "
                "reference."
            ),
            confidence_statement(room),
            Table(
                f"DVFS headroom: {room['target']['description']}",
                tuple(header),
                tuple(tuple(r) for r in rows),
            ),
            # (the rows without an answer: in the findings, with their advice)
            *(
                Paragraph(_capital(n), tone="warning")
                for n in headroom_notes(room, no_answers=False)
            ),
        ),
    )


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def _compare_section(comparison: dict[str, Any] | None, notes: list[str]) -> Section:
    from dvfs.report.common import reference_text
    from dvfs.report.compare import compare_notes, compare_tables

    blocks: list[Any] = [Paragraph(n, tone="note") for n in notes]
    if comparison is not None:
        blocks.insert(
            0,
            Paragraph(
                f"Each drafter's energy per token relative to {comparison['baseline']!r}: at "
                "equal clock (both at the reference, "
                f"{reference_text(comparison['reference'])}) and at equal latency (each at "
                "the setting headroom chooses within the baseline's "
                f"{comparison['latency']} at the reference). Below 1 saves."
            ),
        )
        blocks += [
            Table(title, tuple(header), tuple(tuple(r) for r in rows))
            for title, header, rows in compare_tables(comparison)
        ]
        # The first note restates the reference, said above; how saves / costs were judged
        # is a note; the rest are warnings.
        blocks += [
            Paragraph(_capital(n), tone="note" if n.startswith("saves / costs:") else "warning")
            for n in compare_notes(comparison)[1:]
        ]
    return Section("Speculation vs no speculation", "speculation-vs-no-speculation", tuple(blocks))


def target_flags(options: ReportOptions) -> str:
    """The `dvfs headroom` options that ask the same question as this report. Numbers keep 12
    significant digits: `:g`'s six turned a confidence of 0.9999995 into 1, which `headroom`
    refuses, and an SLO of 1234.5678 ms into another question (1234.57 ms)."""
    t = options.target
    if t.mode == "slo":
        op = "<" if t.strict else "<="
        flags = [f"--slo '{t.metric}_{t.quantile_name}{op}{t.limit_ms:.12g}ms'"]
    else:
        flags = [
            "--vs-baseline" if t.mode == "vs-baseline" else "--preserve",
            f"--metric {t.metric} --quantile {t.quantile_name} --slack {t.slack * 100:.12g}%",
        ]
    if t.baseline != "none" or t.mode == "vs-baseline":
        flags.append(f"--baseline {t.baseline}")
    if options.knob != "both":
        flags.append(f"--knob {options.knob}")
    if options.confidence != 0.95:
        flags.append(f"--confidence {options.confidence:.12g}")
    return " ".join(flags)


def per_gpu_documents(room: dict[str, Any], names: dict[str, str]) -> list[dict[str, Any]]:
    """A merged headroom document as one document per GPU, each with its own name and stock
    setting: what `dvfs cap plan` would be given for that GPU's own cube."""
    if not names:
        return [room]
    per_gpu = room["reference"].get("per_gpu") or {}
    return [
        {
            **room,
            "gpu": {**room["gpu"], "name": name, "uuids": label.split(",")},
            "reference": per_gpu.get(label, room["reference"]),
            "rows": [r for r in room["rows"] if r.get("gpu") == label],
        }
        for label, name in names.items()
    ]


def _cap_rows(room: dict[str, Any], batch: int, drafter: str) -> list[tuple[str, ...]]:
    from dvfs.caps.files import is_twin_name
    from dvfs.caps.planning import (
        ABOVE_STOCK_NOTE,
        NOISE_NOTE,
        plan_caps,
        twin_model,
        unknown_saving,
    )
    from dvfs.errors import CapsError

    group = [r for r in room["rows"] if r["batch"] == batch and r["drafter"] == drafter]
    lead = (str(batch), drafter)
    gpu = room["gpu"]
    if gpu.get("backend") == "twin" or is_twin_name(gpu.get("name")):
        # Simulated caps name the GPU model, not the twin's made-up UUIDs: as a capped row does
        labels = [f"every {twin_model(gpu.get('name'))}"]
    else:
        # Each GPU in a row of its own, as a capped row names it and `dvfs cap plan` caps it.
        labels = [u[:16] for u in gpu["uuids"]] or ["-"]
    if any(not r["feasible"] for r in group):
        # The headroom table's reason for each corpus without an answer, and its advice.
        from dvfs.report.reasons import no_answer_groups

        whys = [
            f"{reason} on {', '.join(sorted({r['corpus'] for r in rows}))}: {advice}"
            for reason, advice, rows in no_answer_groups(group, room["target"].get("mode"), room)
        ]
        return [(*lead, label, "stock", "stock", "no cap: " + "; ".join(whys)) for label in labels]
    unknown = unknown_saving(room, group)
    if unknown:  # as `dvfs cap plan` refuses it: no saving shown, no cap recommended
        return [(*lead, label, "stock", "stock", f"no cap: {unknown}") for label in labels]
    try:
        planned = plan_caps(room, batch=batch, drafter=drafter, corpus="worst-case")
    except CapsError as exc:
        why = "stock: nothing to cap" if "nothing to cap" in str(exc) else f"no cap: {exc}"
        if why.startswith("stock") and NOISE_NOTE in str(exc):  # `dvfs cap plan` says why
            why += " (a lower setting's saving is within the measurement noise)"
        if why.startswith("stock") and ABOVE_STOCK_NOTE in str(exc):  # as `dvfs cap plan` says
            why += " (the chosen setting has a knob above stock, which a cap cannot hold)"
        return [(*lead, label, "stock", "stock", why) for label in labels]
    rows: list[tuple[str, ...]] = []
    # A cap at the lowest setting swept is where the grid stopped, not an optimum.
    decision = (
        "cap (lowest swept: a lower one might save more)"
        if planned.meta.get("grid_edge")
        else "cap"
    )
    for cap in planned.caps:
        clock = "stock" if cap.sm_clock_max_mhz is None else f"{cap.sm_clock_max_mhz} MHz"
        limit = "stock" if cap.power_limit_w is None else f"{cap.power_limit_w:g} W"
        who = cap.uuid[:16] if cap.uuid else f"every {cap.name}"
        rows.append((*lead, who, clock, limit, decision))
    return rows


def _caps_section(room: dict[str, Any], options: ReportOptions, names: dict[str, str]) -> Section:
    """`dvfs cap plan` for every (batch, drafter) and GPU, safe on every corpus (worst case)."""
    rows: list[tuple[str, ...]] = []
    for one in per_gpu_documents(room, names):
        for batch, drafter in dict.fromkeys((r["batch"], r["drafter"]) for r in one["rows"]):
            rows += _cap_rows(one, batch, drafter)
    # The report's corpora only: the worst case over every corpus in the cube can differ.
    corpora = "".join(f" --corpus {shlex.quote(c)}" for c in options.corpus)
    command = (
        f"dvfs headroom CUBE {target_flags(options)}{corpora} --json -o headroom.json\n"
        "dvfs cap plan headroom.json --batch B --drafter D -o caps.toml"
    )
    return Section(
        "Recommended caps",
        "recommended-caps",
        (
            Paragraph(
                "For the batch and drafter production serves with: the SM clock cap and power "
                "limit that keep every measured corpus within the target (the least aggressive "
                "of each corpus's chosen setting). A knob at stock is left alone."
            ),
            Table(
                "Caps per batch and drafter (worst case over the corpora)",
                ("batch", "drafter", "GPU", "SM clock max", "power limit", "decision"),
                tuple(rows),
            ),
            Code("To write the caps file for one row (batch B, drafter D)", command),
        ),
    )
