"""`--shard i/n`: a deterministic share of a campaign's comparison groups, for job arrays
without Ray, and how a shard's cube names its shard (`mark_cube`, `cube_shard`).

Shards run on different GPUs, so they are dealt whole comparison groups (`group_of`: the cells
of one batch, corpus and repeat, every drafter and knob setting of them), as the fleet's queue
deals them to workers: the arms of a comparison never differ by the GPU that measured them.
When the campaign adds repeats as it goes (`max_repeats` above `repeats`), each repeat after
the planned ones is decided from the repeats before it in the shard's own journal, so all the
repeats of a batch and corpus are dealt together and the repeats they add stay in that shard.
The groups are dealt in measuring order, each to the shard with the fewest cells so far (ties
to the lowest index): the same campaign gives the same shares on every machine, and no two
shards differ by more than the cells of one thing dealt. Each shard runs its cells in
measuring order, drafter-major, so it starts one server per drafter it holds: with every
drafter in every shard, `n` shards start `n` times as many servers as the whole campaign on
one GPU.

The shard record and a shard's cube name the dealing (`DEAL`): an earlier dvfs cut contiguous
slices of the cells and wrote no dealing, so a folder it began holds another share of the same
`i/n`, and resuming it, or merging it with shards dealt here, is refused.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dvfs.campaign import Campaign
from dvfs.errors import CampaignError, JournalError
from dvfs.fleet.queue import group_of
from dvfs.measure.plan import Cell, plan_cells

if TYPE_CHECKING:
    import xarray as xr

#: The journal record that marks a shard's journal (after the header).
SHARD_RECORD = "shard"

#: How `Shard.select` deals cells, as shard records and cubes (`attrs["shard_deal"]`) name it:
#: whole comparison groups. None: a record or cube of an earlier dvfs, which cut contiguous
#: slices of the cells in measuring order.
DEAL = "groups"

_SPEC = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*\Z")


@dataclass(frozen=True)
class Shard:
    """Shard `index` (0-based) of `count`, its cells dealt as `deal` says (`DEAL` for every
    shard this dvfs runs; another value only as read from a journal or cube)."""

    index: int
    count: int
    deal: str | None = DEAL

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index}/{self.count}: the index runs 0..count-1")

    @classmethod
    def parse(cls, text: str) -> Shard:
        """`i/n`, with 0 <= i < n (Slurm: `--shard $SLURM_ARRAY_TASK_ID/N` with
        `--array=0-(N-1)`); a `ValueError` says what is wrong."""
        match = _SPEC.match(text)
        if not match:
            raise ValueError(f"{text!r} is not i/n (e.g. 0/4: the first of four shards)")
        index, count = int(match[1]), int(match[2])
        if count < 1:
            raise ValueError(f"{text!r}: the shard count must be at least 1")
        if index >= count:
            raise ValueError(
                f"{text!r}: shards of {count} are numbered 0 to {count - 1} "
                f"(Slurm: --array=0-{count - 1})"
            )
        return cls(index, count)

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"

    def select(self, cells: Sequence[Cell], *, repeats_together: bool = False) -> list[Cell]:
        """This shard's cells (`cells` in measuring order), in measuring order: whole comparison
        groups (with `repeats_together`, every repeat of a batch and corpus), dealt as the
        module says. More shards than groups is refused, whatever the index: some shard would
        be empty, and a run missing a shard can never be merged."""
        if self.deal != DEAL:
            raise ValueError(f"shard {self.label}: cells dealt as {self.deal!r} are not planned")
        units = _units(cells, repeats_together)
        if self.count > len(units):
            what = (
                "batch-and-corpus pairs (their repeats stay together, since max_repeats adds "
                "repeats from the earlier ones)"
                if repeats_together
                else "comparison groups (the cells of one batch, corpus and repeat, kept whole "
                "on one GPU)"
            )
            raise CampaignError(
                f"shard {self.label}: the campaign has {len(units)} {what}, so split it into "
                f"at most {len(units)} shards"
            )
        shards = [(0, i) for i in range(self.count)]  # (cells so far, index): a heap
        mine: set[Hashable] = set()
        for unit, size in units.items():
            load, shard = heapq.heappop(shards)  # the fewest cells, then the lowest index
            heapq.heappush(shards, (load + size, shard))
            if shard == self.index:
                mine.add(unit)
        return [c for c in cells if _unit_of(c, repeats_together) in mine]

    def to_json(self) -> dict[str, Any]:
        return {"type": SHARD_RECORD, "index": self.index, "count": self.count, "deal": self.deal}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Shard:
        """The shard a journal's shard record names; without `deal`, an earlier dvfs's."""
        deal = record.get("deal")
        return cls(int(record["index"]), int(record["count"]), None if deal is None else str(deal))

    @property
    def dealt_as(self) -> str:
        """How this shard's cells were dealt, in words."""
        if self.deal == DEAL:
            return "whole comparison groups"
        if self.deal is None:
            return "contiguous slices, by an earlier dvfs"
        return f"dealt as {self.deal!r}"


