"""A shard's journal and cube: which shard a journal holds (claimed as a run opens it), and its
cube marked with it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dvfs.errors import JournalError
from dvfs.fleet.shard import SHARD_RECORD, Shard, check_deal, mark_cube

if TYPE_CHECKING:
    import xarray as xr

    from dvfs.measure.journal import Journal


def has_sessions(journal: Path) -> bool:
    """Whether a journal holds a session (a header, or a header and a shard record, alone bind
    the folder to nothing yet)."""
    from dvfs.measure.journal import iter_records

    return journal.is_file() and any(r.get("type") == "session" for r in iter_records(journal))


class OtherShardError(JournalError):
    """A folder holding another shard, or the whole campaign: the wrong --out for this run,
    refused before anything is measured, as invalid input like a shard dealt otherwise."""

    exit_code = 2


def other_shard(folder: Path, recorded: Shard | None, shard: Shard | None) -> str:
    """The one line refusing a run of `shard` into a folder holding `recorded` (another shard,
    or the whole campaign when None)."""

    def text(s: Shard | None) -> str:
        return f"shard {s.label}" if s else "the whole campaign (no --shard)"

    return (
        f"{folder} holds {text(recorded)} of this campaign, but this run is {text(shard)}: "
        "give each shard its own --out folder"
    )


def recorded_shard(journal: Path, shard: Shard | None = None) -> Shard | None:
    """The shard a journal holds (its shard record), or None: the whole campaign, or no
    journal yet. `shard`: the run's, which a damaged record's refusal names."""
    from dvfs.measure.journal import iter_records

    if not journal.is_file():
        return None
    found = None
    for record in iter_records(journal):
        if record.get("type") == SHARD_RECORD and found is None:
            found = _shard_of(journal, record, shard)
    return found


def _shard_of(journal: Path, record: dict[str, Any], shard: Shard | None = None) -> Shard:
    """The shard a journal's (first) shard record names; a damaged one refused, naming the
    shard's own sweep command to start over with (`--fresh` without its `--shard` would
    sweep the whole campaign into the shard's folder): the run's `shard`, else `I/N`, and
    the folder the journal is in (without --out a shard sweeps into its default folder,
    leaving the damaged journal where it is)."""
    import shlex

    try:
        return Shard.from_json(record)
    except (KeyError, TypeError, ValueError) as exc:
        label = shard.label if shard is not None else "I/N"
        # a fleet mixing GPU models journals in the sweep folder's gpu-<model>/
        folder = journal.parent.parent if journal.parent.name.startswith("gpu-") else journal.parent
        raise JournalError(
            f"{journal} has a damaged shard record ({exc}): move it aside, or start that "
            f"shard over with `dvfs sweep CAMPAIGN --shard {label} --out "
            f"{shlex.quote(str(folder))} --fresh`, which renames it"
        ) from None


def folder_journals(out_dir: Path) -> list[Path]:
    """The journals a sweep into `out_dir` resumes: its own, and each GPU model's
    (`gpu-<model>/`, where a fleet mixing models journals), present or not."""
    from dvfs.measure.journal import JOURNAL_NAME

    return [out_dir / JOURNAL_NAME, *model_journal_paths(out_dir)]


def model_journal_paths(out_dir: Path) -> list[Path]:
    """Each GPU model's journal in `out_dir` (`gpu-*/journal.jsonl`), sorted: a symbolic link
    there in a loop or to nothing too, which a glob leaves out (its match must exist), so that
    the sweep, its dry run and `dvfs doctor` refuse it rather than start the folder over."""
    from dvfs.measure.journal import JOURNAL_NAME

    found = (d / JOURNAL_NAME for d in model_folders(out_dir))
    return [path for path in found if os.path.lexists(path)]


def model_folders(out_dir: Path) -> list[Path]:
    """`out_dir`'s `gpu-*` entries, sorted, each folder once: a symbolic link to another of
    them (`gpu-x -> gpu-nvidia-h100-...`) is that model's folder under a second name, not a
    model of its own: counted twice, its journal's cells were counted twice, and its cube
    merged with itself ("the same GPU twice"). Of the names of one folder, its own is kept
    (not a link), else the first."""
    kept: dict[str, Path] = {}
    for entry in sorted(out_dir.glob("gpu-*"), key=lambda d: (d.is_symlink(), d)):
        kept.setdefault(os.path.realpath(entry), entry)
    return sorted(kept.values())


def model_folder_journals(out_dir: Path) -> list[Path]:
    """Each GPU model folder's journal path in `out_dir` (`gpu-*/journal.jsonl`), sorted, a
    missing one too (moved or deleted: that model has every cell left), so that a fleet's
    count of its other models' cells, its cube's left-out models and whether it is done do
    not skip it. None where no model's journal is there (not a fleet mixing models: a
    `gpu-*` folder of the user's own beside a one-model run is none of dvfs's); nor, beside
    the models' journals, a `gpu-*` folder holding nothing dvfs leaves in a model's folder
    (`_model_folder_left`): the user's own, no GPU model with every cell left."""
    from dvfs.measure.journal import JOURNAL_NAME

    found = [d / JOURNAL_NAME for d in model_folders(out_dir) if d.is_dir()]
    if not any(os.path.lexists(path) for path in found):
        return []
    return [path for path in found if os.path.lexists(path) or _model_folder_left(path.parent)]


