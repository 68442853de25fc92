"""The driver of a campaign on many GPU groups: one journal, written as the cells arrive.

The driver opens the output folder's lock and journal, plans the cells (a shard's, when
sharded) and puts the unfinished ones in a `CellQueue`. An executor (`local.py`: threads of
this process; `ray_executor.py`: Ray actors) opens one `Worker` per GPU group and calls back
here: `open_session` with every worker's session (journalled as one session over all their
GPUs), `shipped` for each finished cell (its records journalled at once, so the driver's
journal alone resumes the campaign), `lost` when a worker dies (its cell goes back to the
queue). Then the cube is written as after any sweep.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dvfs.campaign import Campaign
from dvfs.errors import CampaignError, CubeError, JournalError
from dvfs.fleet.devices import Group, group_label
from dvfs.fleet.queue import CellQueue
from dvfs.fleet.shard import Shard
from dvfs.fleet.worker import Shipment
from dvfs.measure.journal import Journal
from dvfs.measure.plan import Cell
from dvfs.measure.runner import Progress, RunSummary, cell_label


@dataclass
class WorkerStats:
    """One worker as progress shows it."""

    label: str
    host: str = ""
    done: int = 0
    failed: int = 0
    current: str = ""
    gpu_time_s: float = 0.0
    busy_wall_s: float = 0.0
    lost: str | None = None
    _since: float = field(default=0.0, repr=False)

    def eta_s(self, remaining_per_worker: float) -> float | None:
        """Wall seconds this worker needs for its share of what is left, at its pace."""
        if not self.done:
            return None
        return remaining_per_worker * self.busy_wall_s / self.done


class FleetProgress(Progress, Protocol):
    """Progress for many workers: the whole campaign (as `Progress`), and each worker."""

    def worker(self, stats: WorkerStats, eta_s: float | None) -> None: ...


@dataclass(frozen=True)
class FleetOutcome:
    summary: RunSummary
    journal_path: Path
    cube_path: Path | None
    moved_journal: Path | None
    workers: tuple[WorkerStats, ...]
    wall_s: float

    @property
    def makespan_gpu_s(self) -> float:
        """The campaign's length in GPU time: its slowest worker's (virtual on the twin)."""
        return max((w.gpu_time_s for w in self.workers), default=0.0)


def combine_sessions(sessions: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The workers' sessions as the journal's one session: every GPU, the mean idle power of
    a group, and each worker's own part. Refuses workers whose GPUs differ in model or stock
    settings: their cells would not compare within one cube."""
    first = sessions[0]
    names = sorted({g["name"] for s in sessions for g in s["gpus"]})
    if len(names) > 1:
        raise CampaignError(
            f"the workers' GPUs are of different models ({', '.join(names)}): run the campaign "
            "once per model (its own --out each) and `dvfs cube merge` the cubes into one with "
            "a gpu dimension"
        )
    for s in sessions[1:]:
        if s["stock"] != first["stock"]:
            raise JournalError(
                f"worker {s.get('worker')}'s GPUs start from other stock settings "
                f"({s['stock']}) than worker {first.get('worker')}'s ({first['stock']}): "
                "their stock cells would not compare; reset them (`dvfs gpu reset`) or leave "
                "them out of --gpus"
            )
    combined = {k: v for k, v in first.items() if k != "worker"}
    idle = [float(s["idle_power_w"]) for s in sessions]
    combined.update(
        gpus=[g for s in sessions for g in s["gpus"]],
        idle_power_w=sum(idle) / len(idle),
        host=", ".join(dict.fromkeys(str(s.get("host", "")) for s in sessions)),
        workers=[
            {
                "worker": s.get("worker"),
                "host": s.get("host", ""),
                "gpus": [g["uuid"] for g in s["gpus"]],
                "idle_power_w": s["idle_power_w"],
            }
            for s in sessions
        ],
    )
    return combined


