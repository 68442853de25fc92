"""Why a headroom row has no answer, and what to change: one wording for the headroom table,
the report's findings and caps, and `dvfs cap plan`, so none of them says "loosen the target"
where a reference cell is missing or invalid and loosening cannot help."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

#: (without --fresh: the same command with it moves the journal aside and starts over)
RETRY = (
    "run the same `dvfs sweep` command again without --fresh (which starts over): it retries "
    "failed cells"
)
AFTER_CHANGE = "then sweep again with --fresh or into another --out folder"


def no_answer(row: dict[str, Any]) -> str:
    """Why a row has no answer, as the headroom table says it: no valid reference cell (no
    target; why, where the cube says: not measured yet, failed, or the quality flags that
    invalidated it), settings left unjudged for want of repeats or measurements, every
    setting invalid, or every judged setting over the target."""
    if "target_ms" in row and row["target_ms"] is None:
        problem = row.get("reference_problem")
        # --vs-baseline: the reference is the baseline drafter's stock cell, not this row's.
        whose = row.get("reference_drafter")
        said = ": ".join(x for x in (f"baseline {whose}" if whose else "", problem or "") if x)
        return f"no valid reference cell ({said})" if said else "no valid reference cell"
    if row.get("judged_settings") is None:  # a document older than the counts
        return "none feasible"
    if not row.get("judged_settings") and row.get("unmeasured_settings"):
        # every setting waiting failed (a server that died): said so, as a reference's is
        if row.get("failed_settings") == row["unmeasured_settings"]:
            return "not measured yet (failed)"
        return "not measured yet"
    if not row.get("judged_settings") and row.get("short_settings"):
        return "too few repeats"
    if not row.get("judged_settings"):
        return "no valid cell"
    if row.get("unmeasured_settings"):
        return "none feasible so far"
    return "none feasible"


def loosen(mode: str | None) -> str:
    """How to loosen this target on the command line."""
    return "raise the --slo limit" if mode == "slo" else "loosen the target (--slack)"


def flag_advice(flags: Iterable[str]) -> str:
    """What to change in the campaign for these invalidating quality flags."""
    from dvfs.cube.quality import INVALID_ADVICE

    named = [f for f in dict.fromkeys(flags) if f]
    if not named:
        return f"see `dvfs cube info` for the cells' quality flags; {AFTER_CHANGE}"
    said = "; ".join(f"{f}: {INVALID_ADVICE.get(f, 'see `dvfs cube info`')}" for f in named)
    return f"{said}; {AFTER_CHANGE}"


def no_answer_advice(
    row: dict[str, Any], mode: str | None = None, doc: dict[str, Any] | None = None
) -> str:
    """What would give a row without an answer one: resuming the sweep (for `doc`'s cube:
    one shard's, or merged from shards, each shard's command and the merge), a campaign that
    clears the quality flags, more repeats; loosening the target only where settings were
    judged over it."""
    from dvfs.cube.cells_left import resume_advice

    problem = row.get("reference_problem") or ""
    if "target_ms" in row and row["target_ms"] is None:
        if problem == "failed":
            whose = row.get("reference_drafter") or row.get("drafter")
            unfit = _unfit_advice(whose, doc, row.get("gpu"))
            return unfit or _retry_advice("the reference (a rerun retries failed cells)", doc)
        if problem.startswith("invalid"):
            flags = problem.removeprefix("invalid").lstrip(": ").split(", ")
            return flag_advice(flags)
        if problem.startswith("no "):  # valid cells without the latency: a damaged cube
            return (
                "the reference was measured but its cells hold no such latency (a damaged or "
                "edited cube): rebuild it from its sweep's journal with `dvfs cube build "
                "SWEEP_DIR`, or choose another --metric or --quantile"
            )
        return resume_advice("the reference", doc)
    reason = no_answer(row)
    if reason == "not measured yet (failed)":
        unfit = _unfit_advice(row.get("drafter"), doc, row.get("gpu"))
        return unfit or _retry_advice("them (a rerun retries failed cells)", doc)
    if reason == "not measured yet":
        return resume_advice("them", doc)
    if reason == "too few repeats":
        return "raise measurement.repeats (a setting needs two usable repeats) and sweep again"
    if reason == "no valid cell":
        return flag_advice((row.get("invalid_flags") or "").split(", "))
    if reason == "none feasible so far":
        return (
            f"the settings judged are over the target: {resume_advice('them', doc)}; or "
            f"{loosen(mode)} or "
            "choose another batch or drafter"
        )
    return (
        f"every setting judged is over the target: {loosen(mode)} or choose another batch or "
        "drafter"
    )


def _unfit_advice(drafter: object, doc: dict[str, Any] | None, row_gpu: object = None) -> str:
    """Where `drafter`'s cells failed as SGLang would not start its server for the campaign as
    it is (`doc`'s `unfit`), which the same command fails again: the campaign's change, as the
    sweep's closing line says it; "" otherwise (a rerun retries them)."""
    from dvfs.cube.cells_left import unfit_advice

    unfit = (doc or {}).get("unfit") or {}
    if drafter is None or str(drafter) not in unfit.get("drafters", ()):
        return ""
    gpus = (unfit.get("on") or {}).get(str(drafter))
    if gpus and row_gpu is not None and str(row_gpu) not in gpus:  # on another GPU of a merge
        return ""
    return unfit_advice({**(doc or {}), "unfit": {**unfit, "drafters": [str(drafter)]}})


def _retry_advice(what: str, doc: dict[str, Any] | None) -> str:
    """What retries failed cells: the sweep's command again (`RETRY`); for a cube merged from
    shards or sweeps, their parts' commands and the merge again; for a fleet's cube whose cells
    left are on some GPU models only (`models_left`, after a rerun on the others' GPUs), the
    command with its --gpus naming GPUs of them (`resume_advice`): the same command run on the
    other models' GPUs retries none of them."""
    from dvfs.cube.cells_left import resume_advice

    if doc and (doc.get("merged_shards") or doc.get("merged_cubes") or doc.get("models_left")):
        return resume_advice(what, doc)
    return RETRY


def no_answer_groups(
    rows: Sequence[dict[str, Any]], mode: str | None = None, doc: dict[str, Any] | None = None
) -> list[tuple[str, str, list[dict[str, Any]]]]:
    """The rows without an answer grouped by (reason, advice), in order of first appearance;
    `doc`: the headroom document they come from (whose cube may be a shard's)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if not r["feasible"]:
            groups.setdefault((no_answer(r), no_answer_advice(r, mode, doc)), []).append(r)
    return [(reason, advice, group) for (reason, advice), group in groups.items()]