def _model_folder_left(folder: Path) -> bool:
    """Whether `folder`, a `gpu-*` folder without its journal, holds what a GPU model's run
    leaves in it besides: its cube (written by every run that measured on that model, an
    interrupted one's too), or a journal --fresh moved aside (`journal.jsonl.1`, ...): that
    model's journal moved or deleted since. A model whose journal held no session when it
    went leaves neither, and its folder is taken for the user's own: nothing there tells
    them apart."""
    from dvfs.cube.schema import CUBE_NAME
    from dvfs.measure.journal import JOURNAL_NAME

    if os.path.lexists(folder / CUBE_NAME):
        return True
    return any(p.name[len(JOURNAL_NAME) + 1 :].isdigit() for p in folder.glob(f"{JOURNAL_NAME}.*"))


def check_shard(journal: Path, shard: Shard | None) -> None:
    """Refuse a run of `shard` (None: the whole campaign) into the folder of `journal`, as
    `claim_shard` would once it opens it: a shard dealt otherwise (`check_deal`), or
    another shard or the whole campaign (its shard record, or a session without one). Before
    anything runs, so that a sweep and its dry run refuse alike."""
    recorded = recorded_shard(journal, shard)
    if shard is not None:
        check_deal(journal.parent, recorded)
    if recorded != shard and (recorded is not None or has_sessions(journal)):
        raise OtherShardError(other_shard(journal.parent, recorded, shard))


def shard_cube(journal: Path) -> xr.Dataset:
    """The cube of a journal, marked with the shard it holds (`mark_cube`), if any."""
    from dvfs.cube import build_cube

    shards: list[dict[str, Any]] = []

    def note(record: dict[str, Any]) -> None:
        if record.get("type") == SHARD_RECORD:
            shards.append(record)

    # One reading of the journal: the shard record is taken as the cube is built (on the
    # demo campaign a second reading cost a third of the build), and read once it is built,
    # as `recorded_shard` would read it.
    ds = build_cube(journal, others=note)
    mark_cube(ds, _shard_of(journal, shards[0]) if shards else None)
    return ds


def claim_shard(journal: Journal, shard: Shard | None) -> None:
    """Mark a new journal as `shard`'s; refuse one that holds another shard (or the whole
    campaign), or a shard dealt by an earlier dvfs (`check_deal`), so two shares never mix in
    one folder."""
    recorded = recorded_shard(journal.path, shard)
    if shard is not None:
        check_deal(journal.path.parent, recorded)
    if recorded == shard:
        return
    if recorded is None and not journal.sessions and not journal.finished():
        if shard is not None:
            journal.append(shard.to_json())
        return
    raise OtherShardError(other_shard(journal.path.parent, recorded, shard))
