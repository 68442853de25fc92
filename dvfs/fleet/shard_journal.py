"""A shard's journal and cube: which shard a journal holds, and its cube marked with it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dvfs.fleet.shard import SHARD_RECORD, Shard, mark_cube

if TYPE_CHECKING:
    import xarray as xr


def recorded_shard(journal: Path) -> Shard | None:
    """The shard a journal holds (its shard record), or None: the whole campaign, or no
    journal yet."""
    from dvfs.measure.journal import iter_records

    if not journal.is_file():
        return None
    found = None
    for record in iter_records(journal):
        if record.get("type") == SHARD_RECORD and found is None:
            found = Shard.from_json(record)
    return found


def shard_cube(journal: Path) -> xr.Dataset:
    """The cube of a journal, marked with the shard it holds (`mark_cube`), if any."""
    from dvfs.cube import build_cube

    ds = build_cube(journal)
    mark_cube(ds, recorded_shard(journal))
    return ds