class ShardDealError(JournalError):
    """A shard folder begun by a dvfs that dealt cells otherwise: refused as invalid input."""

    exit_code = 2


def check_deal(folder: Path, recorded: Shard | None) -> None:
    """Refuse to resume a shard journal (in `folder`) whose cells were dealt otherwise than
    `Shard.select` deals them: this run's share of the same i/n differs, and the folder would
    end up holding parts of two shares that merge with neither."""
    if recorded is None or recorded.deal == DEAL:
        return
    who = (
        "an earlier dvfs that cut contiguous slices of the cells"
        if recorded.deal is None
        else f"a dvfs that dealt its cells as {recorded.deal!r}"
    )
    raise ShardDealError(
        f"{folder} holds shard {recorded.label} begun by {who}; this dvfs deals whole "
        f"comparison groups, so its shard {recorded.label} is another share: finish that folder "
        "with the dvfs that began it, or rerun every shard of the array with --fresh"
    )


def _unit_of(cell: Cell, repeats_together: bool) -> Hashable:
    """What is dealt whole: the cell's comparison group, or its batch and corpus."""
    group = group_of(cell)
    return group[:2] if repeats_together else group


def _units(cells: Sequence[Cell], repeats_together: bool) -> dict[Hashable, int]:
    """Each dealt unit's cell count, in the order its first cell is measured."""
    sizes: dict[Hashable, int] = {}
    for cell in cells:
        unit = _unit_of(cell, repeats_together)
        sizes[unit] = sizes.get(unit, 0) + 1
    return sizes


def planned_cells(campaign: Campaign, shard: Shard | None = None) -> list[Cell]:
    """The cells a sweep plans (`plan_cells`): all of them, or `shard`'s (every repeat of a
    batch and corpus together when the campaign adds repeats as it goes)."""
    cells = plan_cells(campaign)
    if shard is None:
        return cells
    m = campaign.measurement
    return shard.select(cells, repeats_together=m.max_repeats > m.repeats)


def server_starts(cells: Sequence[Cell]) -> int:
    """Servers a run of `cells` in this order starts (one per change of drafter): one per
    drafter for a shard's cells, which run drafter-major."""
    starts = 0
    previous: str | None = None
    for cell in cells:
        if cell.drafter != previous:
            starts += 1
        previous = cell.drafter
    return starts


#: The cube attributes that mark a shard's cube: its `i/n`, and how its cells were dealt
#: (`Shard.deal`; absent in the cube of a shard cut by an earlier dvfs).
SHARD_ATTR = "shard"
DEAL_ATTR = "shard_deal"


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


def cube_shard_groups(ds: xr.Dataset) -> set[tuple[int, str, int]] | None:
    """The comparison groups (batch, corpus, repeat) a shard's cube holds as its own: those
    its recorded campaign (`campaign_source`) deals its shard (`planned_cells`, as its sweep
    dealt them; with adaptive repeats every repeat of its batches and corpora, up to
    `max_repeats`). The rest of its grid is the other shards' cells. None for a cube of no
    shard, or one whose campaign or shard it cannot read again (dealt otherwise, an edited
    campaign this dvfs refuses)."""
    import tomllib

    from dvfs.campaign import parse_campaign

    try:
        shard = cube_shard(ds)
        source = str(ds.attrs.get("campaign_source") or "")
        if shard is None or not source.strip():
            return None
        campaign = parse_campaign(tomllib.loads(source), source=source)
        cells = planned_cells(campaign, shard)
    except (ValueError, CampaignError):  # tomllib's and the deal's are ValueErrors
        return None
    m = campaign.measurement
    return {
        (cell.batch, cell.corpus, repeat)
        for cell in cells
        for repeat in (range(m.max_repeats) if m.max_repeats > m.repeats else [cell.repeat])
    }
