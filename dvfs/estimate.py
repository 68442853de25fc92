"""The dry run's arithmetic for a fleet: from one GPU's sweep of the cells left, what the
fleet's workers spend together and how long the busiest runs.

A fleet runs each comparison group whole on one worker (`dvfs.fleet.queue`). Each worker is a
session of its own on its own GPU: it starts its drafters' servers (and waits out the thermal
stabilisation after each), steps its GPU's knobs for every cell whose setting differs from the
one it left there (a settle each time), takes the idle baseline at each knob setting it visits
(once a session) and pays the session's opening overhead. None of that is shared out between
workers; the rest of a cell's time (warm-up, prefill, windows, drain, retries) is the cell's,
wherever it runs. `fleet_time` counts each as the fleet's queue hands the cells out
(`simulated_loads`). Pure: no GPU, no file, no sweep.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dvfs.fleet.queue import simulated_loads
from dvfs.measure.plan import Cell


@dataclass(frozen=True)
class RunCosts:
    """One GPU's sweep of the cells left (one session), split into each cell's own time and
    what a fleet's every worker spends again on its own GPU."""

    #: Each cell's own GPU time (by `Cell.key`): warm-up, prefill, windows, drain, retries.
    cell_s: Mapping[str, float]
    #: Its server starts, with the thermal stabilisation after each.
    start_s: float = 0.0
    #: Its knob changes' settles.
    settle_s: float = 0.0
    #: Its idle baselines at each knob setting.
    idle_s: float = 0.0
    #: Its session's opening overhead (counter detection, idle baseline, settle measurement).
    session_s: float = 0.0
    #: How many server starts, knob changes and settings' idle baselines it made, where known
    #: (a sweep's journal says): with adaptive repeats it also runs cells beyond those left
    #: (the further repeats it asks for as it goes), with their own starts and changes, which
    #: the cells left do not count. None: as many as the cells left make (the closed form's).
    starts: int | None = None
    changes: int | None = None
    settings: int | None = None

    @property
    def total_s(self) -> float:
        return math.fsum(
            [*self.cell_s.values(), self.start_s, self.settle_s, self.idle_s, self.session_s]
        )


@dataclass(frozen=True)
class FleetTime:
    """What `workers` workers spend running the cells left (`fleet_time`)."""

    #: Every worker's GPU time, together.
    gpu_s: float
    #: The busiest worker's GPU time: the fleet's time from start to end.
    makespan_s: float
    server_starts: int
    knob_changes: int
    #: The workers that run at least one cell.
    busy_workers: int
    #: Each worker's GPU time, in the workers' order.
    worker_s: tuple[float, ...]


def fleet_time(cells: Sequence[Cell], run: RunCosts, workers: int) -> FleetTime:
    """The GPU time of `workers` workers running `cells` (the cells left, in measuring order)
    through the fleet's queue, from `run`, one GPU's sweep of them: a server start, a knob
    change and a setting's idle baseline cost what they cost on average in `run` (one worker
    runs the cells as `run` did, so its `gpu_s` is `run.total_s`), each cell what it cost
    there, and every worker (busy or not) opens its own session. The queue hands the next
    cell to the worker that has spent the least so far (`simulated_loads`)."""
    one = simulated_loads(cells, 1)[0]
    # What `run` made of each (at least what `cells` make): a start, a change or a setting it
    # made beyond those of `cells` was for the cells it ran beyond them (further repeats), not
    # a dearer one of theirs.
    starts = max(one.starts, run.starts or 0)
    changes = max(one.changes, run.changes or 0)
    settings = max(one.settings, run.settings or 0)
    per_start = run.start_s / starts if starts else 0.0
    per_change = run.settle_s / changes if changes else 0.0
    per_setting = run.idle_s / settings if settings else 0.0
    # A cost `run` spent on what the cells' order does not count (none of them): every busy
    # worker spends it once, as its session.
    uncounted = math.fsum(
        [
            0.0 if starts else run.start_s,
            0.0 if changes else run.settle_s,
            0.0 if settings else run.idle_s,
        ]
    )
    # Cells `run` measured beyond `cells` (further repeats adaptive precision asked for as it
    # ran), with the starts, changes and settings it made for them: the fleet runs them too,
    # shared out between its busy workers.
    keys = {c.key for c in cells}
    beyond = math.fsum(
        [
            *(s for key, s in run.cell_s.items() if key not in keys),
            (starts - one.starts) * per_start,
            (changes - one.changes) * per_change,
            (settings - one.settings) * per_setting,
        ]
    )
    loads = simulated_loads(
        cells,
        workers,
        cell_s=run.cell_s,
        start_s=per_start,
        change_s=per_change,
        setting_s=per_setting,
    )
    busy = sum(1 for load in loads if load.cells)
    worker_s = tuple(
        math.fsum(
            [
                run.session_s,
                *(run.cell_s.get(c.key, 0.0) for c in load.cells),
                load.starts * per_start,
                load.changes * per_change,
                load.settings * per_setting,
                (beyond / busy + uncounted) if load.cells else 0.0,
            ]
        )
        for load in loads
    )
    idle_fleet = 0.0 if busy else beyond + uncounted  # no cell to run: nothing but sessions
    return FleetTime(
        gpu_s=math.fsum(worker_s) + idle_fleet,
        makespan_s=max(worker_s, default=0.0) + idle_fleet,
        server_starts=sum(load.starts for load in loads),
        knob_changes=sum(load.changes for load in loads),
        busy_workers=busy,
        worker_s=worker_s,
    )
