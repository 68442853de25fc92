"""Planning caps: a `dvfs headroom --json` document and the operator's choice in, a caps file out.

Pure: no GPU and no state directory, so `dvfs cap plan` runs anywhere a headroom document is.
`plan_caps` gives one static setting; `plan_per_batch` one per batch size, for `dvfs govern`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dvfs.caps.files import TWIN_SUFFIX, CapsFile, GpuCap, headroom_again, is_twin_name
from dvfs.errors import CapsError
from dvfs.gpu.base import canonical_uuid

if TYPE_CHECKING:
    # Imported where used: dvfs.govern.plan reads dvfs.caps.files, so a module-level import
    # would make importing dvfs.govern.plan first run into this half-initialised package.
    from dvfs.govern.plan import BatchPlan, BatchStep


def load_headroom(path: Path) -> Any:
    """A `dvfs headroom --json` document from a file (`plan_caps` checks its shape)."""
    from dvfs.inputs import MAX_DOCUMENT_BYTES, TOO_DEEP, read_text_limited

    try:
        text = read_text_limited(path, MAX_DOCUMENT_BYTES, CapsError, "headroom document")
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        why = TOO_DEEP if isinstance(exc, RecursionError) else exc
        raise CapsError(
            f"{path} is not JSON ({why}); write it with `dvfs headroom CUBE --json -o FILE`"
        ) from exc


def check_document(doc: Any) -> None:
    """Refuse anything but a complete `dvfs headroom --json` document."""
    if not isinstance(doc, dict) or doc.get("schema") != "dvfs.headroom/1":
        raise CapsError("the input is not `dvfs headroom --json` output (schema dvfs.headroom/1)")
    missing = [k for k in ("rows", "reference", "gpu", "target") if k not in doc]
    if missing or not isinstance(doc.get("rows"), list):
        raise CapsError(
            f"the headroom document is incomplete (missing {', '.join(missing) or 'rows'}); "
            "write it again with `dvfs headroom CUBE --json -o FILE`"
        )
    problem = _shape_problem(doc)
    if problem:
        raise CapsError(
            f"the headroom document is damaged: {problem}; write it again with "
            "`dvfs headroom CUBE --json -o FILE`"
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _shape_problem(doc: dict[str, Any]) -> str | None:
    """The first value of the document planning reads that has the wrong type (a file edited
    by hand or damaged), said as `where is VALUE, expected WHAT`; None when all are right."""

    def bad(where: str, value: Any, expected: str) -> str:
        return f"{where} is {json.dumps(value)[:40]}, expected {expected}"

    def number_or_null(table: dict[str, Any], key: str, where: str) -> str | None:
        value = table.get(key)
        if value is None or _is_number(value):
            return None
        return bad(f"{where}.{key}", value, "a number or null")

    def table_or_null(table: dict[str, Any], key: str, where: str) -> str | None:
        value = table.get(key)
        return None if value is None or isinstance(value, dict) else bad(where, value, "a table")

    for key in ("gpu", "target", "reference"):
        if not isinstance(doc[key], dict):
            return bad(key, doc[key], "a table")
    gpu, target, reference = doc["gpu"], doc["target"], doc["reference"]
    for key in ("name", "backend"):
        if not isinstance(gpu.get(key), str | None):
            return bad(f"gpu.{key}", gpu[key], "a string")
    uuids = gpu.get("uuids")
    if not isinstance(uuids, list) or not all(isinstance(u, str) for u in uuids):
        return bad("gpu.uuids", uuids, "a list of GPU UUIDs")
    problem = table_or_null(gpu, "names", "gpu.names")
    if problem:
        return problem
    if not isinstance(target.get("description"), str):
        return bad("target.description", target.get("description"), "a string")
    if not isinstance(target.get("mode"), str | None):
        return bad("target.mode", target["mode"], "a string")
    per_gpu = reference.get("per_gpu") or {}
    if not isinstance(per_gpu, dict) or not all(isinstance(v, dict) for v in per_gpu.values()):
        return bad("reference.per_gpu", per_gpu, "a table of tables")
    knobs = ("sm_clock_mhz", "power_limit_w", "stock_sm_clock_mhz", "stock_power_limit_w")
    for where, ref in [("reference", reference)] + [
        (f"reference.per_gpu.{k}", v) for k, v in per_gpu.items()
    ]:
        for key in knobs:
            problem = number_or_null(ref, key, where)
            if problem:
                return problem
    for i, row in enumerate(doc["rows"]):
        where = f"rows[{i}]"
        if not isinstance(row, dict):
            return bad(where, row, "a table")
        missing = [k for k in ("batch", "drafter", "corpus", "feasible") if k not in row]
        if missing:
            return f"{where} has no {', '.join(missing)}"
        if not isinstance(row["batch"], int) or isinstance(row["batch"], bool):
            return bad(f"{where}.batch", row["batch"], "an integer")
        for key in ("drafter", "corpus"):
            if not isinstance(row[key], str):
                return bad(f"{where}.{key}", row[key], "a string")
        if not isinstance(row.get("gpu"), str | None):
            return bad(f"{where}.gpu", row["gpu"], "a GPU UUID or null")
        if not isinstance(row["feasible"], bool):
            return bad(f"{where}.feasible", row["feasible"], "true or false")
        for key in (
            "energy_per_token_j",
            "stock_energy_per_token_j",
            "paired_stock_energy_per_token_j",
        ):
            problem = number_or_null(row, key, where)
            if problem:
                return problem
        chosen = row.get("chosen")
        if row["feasible"] and not isinstance(chosen, dict):
            return bad(f"{where}.chosen", chosen, "a table (the row is feasible)")
        if isinstance(chosen, dict):
            for key in ("sm_clock_mhz", "power_limit_w"):
                if key not in chosen:
                    return f"{where}.chosen has no {key}"
                problem = number_or_null(chosen, key, f"{where}.chosen")
                if problem:
                    return problem
    return None


#: What a plan says when its setting is the lowest the grid swept (its meta `grid_edge`).
GRID_EDGE_NOTE = (
    "the chosen setting is the lowest the campaign swept: a lower cap might save more energy "
    "and still meet the target; extend the grid downward, sweep and plan again"
)


def at_grid_edge(rows: Sequence[dict[str, Any]]) -> bool:
    """Whether a cap taken from these rows (the least aggressive of their chosen settings) sits
    at the bottom of the grid: every row's chosen setting is at the grid's edge. Documents
    older than the flag never are."""
    return bool(rows) and all(r.get("chosen_at_grid_edge") is True for r in rows)


#: Why a plan holds stock where a lower setting spent less: its saving was within the noise.
NOISE_NOTE = (
    "a lower setting's saving there is within the measurement noise: `dvfs headroom` names "
    "it; more repeats or a tighter precision may tell"
)


def plan_caps(
    doc: dict[str, Any],
    *,
    batch: int,
    drafter: str,
    corpus: str,
    uuids: Sequence[str] = (),
    model_name: str | None = None,
) -> CapsFile:
    """Caps from a `dvfs.headroom/1` document and the operator's choice.

    corpus may be "worst-case": for each knob the least aggressive choice among the corpora
    (highest clock, highest power limit), which keeps every corpus within its target as long
    as latency does not rise when a knob goes up. A knob left at stock is not capped.
    In a merged document each GPU is capped by UUID with its own setting; caps that name a
    GPU model instead (simulated ones, whose UUIDs are made up, or `model_name`) take the least
    aggressive setting over that model's GPUs, one entry per model.
    """
    if uuids and model_name:
        raise CapsError("--gpu and --model exclude each other: cap GPUs by UUID or by model")
    not_uuids = [u for u in uuids if not u.upper().startswith("GPU-")]
    if not_uuids:
        raise CapsError(
            f"--gpu {not_uuids[0]!r} is not a GPU UUID (GPU-...); `dvfs gpu list` shows them"
        )
    uuids = [canonical_uuid(u) for u in uuids]  # the document's are NVML's, lower-case
    twice = next((u for i, u in enumerate(uuids) if u in uuids[:i]), None)
    if twice is not None:  # two [[gpu]] entries of one GPU: a file `cap apply` refuses
        raise CapsError(f"--gpu names {twice} twice (case aside): name each GPU once")
    check_document(doc)
    rows = [r for r in doc["rows"] if r["batch"] == batch and r["drafter"] == drafter]
    if not rows:
        batches = sorted({r["batch"] for r in doc["rows"]})
        drafters = sorted({r["drafter"] for r in doc["rows"]})
        raise CapsError(
            f"no headroom rows for batch {batch} and drafter {drafter!r}; the document "
            f"has batches {batches} and drafters {drafters}"
        )
    if corpus != "worst-case":
        rows = [r for r in rows if r["corpus"] == corpus]
        if not rows:
            raise CapsError(
                f"no headroom rows for corpus {corpus!r}; use one of "
                f"{sorted({r['corpus'] for r in doc['rows']})} or worst-case"
            )
    # A merged document names each GPU's model (`gpu.names`); one an older dvfs wrote names
    # only its first GPU's (`gpu.name`), which `measured_on` would then claim for every GPU,
    # and `cap apply` refuses the other models' entries (the caps unit fails at boot).
    for r in rows:
        model_of(doc, r)
    measured_on = doc["gpu"].get("name")
    simulated = doc["gpu"].get("backend") == "twin" or is_twin_name(measured_on)
    by_model = bool(model_name) or (simulated and not uuids)
    if model_name:  # only that model's GPUs: another model's setting is not safe for it
        named = measured_as(doc, model_name, simulated)
        rows = [r for r in rows if model_of(doc, r) in named]
    wanted = set(uuids)
    if wanted and not by_model and any(r.get("gpu") for r in rows):
        rows = _named_gpus_rows(rows, list(uuids))
    groups: dict[str | None, list[dict[str, Any]]] = {}
    for r in rows:
        if model_name:  # every GPU of that model gets one cap, safe for every GPU measured
            key: str | None = model_name
        elif by_model:  # the twin's UUIDs are made up: name each GPU model instead
            key = twin_model(model_of(doc, r))
        else:
            key = r.get("gpu")
        groups.setdefault(key, []).append(r)
    caps = []
    edge = False
    at_stock: list[str] = []  # the groups whose setting is stock: nothing to cap there
    for key, group in groups.items():
        if any(not r["feasible"] for r in group):
            raise CapsError(no_answer_error(doc, group, batch, drafter, key))
        clock_cap, limit_cap = least_aggressive(doc, group)
        if clock_cap is None and limit_cap is None:
            stocks = {stock_of(_reference_for(doc["reference"], r.get("gpu"))) for r in group}
            stock = "{} MHz, {:g} W".format(*stocks.pop()) if len(stocks) == 1 else "each GPU's own"
            at_stock.append(f"stock ({stock}){f' on {key}' if key else ''}")
            continue
        unknown = unknown_saving(doc, group)
        if unknown:
            where = f" on {key}" if key else ""
            raise CapsError(f"no cap at batch {batch} with drafter {drafter!r}{where}: {unknown}")
        edge = edge or at_grid_edge(group)
        if by_model:
            caps.append(GpuCap(name=key, sm_clock_max_mhz=clock_cap, power_limit_w=limit_cap))
            continue
        if key:  # a merged document: each GPU its own row's setting (--gpu: those named)
            targets = [u for u in key.split(",") if not wanted or u in wanted]
        else:
            targets = list(uuids) or list(doc["gpu"]["uuids"])
        if not targets:
            raise CapsError("no GPU UUIDs: pass --gpu UUID (repeatable) or --model NAME")
        caps += [
            GpuCap(uuid=u, sm_clock_max_mhz=clock_cap, power_limit_w=limit_cap) for u in targets
        ]
    chosen = f"for batch {batch}, drafter {drafter!r}, corpus {corpus}"
    above = above_stock_note(doc, [r for group in groups.values() for r in group])
    if not caps:
        noise = any(r.get("saving_set_aside_within_noise") for r in rows)
        raise CapsError(
            f"the {'plan' if above else 'chosen setting'} is {'; '.join(at_stock)} {chosen}: "
            "nothing to cap"
            + (f" ({NOISE_NOTE})" if noise else "")
            + (f" ({above})" if above else "")
        )
    # A merged document's other GPUs (or models) may still be capped where these are not: the
    # file leaves these out, as a knob at stock is left out, and says so.
    # where a row chose a knob above stock, its GPUs' setting is not stock but planned at it
    not_capped = (
        f"the {'plan' if above else 'chosen setting'} is {'; '.join(at_stock)} {chosen}: "
        "nothing to cap there, so the "
        "file leaves those GPUs out (they keep any caps they hold; `dvfs cap reset` clears them)"
        if at_stock
        else None
    )
    meta = {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "simulated": True if simulated else None,
        "campaign": doc.get("campaign"),
        "measured_on": measured_on,
        "target": doc["target"]["description"],
        "batch": batch,
        "drafter": drafter,
        "corpus": corpus,
        "grid_edge": GRID_EDGE_NOTE if edge else None,
        "not_capped": not_capped,
        "above_stock": above,
    }
    return CapsFile(tuple(caps), meta)


def _named_gpus_rows(rows: list[dict[str, Any]], uuids: list[str]) -> list[dict[str, Any]]:
    """A merged document's rows of the GPUs `--gpu` names: each GPU is capped with its own
    row's setting, so a GPU the document did not measure has none, and is refused naming
    those it did."""
    measured = list(dict.fromkeys(u for r in rows for u in str(r.get("gpu") or "").split(",")))
    unknown = [u for u in uuids if u not in measured]
    if unknown:
        raise CapsError(
            f"--gpu {unknown[0]} is not a GPU this merged headroom document measured "
            f"({', '.join(measured)}): each GPU takes its own setting; name measured GPUs, "
            "or leave --gpu out to cap them all (--model NAME caps every GPU of a model)"
        )
    return [r for r in rows if set(str(r.get("gpu") or "").split(",")) & set(uuids)]


def measured_as(doc: dict[str, Any], model_name: str, simulated: bool) -> set[str | None]:
    """The document's GPU models that `--model NAME` names (a twin's with or without its
    suffix); a name the document never measured is refused, listing the ones it did."""
    models = list(dict.fromkeys(model_of(doc, r) for r in doc["rows"]))

    def bare(name: str | None) -> str:
        return str(name).removesuffix(TWIN_SUFFIX) if simulated else str(name)

    matched = {m for m in models if m == model_name or bare(m) == bare(model_name)}
    if not matched:
        raise CapsError(
            f"--model {model_name!r} is not a GPU model this headroom document measured; "
            f"it measured {', '.join(repr(str(m)) for m in models)}: pass one of those"
        )
    return matched


#: Why a per-batch plan holds stock at a batch whose chosen setting's saving is unknown.
UNKNOWN_NOTE = (
    "the chosen setting's saving there is unknown (stock has too few usable repeats for an "
    "energy: the headroom table's -), so it may spend more than stock; `dvfs cap plan` says why"
)


def unknown_saving(doc: dict[str, Any], group: Sequence[dict[str, Any]]) -> str | None:
    """Why rows with an answer but no saving (an --slo or --vs-baseline answer where the
    reference has too few usable repeats for an energy: the headroom table's "-") get no cap,
    and what to change; None where every row's saving is known (or a document older than
    the saving). A cap is planned for a saving shown: one within the noise is not, and one
    unknown may spend more than stock."""
    unknown = [r for r in group if r["feasible"] and "saving" in r and r["saving"] is None]
    if not unknown:
        return None
    versus = "stock" if doc["reference"].get("is_stock", True) else "the reference"
    # --vs-baseline: the saving against the baseline may be known; the cap's, against the
    # drafter's own stock, is not
    whose = f"the drafter's own {versus}" if doc["target"].get("mode") == "vs-baseline" else versus
    corpora = ", ".join(dict.fromkeys(r["corpus"] for r in unknown))
    return (
        f"saving unknown for corpus {corpora}: {whose} has too few usable repeats for an "
        "energy to save against, so the chosen setting may spend more than it; `dvfs cube "
        "info` says why its repeats are unusable: clear that (or raise measurement.repeats), "
        "sweep again and run `dvfs headroom` again"
    )


def no_answer_error(
    doc: dict[str, Any], group: Sequence[dict[str, Any]], batch: int, drafter: str, key: Any
) -> str:
    """Why the rows without an answer have none, in the headroom table's words, and what to
    change: "no setting meets the target ... loosen it" only where settings were judged over
    the target, never for a reference cell missing or invalid."""
    from dvfs.report.reasons import no_answer_groups

    parts = []
    for reason, advice, rows in no_answer_groups(group, doc["target"].get("mode"), doc):
        corpora = ", ".join(r["corpus"] for r in rows)
        what = "no setting meets the target" if reason == "none feasible" else reason
        parts.append(f"{what} for corpus {corpora}: {advice}")
    where = f" on {key}" if key else ""
    return f"no cap at batch {batch} with drafter {drafter!r}{where}: " + "; ".join(parts)


def twin_model(name: str | None) -> str:
    """A twin GPU's model as simulated caps and plans name it: the NVML name with the twin's
    suffix, so it never matches a real GPU unless the operator allows it."""
    return str(name or "unknown GPU") + ("" if is_twin_name(name) else TWIN_SUFFIX)


def model_of(doc: dict[str, Any], row: dict[str, Any]) -> str | None:
    """The GPU model a row was measured on: in a merged document its GPU's (`gpu.names`),
    never the document's first GPU's."""
    label = row.get("gpu")
    if label is None:
        return doc["gpu"].get("name")
    names = doc["gpu"].get("names") or {}
    if label not in names:
        raise CapsError(
            f"the headroom document does not name the model of GPU {str(label)[:12]} (an older "
            "dvfs wrote it); write it again with "
            f"{headroom_again(doc['target'].get('description'), 'FILE')}"
        )
    return str(names[label])


#: Why a row whose chosen setting has a knob above stock is planned at stock on both knobs.
ABOVE_STOCK_NOTE = (
    "a cap only lowers a knob from stock, so that setting cannot be held, and capping the other "
    "knob alone would run a setting never measured: planned at stock"
)


def above_stock(doc: dict[str, Any], row: dict[str, Any]) -> str | None:
    """Which knob of a row's chosen setting is above its GPU's stock value (a grid that swept
    a power limit above the default, say), said as `the power limit is above stock (600 W)`;
    None where neither is. Caps cannot hold such a setting: a cap only lowers a knob."""
    chosen = row.get("chosen")
    if not row.get("feasible") or not isinstance(chosen, dict):
        return None
    stock_clock, stock_limit = stock_of(_reference_for(doc["reference"], row.get("gpu")))
    clock, limit = chosen.get("sm_clock_mhz"), chosen.get("power_limit_w")
    above = []
    if clock is not None and clock > stock_clock:
        above.append(f"the SM clock is above stock ({stock_clock} MHz)")
    if limit is not None and limit > stock_limit:
        above.append(f"the power limit is above stock ({stock_limit:g} W)")
    return " and ".join(above) or None


def above_stock_note(doc: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str | None:
    """One line naming each row (batch, corpus, GPU) whose chosen setting has a knob above
    stock, that setting and why it is planned at stock; None where no row's has."""
    parts = []
    for r in rows:
        why = above_stock(doc, r)
        if why is None:
            continue
        chosen = r["chosen"]
        clock = chosen.get("sm_clock_mhz")
        limit = chosen.get("power_limit_w")
        setting = "{} / {}".format(
            "stock" if clock is None else f"{clock} MHz",
            "stock" if limit is None else f"{limit:g} W",
        )
        where = f" on {str(r['gpu'])[:16]}" if r.get("gpu") else ""
        parts.append(f"batch {r['batch']}, corpus {r['corpus']}{where} chose {setting}, but {why}")
    return f"{'; '.join(parts)}: {ABOVE_STOCK_NOTE}" if parts else None