class Driver:
    """The executors' callbacks: journal, queue and progress, all on the driver's thread."""

    def __init__(
        self,
        campaign: Campaign,
        journal: Journal,
        cells: Sequence[Cell],
        progress: Progress | None = None,
        corpora: tuple[dict[str, Any], str] | None = None,
    ) -> None:
        from dvfs.measure.runner import NullProgress

        self.campaign = campaign
        self.journal = journal
        #: The corpora, loaded and counted once (local workers share them).
        self.corpora = corpora
        done = journal.finished()
        self.todo = [c for c in cells if c.key not in done]
        self.total = len(cells)
        self.queue = CellQueue(self.todo)
        self.progress: Progress = progress or NullProgress()
        self.stats: dict[str, WorkerStats] = {}
        self.measured = 0
        self.failed: list[str] = []
        self._outstanding = {c.key for c in self.todo}

    @property
    def finished(self) -> bool:
        return not self._outstanding

    def note(self, message: str) -> None:
        self.progress.note(message)

    def open_session(self, sessions: Sequence[dict[str, Any]]) -> None:
        """Journal one session over every worker's GPUs (same GPUs as earlier sessions)."""
        combined = combine_sessions(sessions)
        current = [g["uuid"] for g in combined["gpus"]]
        for earlier in self.journal.sessions:
            before = [g["uuid"] for g in earlier["gpus"]]
            if before != current:
                raise JournalError(
                    f"{self.journal.path} was started on GPU(s) {', '.join(before)}, but this "
                    f"run has {', '.join(current)}; a journal holds one GPU set: resume with the "
                    "same GPUs, or use another --out folder and `dvfs cube merge` the cubes"
                )
        self.journal.append(combined)
        for s in sessions:
            label = str(s.get("worker"))
            self.stats[label] = WorkerStats(label, host=str(s.get("host", "")))

    def started(self, worker: str, cell: Cell) -> None:
        stats = self.stats.setdefault(worker, WorkerStats(worker))
        stats.current = cell_label(cell)
        stats._since = time.monotonic()
        self._show(stats)

    def shipped(self, worker: str, shipment: Shipment) -> None:
        """Journal a finished cell's records at once, then count it."""
        for record in shipment.records:
            self.journal.append(record)
        for message in shipment.notes:
            self.note(f"{worker}: {message}")
        stats = self.stats.setdefault(worker, WorkerStats(worker))
        stats.done += 1
        stats.gpu_time_s = shipment.gpu_time_s
        if stats._since:
            stats.busy_wall_s += time.monotonic() - stats._since
        stats.current = ""
        cell = shipment.cell
        self._outstanding.discard(cell.key)
        if shipment.status == "ok":
            self.measured += 1
        else:
            stats.failed += 1
            self.failed.append(cell_label(cell))
        self.progress.advance(cell, shipment.status)
        self._show(stats)

    def lost(self, worker: str, cell: Cell | None, why: str) -> None:
        """A worker died: its unfinished cell goes back to the queue for the others."""
        stats = self.stats.setdefault(worker, WorkerStats(worker))
        stats.lost = why
        stats.current = ""
        if cell is not None and cell.key in self._outstanding:
            self.queue.give_back([cell])
        self.queue.leave(worker)
        self.note(f"worker {worker} lost ({why}); its unfinished cell goes to the others")
        self._show(stats)

    def _show(self, stats: WorkerStats) -> None:
        show = getattr(self.progress, "worker", None)
        if show is None:
            return
        alive = sum(1 for s in self.stats.values() if s.lost is None) or 1
        show(stats, stats.eta_s(len(self._outstanding) / alive))

    def check_finished(self) -> None:
        """After the executor returns: cells left over mean every worker was lost."""
        if self.finished:
            return
        lost = [f"{s.label}: {s.lost}" for s in self.stats.values() if s.lost]
        raise JournalError(
            f"every worker was lost with {len(self._outstanding)} cell(s) left"
            + (f" ({'; '.join(lost[:3])})" if lost else "")
            + ": the journal keeps every finished cell; rerun the same command to resume"
        )

    def summary(self) -> RunSummary:
        return RunSummary(
            self.total,
            self.total - len(self.todo),
            self.measured,
            len(self.failed),
            tuple(self.failed),
        )


#: An executor runs the driver's queue on its workers: (driver, groups) -> None.
Executor = Callable[["Driver", Sequence[Group]], None]


def run_fleet(
    campaign: Campaign,
    out_dir: Path,
    groups: Sequence[Group],
    executor: Executor,
    *,
    fresh: bool = False,
    progress: Progress | None = None,
    shard: Shard | None = None,
) -> FleetOutcome:
    """Run every unfinished cell of `campaign` (or of its `shard`) on one worker per GPU
    group, through `executor`, into one journal in `out_dir`; then write the cube."""
    from dvfs.backends import virtual_time
    from dvfs.corpora.prepare import check_corpora, counted_corpora
    from dvfs.cube import CUBE_NAME, write_cube
    from dvfs.fleet.shard_journal import shard_cube
    from dvfs.measure.journal import JOURNAL_NAME, SyncPolicy
    from dvfs.measure.plan import plan_cells
    from dvfs.sweep import claim_shard, fresh_start, out_dir_lock

    labels = [group_label(g) for g in groups]
    if len(set(labels)) != len(labels):
        raise CampaignError("a GPU appears in two worker groups")
    wall0 = time.monotonic()
    with out_dir_lock(out_dir):
        moved = fresh_start(out_dir) if fresh else None
        if moved is not None and progress is not None:
            progress.note(f"moved the previous journal to {moved}")
        with Journal.open(out_dir / JOURNAL_NAME, campaign) as journal:
            corpora = counted_corpora(campaign)
            check_corpora(campaign, corpora[0])  # before any GPU is touched
            claim_shard(journal, shard)
            journal.sync_policy = SyncPolicy.for_clock(virtual_time(campaign))
            cells = plan_cells(campaign)
            if shard is not None:
                cells = shard.select(cells)
            driver = Driver(campaign, journal, cells, progress, corpora)
            driver.progress.start(driver.total, driver.total - len(driver.todo))
            if driver.todo:
                executor(driver, groups)
                driver.check_finished()
        try:
            cube_path = write_cube(shard_cube(journal.path), out_dir / CUBE_NAME)
        except CubeError as exc:
            raise CubeError(
                f"{exc} (every measured cell is in {journal.path}: `dvfs cube build {out_dir}` "
                "writes the cube once that is fixed)"
            ) from exc
    return FleetOutcome(
        driver.summary(),
        journal.path,
        cube_path,
        moved,
        tuple(driver.stats.values()),
        time.monotonic() - wall0,
    )
