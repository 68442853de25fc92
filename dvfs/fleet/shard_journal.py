"""A shard's journal and cube: which shard a journal holds, and its cube marked with it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dvfs.fleet.shard import SHARD_RECORD, Shard

if TYPE_CHECKING:
    import xarray as xr

#: The cube attributes that mark a shard's cube: its `i/n`, and how its cells were dealt
#: (`Shard.deal`; absent in the cube of a shard cut by an earlier dvfs).
SHARD_ATTR = "shard"
DEAL_ATTR = "shard_deal"


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


def mark_cube(ds: xr.Dataset, shard: Shard | None) -> None:
    """Mark `ds` as `shard`'s cube (or as no shard's), as `cube_shard` reads it back."""
    for key in (SHARD_ATTR, DEAL_ATTR):
        ds.attrs.pop(key, None)
    if shard is not None:
        ds.attrs[SHARD_ATTR] = shard.label
        if shard.deal is not None:
            ds.attrs[DEAL_ATTR] = shard.deal


def cube_shard(ds: xr.Dataset) -> Shard | None:
    """The shard a cube holds (None: not a shard's); a `ValueError` for a damaged mark."""
    if SHARD_ATTR not in ds.attrs:
        return None
    shard = Shard.parse(str(ds.attrs[SHARD_ATTR]))
    deal = ds.attrs.get(DEAL_ATTR)
    return Shard(shard.index, shard.count, None if deal is None else str(deal))


def shard_cube(journal: Path) -> xr.Dataset:
    """The cube of a journal, marked with the shard it holds (`mark_cube`), if any."""
    from dvfs.cube import build_cube

    ds = build_cube(journal)
    mark_cube(ds, recorded_shard(journal))
    return ds
