"""`--shard i/n`: a deterministic slice of a campaign's cells, for job arrays without Ray.

The cells are cut, in measuring order (drafters outermost), into `n` contiguous runs of
near-equal length: the slices are balanced, every drafter's cells stay together except where a
cut falls inside them, so all the shards together start at most `drafters + n - 1` servers,
and the same campaign always gives the same slices on every machine.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dvfs.errors import CampaignError
from dvfs.measure.plan import Cell

#: The journal record that marks a shard's journal (after the header).
SHARD_RECORD = "shard"

_SPEC = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*\Z")


@dataclass(frozen=True)
class Shard:
    """Shard `index` (0-based) of `count`."""

    index: int
    count: int

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

    def bounds(self, total: int) -> tuple[int, int]:
        """The slice [start, stop) of `total` ordered cells this shard runs."""
        return (self.index * total // self.count, (self.index + 1) * total // self.count)

    def select(self, cells: Sequence[Cell]) -> list[Cell]:
        """This shard's cells, in measuring order; a shard with none is refused (more shards
        than cells), since its empty run could never be merged with the others."""
        start, stop = self.bounds(len(cells))
        if start == stop:
            raise CampaignError(
                f"shard {self.label} has no cells: the campaign has {len(cells)} cell(s), so "
                f"split it into at most {len(cells)} shards"
            )
        return list(cells[start:stop])

    def to_json(self) -> dict[str, Any]:
        return {"type": SHARD_RECORD, "index": self.index, "count": self.count}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Shard:
        return cls(int(record["index"]), int(record["count"]))


def server_starts(cells: Sequence[Cell]) -> int:
    """Servers a run of `cells` in this order starts (one per change of drafter)."""
    starts = 0
    previous: str | None = None
    for cell in cells:
        if cell.drafter != previous:
            starts += 1
        previous = cell.drafter
    return starts