def least_aggressive(
    doc: dict[str, Any], group: Sequence[dict[str, Any]]
) -> tuple[int | None, float | None]:
    """Per knob the highest value chosen over the rows (corpora, GPUs): the SM clock cap (MHz)
    and power limit (W), None (stock) where any row chose its GPU's stock value or above, or
    chose nothing. Safe for every row as long as latency does not rise when a knob goes up.
    A row whose chosen setting has a knob above stock (`above_stock`) counts as stock on both
    knobs: a cap cannot raise that knob, and the other capped alone is a setting never
    measured, below the chosen one on the first knob."""
    clock_cap: int | None = None
    limit_cap: float | None = None
    clock_stock = limit_stock = False
    for r in group:
        stock_clock, stock_limit = stock_of(_reference_for(doc["reference"], r.get("gpu")))
        clock, limit = r["chosen"]["sm_clock_mhz"], r["chosen"]["power_limit_w"]
        if (clock is not None and clock > stock_clock) or (
            limit is not None and limit > stock_limit
        ):
            clock_stock = limit_stock = True
            continue
        if clock is None or clock >= stock_clock:
            clock_stock = True
        else:
            clock_cap = max(clock_cap or 0, int(clock))
        if limit is None or limit >= stock_limit:
            limit_stock = True
        else:
            limit_cap = max(limit_cap or 0.0, float(limit))
    return (None if clock_stock else clock_cap, None if limit_stock else limit_cap)


