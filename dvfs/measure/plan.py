"""Expanding a campaign into ordered cells.

Order matters on real hardware: a drafter change restarts the server (minutes), a knob change
needs a settle (seconds), a batch or corpus change costs nothing. So drafters are the outer
loop, then repeats, then knob settings, then corpus and batch. Knob settings run in a
serpentine (ascending, then descending on the next repeat) so slow drift, such as the card
warming up, does not line up with the clock axis and masquerade as an effect.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dvfs.campaign import Campaign
from dvfs.gpu.knobs import KnobSetting

#: Rough real-hardware costs for the closed-form duration (s), which `dvfs sweep --dry-run
#: --no-estimate` prints. It assumes the rounds that fill `min_window_s` and leaves out prefill,
#: drain, idle baselines, stabilisation and the rounds adaptive precision adds, so it reads
#: low (28.2 h for sweeps/h100-llama8b.toml, where its twin stand-in spends 38.8 h); without
#: --no-estimate the dry run sweeps the twin instead (`dvfs.dry_run.twin_estimate`).
SERVER_START_S = 120.0
ROUND_OVERHEAD_S = 0.5
TOKEN_TIME_S = 0.012


#: A cell's fields, in order (its pickled state).
_CELL_FIELDS = ("drafter", "repeat", "sm_clock_mhz", "power_limit_w", "batch", "corpus")


@dataclass(frozen=True, order=True)
class Cell:
    """One measurement: a drafter and corpus at a batch size under one knob setting.

    Slotted: a sweep plans every cell of its campaign up front (180,000 at 40 repeats of the
    demo), and a cell with a __dict__ for its cached key took about 100 bytes more."""

    __slots__ = (*_CELL_FIELDS, "_key")

    drafter: str
    repeat: int
    sm_clock_mhz: int | None
    power_limit_w: float | None
    batch: int
    corpus: str

    @property
    def setting(self) -> KnobSetting:
        return KnobSetting(self.sm_clock_mhz, self.power_limit_w)

    @property
    def key(self) -> str:
        """A stable text key (the journal's index): `asdict`'s fields (plain values) as sorted
        JSON, worked out once a cell (frozen: kept in its `_key` slot)."""
        key: str | None = getattr(self, "_key", None)
        if key is not None:
            return key
        key = json.dumps(
            {
                "drafter": self.drafter,
                "repeat": self.repeat,
                "sm_clock_mhz": self.sm_clock_mhz,
                "power_limit_w": self.power_limit_w,
                "batch": self.batch,
                "corpus": self.corpus,
            },
            sort_keys=True,
        )
        object.__setattr__(self, "_key", key)
        return key

    def __getstate__(self) -> tuple:
        return tuple(getattr(self, name) for name in _CELL_FIELDS)

    def __setstate__(self, state: tuple) -> None:
        # (frozen: the fields set as its __init__ sets them; the key worked out again)
        for name, value in zip(_CELL_FIELDS, state, strict=True):
            object.__setattr__(self, name, value)

    @staticmethod
    def from_dict(data: dict) -> Cell:
        return Cell(
            drafter=data["drafter"],
            repeat=int(data["repeat"]),
            sm_clock_mhz=None if data["sm_clock_mhz"] is None else int(data["sm_clock_mhz"]),
            power_limit_w=None if data["power_limit_w"] is None else float(data["power_limit_w"]),
            batch=int(data["batch"]),
            corpus=data["corpus"],
        )


def cell_label(cell: Cell) -> str:
    """A cell as progress, the sweep's lines and `dvfs cube info` name it:
    "none/code/b4/r0 @ 1980 MHz, stock limit"."""
    clock = f"{cell.sm_clock_mhz} MHz" if cell.sm_clock_mhz is not None else "stock clock"
    limit = f"{cell.power_limit_w:g} W" if cell.power_limit_w is not None else "stock limit"
    return f"{cell.drafter}/{cell.corpus}/b{cell.batch}/r{cell.repeat} @ {clock}, {limit}"


def _sorted_settings(campaign: Campaign) -> list[KnobSetting]:
    """Power limits descending (outer), clocks descending (inner): start from stock-like."""
    clocks = sorted(campaign.knobs.sm_clocks_mhz or [None], key=lambda c: -(c or 0))
    limits = sorted(campaign.knobs.power_limits_w or [None], key=lambda p: -(p or 0))
    return [KnobSetting(c, p) for p in limits for c in clocks]


#: The most planned cells a dry run (and `dvfs doctor`'s shard check) lists one by one, to
#: count what a folder holds, deal shards and estimate: about ten seconds and under a GiB. A
#: campaign the validator admits (up to `MOST_REPEATS` repeats) may plan a hundred times more,
#: which listed would run for minutes and out of memory: such a dry run is refused in one line.
MOST_LISTED_CELLS = 1_000_000
#: The most planned cells the dry run's twin estimate sweeps, each in turn in virtual time
#: (80,000 small cells took 3.5 minutes and 1.5 GiB; sweeps/h100-llama8b.toml plans 12,375);
#: above it the dry run gives the closed form's rough figure, saying why.
MOST_ESTIMATED_CELLS = 50_000


def planned_cell_count(campaign: Campaign) -> int:
    """How many cells `plan_cells` lists, counted without listing them."""
    w = campaign.workload
    settings = len(_sorted_settings(campaign))
    return (
        len(campaign.drafters)
        * campaign.measurement.repeats
        * settings
        * len(w.corpus_names)
        * len(w.batch_sizes)
    )


def too_many_to_list(campaign: Campaign, what: str) -> str | None:
    """The line refusing `what` (a dry run) for a campaign planning more cells than it lists
    promptly (`MOST_LISTED_CELLS`), counted without listing them; None where it lists them."""
    count = planned_cell_count(campaign)
    if count <= MOST_LISTED_CELLS:
        return None
    repeats = campaign.measurement.repeats
    return (
        f"campaign {campaign.name!r} plans {count:,} cells ({repeats:,} repeats of "
        f"{count // repeats:,}): more than {what} lists ({MOST_LISTED_CELLS:,} at most); plan "
        "fewer measurement.repeats (max_repeats adds repeats only where a group needs them) "
        "or a smaller grid"
    )


def plan_cells(campaign: Campaign) -> list[Cell]:
    """Every cell of the campaign, in measuring order."""
    settings = _sorted_settings(campaign)
    cells = []
    for drafter in campaign.drafters:
        for repeat in range(campaign.measurement.repeats):
            ordered = settings if repeat % 2 == 0 else list(reversed(settings))
            for setting in ordered:
                for corpus in campaign.workload.corpus_names:
                    for batch in campaign.workload.batch_sizes:
                        cells.append(
                            Cell(
                                drafter.name,
                                repeat,
                                setting.sm_clock_mhz,
                                setting.power_limit_w,
                                batch,
                                corpus,
                            )
                        )
    return cells


@dataclass(frozen=True)
class PlanSummary:
    cells: int
    remaining: int
    server_starts: int
    knob_changes: int
    estimated_s: float
    #: `estimated_s`'s parts: each cell's, each server start's and each knob change's.
    per_cell_s: float = 0.0
    start_s: float = 0.0
    settle_s: float = 0.0


def summarise_plan(campaign: Campaign, cells: list[Cell], done: set[str]) -> PlanSummary:
    """Counts and a closed-form, rough (low) real-hardware duration for the cells still to
    run."""
    todo = [c for c in cells if c.key not in done]
    starts = len({c.drafter for c in todo})
    changes = 0
    previous: tuple | None = None
    for cell in todo:
        here = (cell.sm_clock_mhz, cell.power_limit_w)
        # Stock knobs (unset, or --observe-only) never change the GPU: nothing to count.
        if here != previous and here != (None, None):
            changes += 1
        previous = here
    m = campaign.measurement
    w = campaign.workload
    round_s = ROUND_OVERHEAD_S + w.output_tokens * TOKEN_TIME_S
    rounds = max(1, min(m.max_rounds, int(-(-m.min_window_s // round_s))))
    warmup_s = ROUND_OVERHEAD_S + m.warmup_tokens * TOKEN_TIME_S if m.warmup_tokens else 0.0
    per_cell = warmup_s + rounds * round_s
    # An attached server (engine.sglang.url) runs already: attaching costs no start.
    attached = campaign.engine.backend == "sglang" and bool(campaign.engine.sglang.url)
    start_s = 0.0 if attached else SERVER_START_S
    estimated = starts * start_s + changes * campaign.knobs.settle_s + len(todo) * per_cell
    return PlanSummary(
        len(cells),
        len(todo),
        starts,
        changes,
        estimated,
        per_cell,
        start_s,
        campaign.knobs.settle_s,
    )
