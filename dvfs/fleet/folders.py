"""Where a fleet's journals live in its --out folder: one journal, or one per GPU model
(`gpu-<model>/`) when a fleet mixes models; which of them a run resumes, and whether they
already hold every cell. Shared by the fleet's driver and the sweep's dry run, below both."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dvfs.campaign import Campaign
from dvfs.errors import JournalError
from dvfs.fleet.shard_journal import has_sessions, model_folder_journals, model_journal_paths
from dvfs.measure.journal import Journal
from dvfs.measure.plan import Cell

if TYPE_CHECKING:
    from dvfs.records.session import Stock


def model_folder(name: str) -> str:
    """The folder of one GPU model's journal in a fleet mixing models: `gpu-<model>`."""
    return "gpu-" + (re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown")


def model_journals(out_dir: Path, models: Iterable[str], *, fresh: bool = False) -> list[Path]:
    """The journal of each GPU model (by name, in sorted order) of a run into `out_dir`: the
    folder's own for one model, else each in its `gpu-<model>/` (also for one model where a
    fleet mixing models began the folder). A folder holding one model's run is refused for a
    fleet mixing models, in one line. `fresh`: as --fresh leaves the folder, no journal in it
    (`dvfs.out_folder.fresh_moves`)."""
    from dvfs.measure.journal import JOURNAL_NAME

    names = sorted(models)
    begun = not fresh and bool(model_journal_paths(out_dir))
    mixed = len(names) > 1 or begun
    if not mixed:
        return [out_dir / JOURNAL_NAME for _ in names]
    if not fresh and has_sessions(out_dir / JOURNAL_NAME):
        raise JournalError(
            f"{out_dir} holds a run on one GPU model, but this run's GPUs are "
            f"{', '.join(names)}: use another --out folder for a fleet that mixes models"
        )
    return [out_dir / model_folder(name) / JOURNAL_NAME for name in names]


def other_gpus_line(journal: Path, changes: Sequence[str]) -> str:
    """The line a sweep on one GPU group refuses to resume `journal` in, on GPUs that differ
    from its sessions' in what makes cells compare (`changes`, `dvfs.records.incomparable`'s);
    its dry run and `dvfs doctor` say it too (`check_same_gpus`)."""
    from dvfs.twin.identity import TWIN_CHANGED, twin_changed

    advice = TWIN_CHANGED if twin_changed(changes) else "use another --out directory"
    return (
        f"{journal} was measured on GPUs that differ from this run's in what makes "
        f"cells compare ({'; '.join(changes)}): {advice}"
    )


def other_gpus(journal: Path, changes: Sequence[str]) -> str:
    """The line refusing to resume `journal` on GPUs that differ from its sessions' in what
    makes cells compare (`changes`, `dvfs.records.incomparable`'s)."""
    from dvfs.twin.identity import TWIN_CHANGED, twin_changed

    advice = (
        TWIN_CHANGED
        if twin_changed(changes)
        else "run these GPUs into another --out folder (`dvfs cube merge` joins the cubes "
        "along `gpu`), or start over with --fresh"
    )
    return (
        f"{journal} was measured on other GPUs than this run's, which differ in what makes "
        f"cells compare ({'; '.join(changes)}): {advice}"
    )


def stock_changed(
    journal: Path, sessions: Iterable[Mapping[str, Any]], stock: Stock | None
) -> JournalError | None:
    """Why a fleet refuses to resume `journal`, whose earlier `sessions` recorded other stock
    settings than its workers' GPUs start from now (`stock`, the session's `recorded_stock`):
    its stock cells would no longer compare. None where none did. The fleet's driver's rule,
    which the fleet (before its workers open a GPU), `dvfs doctor` and the dry run apply too
    (`dvfs.preflight.resumed_fleet_stock_refusal`)."""
    from dvfs.records import Stock, recorded_stock

    for earlier in sessions:
        if recorded_stock(dict(earlier)) != stock:
            return JournalError(
                f"the GPUs' stock settings changed since {journal} was started "
                f"({Stock.describe(recorded_stock(dict(earlier)))} then; "
                f"{Stock.describe(stock)} now): the stock cells would no longer compare. "
                "Restore the earlier settings, or start a new --out folder"
            )
    return None


def check_same_gpus(
    out_dir: Path, gpus: Sequence[Mapping[str, Any]], *, fleet: bool = True
) -> None:
    """Refuse, as the fleet's driver refuses when its workers open their session, the folder's
    own journal (one GPU model's run) where its sessions' GPUs differ from `gpus` (this run's
    GPUs' identities, as sessions record them; a key one lacks is not compared) in what makes
    cells compare: what a dry run and `dvfs doctor` check before any GPU is set, so that they
    say the sweep's line and do not count the other GPUs' cells as done. A folder whose models
    each have their `gpu-*/` journal is left to `model_journals`. No `fleet`: a sweep on one
    GPU group, refused in its own line (`other_gpus_line`)."""
    from dvfs.measure.journal import JOURNAL_NAME, iter_records
    from dvfs.records import incomparable

    line = other_gpus if fleet else other_gpus_line
    journal = out_dir / JOURNAL_NAME
    if not gpus or any(out_dir.glob("gpu-*/" + JOURNAL_NAME)) or not journal.is_file():
        return
    now = {"gpus": [dict(g) for g in gpus]}
    for record in iter_records(journal):
        if record.get("type") == "session" and (changes := incomparable(record, now)):
            raise JournalError(line(journal, changes))


def fleet_journal(out_dir: Path) -> bool:
    """Whether `out_dir` holds a fleet's journal(s): a run resuming it on one GPU group (the
    GPUs left after a node loss) goes on as a fleet of one, so that it reads the same journal."""
    from dvfs.measure.journal import JOURNAL_NAME, iter_records

    if model_journal_paths(out_dir):
        return True
    journal = out_dir / JOURNAL_NAME
    if not journal.is_file():
        return False
    records = (r for r in iter_records(journal) if r.get("type") == "session")
    return "workers" in next(records, {})


def extra_repeats(campaign: Campaign, journal: Path, cells: Sequence[Cell]) -> list[Cell]:
    """The repeats a single runner would add (`dvfs.measure.runner.next_repeats`), decided
    here by the driver from its journal's cell records."""
    from dvfs.measure.journal import iter_records
    from dvfs.measure.runner import next_repeats
    from dvfs.records import JOURNAL_SCHEMA, CellRecord

    m = campaign.measurement
    if m.max_repeats <= m.repeats or not journal.is_file():
        return []

    def records() -> Iterator[CellRecord]:
        version = JOURNAL_SCHEMA
        for raw in iter_records(journal):
            if raw.get("type") == "session":
                version = int(raw.get("journal_schema", JOURNAL_SCHEMA))
            if raw.get("type") == "cell":
                yield CellRecord.from_json(raw, version=version)

    return next_repeats(m, records(), cells)


def journals_done(
    out_dir: Path,
    campaign: Campaign,
    cells: Sequence[Cell],
    models: Iterable[str] | None = None,
) -> Sequence[Path] | None:
    """The journals of an earlier fleet run in `out_dir` when they hold every cell (then there
    is nothing to run), else None. `models`: this run's GPU models (as its GPUs name
    themselves), each of which must have measured there: a finished folder of H100s does not
    hold an H200's cells (a fleet mixing models runs the campaign once per model; a run on
    other GPUs is refused, as resuming an unfinished folder on them is); None: not known."""
    from dvfs.measure.journal import JOURNAL_NAME, iter_records

    # a model's journal missing from its folder too: that model has every cell left
    paths = model_folder_journals(out_dir) or [out_dir / JOURNAL_NAME]
    if models is not None:
        names = set(models)
        if paths[0].parent == out_dir:  # one model's run: the models its GPUs were
            measured = {
                str(gpu.get("name"))
                for record in (iter_records(paths[0]) if paths[0].is_file() else ())
                if record.get("type") == "session"
                for gpu in record.get("gpus", ())
                if isinstance(gpu, dict)
            }
            if not names <= measured:
                return None
        elif not {model_folder(n) for n in names} <= {p.parent.name for p in paths}:
            return None
    keys = {c.key for c in cells}
    for path in paths:
        if not path.is_file():
            return None
        ok = Journal(path, iter_records(path)).finished()
        if not keys <= ok:
            return None
        if any(c.key not in ok for c in extra_repeats(campaign, path, cells)):
            return None
    return paths