def _reference_for(reference: dict[str, Any], gpu_uuid: str | None) -> dict[str, Any]:
    """The reference (with the stock values, `stock_of`) a group's chosen setting is compared
    with: in a merged document whose GPUs' stock settings differ, each GPU's own
    (`reference.per_gpu`)."""
    per_gpu = reference.get("per_gpu") or {}
    if gpu_uuid is not None and gpu_uuid in per_gpu:
        return dict(per_gpu[gpu_uuid])
    if reference.get("sm_clock_mhz") is None or reference.get("power_limit_w") is None:
        raise CapsError(
            "the headroom document has no single stock setting (its GPUs differ) and this "
            "group names no GPU; plan each GPU with --gpu UUID"
        )
    return reference


def stock_of(ref: dict[str, Any]) -> tuple[int, float]:
    """The GPU's stock SM clock (MHz) and power limit (W), which a chosen setting is capped
    against: the reference where the grid holds stock, else the `stock_*` values headroom
    records beside it. The reference alone (the top of the grid) would call a setting the GPU
    never runs at unless capped "stock", and a cap file would leave it unset. Documents older
    than `stock_*` have only the reference."""
    clock = ref.get("stock_sm_clock_mhz")
    limit = ref.get("stock_power_limit_w")
    return (
        int(ref["sm_clock_mhz"] if clock is None else clock),
        float(ref["power_limit_w"] if limit is None else limit),
    )


def plan_per_batch(doc: dict[str, Any], *, drafter: str | None, corpus: str) -> BatchPlan:
    """A per-batch plan (for `dvfs govern`) from a `dvfs.headroom/1` document: for each batch
    the document has, the chosen setting of `drafter`, least aggressive across the corpora
    (`corpus` "worst-case") and across the GPUs of a merged document, all of one model: the
    plan names the model `dvfs govern` checks each GPU against.

    A batch with no feasible setting, whose chosen setting is stock or has a knob above stock
    (`above_stock`: no cap holds it), or whose saving is unknown (`unknown_saving`: no cap, as
    `plan_caps` plans none), is planned at stock: the governor then leaves the GPU alone at
    that load.
    """
    from dvfs.govern.plan import BatchPlan

    check_document(doc)
    drafters = sorted({str(r["drafter"]) for r in doc["rows"]})
    if drafter is None:
        if len(drafters) != 1:
            raise CapsError(
                f"the headroom document has drafters {drafters}: pass --drafter NAME (the one "
                "the server runs)"
            )
        drafter = drafters[0]
    rows = [r for r in doc["rows"] if r["drafter"] == drafter]
    if not rows:
        raise CapsError(f"no headroom rows for drafter {drafter!r}; the document has {drafters}")
    if corpus != "worst-case":
        rows = [r for r in rows if r["corpus"] == corpus]
        if not rows:
            raise CapsError(
                f"no headroom rows for corpus {corpus!r}; use one of "
                f"{sorted({r['corpus'] for r in doc['rows']})} or worst-case"
            )
    models = list(dict.fromkeys(model_of(doc, r) for r in rows))
    if len(models) > 1:
        raise CapsError(
            f"the headroom document's GPUs are of {len(models)} models "
            f"({', '.join(str(m) for m in models)}): a per-batch plan is for one GPU model; "
            "plan each model from its own cube (or a merge of that model's cubes)"
        )
    steps = []
    edge_batches = []
    noise_batches = []  # planned at stock where a lower setting's saving was within the noise
    unknown_batches = []  # planned at stock where the chosen setting's saving is unknown
    above_rows = []  # chose a knob above stock, which no cap holds: planned at stock
    for batch in sorted({int(r["batch"]) for r in rows}):
        group = [r for r in rows if int(r["batch"]) == batch]
        step = _batch_step(doc, batch, group)
        steps.append(step)
        if not step.setting.is_stock and at_grid_edge(group):
            edge_batches.append(str(batch))
        if step.setting.is_stock and any(r.get("saving_set_aside_within_noise") for r in group):
            noise_batches.append(str(batch))
        if all(r["feasible"] for r in group) and unknown_saving(doc, group):
            unknown_batches.append(str(batch))
        elif all(r["feasible"] for r in group):
            above_rows += [r for r in group if above_stock(doc, r)]
    above = above_stock_note(doc, above_rows)
    if all(step.setting.is_stock for step in steps) and (
        any(r.get("saving_set_aside_within_noise") for r in rows) or unknown_batches or above
    ):
        why = [NOISE_NOTE] if noise_batches else []
        why += [f"batch {', '.join(unknown_batches)}: {UNKNOWN_NOTE}"] if unknown_batches else []
        why += [above] if above else []
        raise CapsError(
            "per-batch plan: every step is stock, so there is nothing to govern (drafter "
            f"{drafter!r}, corpus {corpus}); {'; '.join(why)}"
        )
    measured_on = str(models[0] or "unknown GPU")
    simulated = doc["gpu"].get("backend") == "twin" or is_twin_name(measured_on)
    if simulated:
        measured_on = twin_model(measured_on)
    meta = {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "simulated": True if simulated else None,
        "campaign": doc.get("campaign"),
        "measured_on": measured_on,
        "target": doc["target"].get("description"),
        "drafter": drafter,
        "corpus": corpus,
        "knob": doc.get("knob"),
        "grid_edge": (
            f"batch {', '.join(edge_batches)}: {GRID_EDGE_NOTE}" if edge_batches else None
        ),
        "within_noise": (
            f"batch {', '.join(noise_batches)} at stock: {NOISE_NOTE}" if noise_batches else None
        ),
        "saving_unknown": (
            f"batch {', '.join(unknown_batches)} at stock: {UNKNOWN_NOTE}"
            if unknown_batches
            else None
        ),
        "above_stock": above,
    }
    try:
        return BatchPlan(tuple(steps), measured_on, drafter, meta)
    except CapsError as exc:
        raise CapsError(f"{exc} (drafter {drafter!r}, corpus {corpus})") from exc


def _batch_step(doc: dict[str, Any], batch: int, group: list[dict[str, Any]]) -> BatchStep:
    """One batch's step: stock when any corpus (or GPU) has no feasible setting; else per knob
    the highest chosen value, a knob at or above the GPU's stock value left at stock (both
    knobs where a row chose one above stock: `least_aggressive`)."""
    from dvfs.govern.plan import BatchStep, Setting

    if not all(r["feasible"] for r in group) or unknown_saving(doc, group):
        return BatchStep(batch, Setting())
    if any(above_stock(doc, r) for r in group):  # no energy: the chosen setting's is not stock's
        return BatchStep(batch, Setting())
    # The planned energies are meaningful for one corpus on one GPU only.
    single = group[0] if len(group) == 1 else {}
    return BatchStep(
        batch,
        Setting(*least_aggressive(doc, group)),
        single.get("energy_per_token_j"),
        # over the repeats the saving is over (measured at both), as the planned energy is
        single.get("paired_stock_energy_per_token_j") or single.get("stock_energy_per_token_j"),
    )
